"""The ``ignition`` command line: export-core, validate-core, inspect-core."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ignition: export LLM checkpoints to validated cores with in-graph logprobs.")
console = Console(stderr=True)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None


@app.command("export-core")
def export_core_cmd(
    checkpoint: Optional[Path] = typer.Argument(None, help="Hugging Face checkpoint directory (toy: optional .safetensors)"),
    recipe: str = typer.Option(..., "--recipe", help="Recipe name: toy, qwen3, llama"),
    out: Path = typer.Option(..., "--out", help="Core directory to create"),
    capacities: str = typer.Option("1,2,4,8", help="Decode capacities, comma-separated"),
    chunk_limit: int = typer.Option(256, help="Prefill chunk limit (largest chunk capacity)"),
    completion_token_capacity: int = typer.Option(0, help="T: token positions per record (0 means 8)"),
    targets: str = typer.Option("", help="Kernel targets to prepare, e.g. cuda:90,cuda:120"),
    dtype: Optional[str] = typer.Option(None, help="Weight dtype: bfloat16, float16, float32"),
    logprobs: bool = typer.Option(True, "--logprobs/--no-logprobs", help="Export the CompletionOutputs logprob bundle"),
    prompt_logprobs: bool = typer.Option(False, "--prompt-logprobs", help="Also export scored-prefill graphs"),
    max_seq_len: int = typer.Option(512, help="KV capacity per slot (tokens)"),
    compile: Optional[str] = typer.Option(None, "--compile", help="Additionally compile variants: inductor"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing core at --out"),
    seed: int = typer.Option(0, help="Seed for recipes that generate weights (toy)"),
) -> None:
    """Run a recipe, prepare kernels, capture every graph variant, validate, and publish a core."""
    from ignition.exporter.export import ExportError, export_core
    from ignition.recipes.base import ExportOptions, RecipeError

    try:
        options = ExportOptions(
            recipe=recipe, checkpoint=checkpoint, capacities=_int_list(capacities, "--capacities"),
            chunk_limit=chunk_limit, completion_token_capacity=completion_token_capacity,
            targets=tuple(t.strip() for t in targets.split(",") if t.strip()), dtype=dtype, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, max_seq_len=max_seq_len, compile=compile, seed=seed)
    except (RecipeError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    columns = (TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[item]}"), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=not console.is_terminal) as bar:
            task = bar.add_task("export", total=None, item="")
            timings = export_core(options, out, overwrite=overwrite,
                                  progress=lambda stage, item: bar.update(task, description=stage, item=item))
    except (ExportError, RecipeError, FileExistsError, ValueError) as exc:
        console.print(f"[red]export failed:[/red] {exc}")
        raise typer.Exit(1)
    total = sum(timings.values())
    console.print(f"[green]exported[/green] {out} in {total:.1f} s")
    for stage, seconds in timings.items():
        console.print(f"  {stage:<28} {seconds:8.2f} s")


@app.command("validate-core")
def validate_core_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON"),
) -> None:
    """Check a core against the JSON Schemas and every semantic rule (exit 0 valid, 1 invalid)."""
    from ignition.validate.core import validate_core

    report = validate_core(core)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    elif report.ok:
        console.print(f"[green]valid[/green] {core}")
    else:
        console.print(f"[red]invalid[/red] {core}: {len(report.violations)} violation(s)")
        for violation in report.violations:
            console.print(f"  {violation}", markup=False, highlight=False)
    raise typer.Exit(0 if report.ok else 1)


@app.command("inspect-core")
def inspect_core_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    as_json: bool = typer.Option(False, "--json", help="Print the inspection as JSON"),
    memory: bool = typer.Option(False, "--memory", help="Show physical bytes per buffer class"),
) -> None:
    """Show a core's features, variants, buffers (with bytes) and prepared launches."""
    from ignition.catalog.inspect import inspect_core, render_inspection
    from ignition.validate.core import validate_core

    report = validate_core(core, check_graphs=False)
    if report.manifest is None or report.catalog is None:
        console.print(f"[red]cannot inspect[/red] {core}:")
        for violation in report.violations:
            console.print(f"  {violation}", markup=False, highlight=False)
        raise typer.Exit(1)
    summary = inspect_core(report)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        render_inspection(summary, Console(), memory=memory)
    if report.violations:
        console.print(f"[yellow]warning:[/yellow] the core has {len(report.violations)} violation(s); run validate-core")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
