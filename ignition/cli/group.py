"""The ``ignition`` Typer application, whose command group maps every :class:`CliError` a command raises to
its message and exit code (cli/errors.py), and the top-level ``--version``."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from ignition.cli.console import console
from ignition.cli.errors import CliError, report


class Commands(TyperGroup):
    """The one place a command's :class:`CliError` becomes its message on stderr and its exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CliError as error:
            raise typer.Exit(report(error, console)) from None


app = typer.Typer(cls=Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ignition: export LLM checkpoints to validated cores with in-graph logprobs.")


def version_text() -> str:
    """``ignition X (torch Y)``: the installed distributions' versions, read without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("ignition")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        from ignition import __version__ as own
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"ignition {own} (torch {torch_version})"


def _print_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit"),
) -> None:
    """Ignition: export LLM checkpoints to validated cores with in-graph logprobs."""
