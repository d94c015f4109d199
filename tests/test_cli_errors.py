"""The command line's one error hierarchy: each CliError a command raises becomes its message and exit code in
one place (cli/group.py), and ``python -m ignition`` is the ``ignition`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ignition.cli.errors import EXIT_CORE, EXIT_INTERNAL, EXIT_USAGE, CliError, CoreError, UsageError
from ignition.cli.group import Commands

REPO = Path(__file__).resolve().parents[1]


def _app_raising(error: Exception) -> typer.Typer:
    app = typer.Typer(cls=Commands, add_completion=False)

    @app.command()
    def fail() -> None:
        raise error

    @app.command()
    def other() -> None:  # two commands: the group dispatches, as ``ignition`` does
        pass

    return app


@pytest.mark.parametrize("error, code, line", [
    (UsageError("--port must be at most 65535, got 70000"), 2, "error: --port must be at most 65535, got 70000"),
    (CoreError("variant decode.c1: [/not markup]", label="core error"), 1, "core error: variant decode.c1: [/not markup]"),
    (CoreError("a rank died", label="cannot load core"), 1, "cannot load core: a rank died"),
])
def test_each_error_maps_to_its_exit_code_and_one_line(error, code, line):
    result = CliRunner().invoke(_app_raising(error), ["fail"])
    assert (result.exit_code, result.output.strip()) == (code, line)


def test_the_codes_are_the_documented_ones():
    assert (UsageError.exit_code, CoreError.exit_code, CliError.exit_code) == (EXIT_USAGE, EXIT_CORE, EXIT_INTERNAL)
    assert (EXIT_USAGE, EXIT_CORE, EXIT_INTERNAL) == (2, 1, 70)


def test_an_unexpected_exception_is_not_mapped_by_the_group():
    result = CliRunner().invoke(_app_raising(KeyError("bug")), ["fail"])
    assert isinstance(result.exception, KeyError)  # main() reports it as an internal error (exit 70)


def test_python_dash_m_ignition_runs_the_command():  # python -m ignition.cli: tests/test_cli_inputs.py
    done = subprocess.run([sys.executable, "-m", "ignition", "--version"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.startswith("ignition "), done.stderr
