"""``ignition validate-core`` and ``ignition inspect-core``: a core's findings, and what it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ignition.cli.checks import TRUSTED_KEY_HELP, check_limits, trusted_key as load_trusted_key
from ignition.cli.console import console
from ignition.cli.errors import EXIT_CORE, EXIT_OK, UsageError
from ignition.cli.group import app


@app.command("validate-core")
def validate_core_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON"),
    expect_digest: Optional[str] = typer.Option(None, "--expect-digest", help="The core digest (sha256 hex) the core must have"),
    trusted_key: Optional[Path] = typer.Option(None, "--trusted-key", help=TRUSTED_KEY_HELP),
) -> None:
    """Check a core against the JSON Schemas and every semantic rule (exit 0 valid, 1 invalid)."""
    import re

    from ignition.validate.core import validate_core

    if expect_digest is not None and not re.fullmatch(r"(sha256:)?[0-9a-fA-F]{64}", expect_digest):
        raise UsageError(f"--expect-digest: expected 64 hex digits (optionally 'sha256:' first), "
                         f"found {expect_digest!r}")
    report = validate_core(core, expect_digest=expect_digest, trusted_key=load_trusted_key(trusted_key))
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    elif report.ok:
        signed = f", signed by {report.signed_by}" + (" (trusted key)" if report.trusted else "") if report.signed_by else ""
        console.print(f"[green]valid[/green] {escape(str(core))} (digest sha256:{report.digest}{signed})",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"[red]invalid[/red] {escape(str(core))}: {len(report.violations)} violation(s)")
        for violation in report.violations:
            console.print(f"  {violation}", markup=False, highlight=False)
    raise typer.Exit(EXIT_OK if report.ok else EXIT_CORE)


@app.command("inspect-core")
def inspect_core_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    as_json: bool = typer.Option(False, "--json", help="Print the inspection as JSON"),
    memory: bool = typer.Option(False, "--memory", help="Show physical bytes per buffer class"),
    memory_budget: Optional[int] = typer.Option(None, "--memory-budget",
                                                help="Device bytes for state: report the KV capacity prompt scoring displaces"),
) -> None:
    """Show a core's features, variants, buffers (with bytes) and prepared launches."""
    from ignition.catalog.inspect import inspect_core, render_inspection
    from ignition.validate.core import validate_core

    check_limits(memory_budget=memory_budget)
    report = validate_core(core, check_graphs=False)
    if report.manifest is None or report.catalog is None:
        console.print(f"[red]cannot inspect[/red] {escape(str(core))}:")
        for violation in report.violations:
            console.print(f"  {violation}", markup=False, highlight=False)
        raise typer.Exit(EXIT_CORE)
    summary = inspect_core(report, memory_budget)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        render_inspection(summary, Console(), memory=memory)
    if report.violations:
        console.print(f"[yellow]warning:[/yellow] the core has {len(report.violations)} violation(s); run validate-core")

