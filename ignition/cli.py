"""The ``ignition`` command line: export-core, validate-core, inspect-core."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ignition: export LLM checkpoints to validated cores with in-graph logprobs.")
console = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error (markup off: paths and values print as given) and return the exit."""
    console.print(f"error: {message}", markup=False, highlight=False)
    return typer.Exit(code)


def _check_limits(**values) -> None:
    """Each ``option_name=value`` against its range in catalog/limits.py; exit 2 naming the first bad one."""
    from ignition.catalog.limits import check_limit

    for name, value in values.items():
        problem = None if value is None else check_limit(name, value, "--" + name.replace("_", "-"))
        if problem:
            raise _fail(problem)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None


def _trusted_key(path: Optional[Path]):
    """The --trusted-key PEM, loaded before any work; a bad key file is a usage error (exit 2)."""
    if path is None:
        return None
    from ignition.catalog.signatures import SigningError, load_trusted_key
    try:
        return load_trusted_key(path)
    except SigningError as exc:
        console.print(f"[red]error:[/red] --trusted-key {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)


TRUSTED_KEY_HELP = "Ed25519 public key (PEM): the core must carry a signature by it; a signed core may load compiled packages"
TRUST_COMPILED_HELP = "Load AOTInductor packages (native code) even from an unsigned core"


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
    logprob_k: int = typer.Option(20, "--logprob-k", help="Natural alternatives K (below 20 needs --no-logprob-ids)"),
    logprob_ids: bool = typer.Option(True, "--logprob-ids/--no-logprob-ids",
                                     help="Export the explicit-ID inputs (off: a natural-only core, packed width 2+2K)"),
    prompt_logprobs: bool = typer.Option(False, "--prompt-logprobs", help="Also export scored-prefill graphs"),
    max_seq_len: int = typer.Option(512, help="KV capacity per slot (tokens)"),
    compile: Optional[str] = typer.Option(None, "--compile", help="Additionally compile variants: inductor"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing core at --out"),
    seed: int = typer.Option(0, help="Seed for recipes that generate weights (toy)"),
    tokenizer: Optional[Path] = typer.Option(None, help="Tokenizer directory to ship in the core (default: the checkpoint's own)"),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="Ed25519 private key (PEM): write signature.json over the core digest"),
    speculative_tokens: str = typer.Option("", "--speculative-tokens",
                                           help="Draft tokens S of verify.s{S}.c{capacity} variants, comma-separated"),
    mixed: bool = typer.Option(False, "--mixed", help="Also export mixed prompt/decode variants mixed.t{C}.c{capacity}"),
) -> None:
    """Run a recipe, prepare kernels, capture every graph variant, validate, and publish a core."""
    from ignition.exporter.export import ExportError, export_core
    from ignition.catalog.hashing import core_digest
    from ignition.exporter.signing import SigningError, load_signing_key
    from ignition.exporter.publish import PublishError
    from ignition.recipes.base import ExportOptions, RecipeError

    try:
        signing_key = load_signing_key(sign_key) if sign_key is not None else None
    except SigningError as exc:
        console.print(f"[red]error:[/red] --sign-key {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)

    try:
        options = ExportOptions(
            recipe=recipe, checkpoint=checkpoint, capacities=_int_list(capacities, "--capacities"),
            chunk_limit=chunk_limit, completion_token_capacity=completion_token_capacity,
            targets=tuple(t.strip() for t in targets.split(",") if t.strip()), dtype=dtype,
            logprob_k=logprob_k, logprob_ids=logprob_ids, prompt_logprobs=prompt_logprobs, max_seq_len=max_seq_len, compile=compile, seed=seed,
            tokenizer=tokenizer, speculative_tokens=_int_list(speculative_tokens, "--speculative-tokens"), mixed=mixed)
    except (RecipeError, ValueError) as exc:
        raise _fail(str(exc))
    columns = (TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[item]}", markup=False),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=not console.is_terminal) as bar:
            task = bar.add_task("export", total=None, item="")
            timings = export_core(options, out, overwrite=overwrite, signing_key=signing_key,
                                  progress=lambda stage, item: bar.update(task, description=stage, item=item))
    except PublishError as exc:  # --out cannot be written or replaced: nothing was touched
        raise _fail(str(exc))
    except (ExportError, RecipeError, FileExistsError, ValueError) as exc:
        console.print("[red]export failed:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    total = sum(timings.values())
    console.print(f"[green]exported[/green] {escape(str(out))} in {total:.1f} s")
    console.print(f"  digest sha256:{core_digest(json.loads((out / 'manifest.json').read_bytes()))}"
                  + (" (signed)" if signing_key is not None else ""), highlight=False, soft_wrap=True)
    for stage, seconds in timings.items():
        console.print(f"  {stage:<28} {seconds:8.2f} s")


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
        console.print(f"[red]error:[/red] --expect-digest: expected 64 hex digits (optionally 'sha256:' first), "
                      f"found {escape(repr(expect_digest))}", highlight=False)
        raise typer.Exit(2)
    report = validate_core(core, expect_digest=expect_digest, trusted_key=_trusted_key(trusted_key))
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
    raise typer.Exit(0 if report.ok else 1)


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

    _check_limits(memory_budget=memory_budget)
    report = validate_core(core, check_graphs=False)
    if report.manifest is None or report.catalog is None:
        console.print(f"[red]cannot inspect[/red] {escape(str(core))}:")
        for violation in report.violations:
            console.print(f"  {violation}", markup=False, highlight=False)
        raise typer.Exit(1)
    summary = inspect_core(report, memory_budget)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        render_inspection(summary, Console(), memory=memory)
    if report.violations:
        console.print(f"[yellow]warning:[/yellow] the core has {len(report.violations)} violation(s); run validate-core")


DEVICE_OPTION = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda or cuda:N")
EAGER_OPTION = typer.Option(False, "--eager", help="CUDA: replay variants eagerly instead of as CUDA graphs")
BATCH_INVARIANT_OPTION = typer.Option(False, "--batch-invariant",
                                      help="Decode in the largest variant: results independent of co-batching")
TRUST_COMPILED_OPTION = typer.Option(False, "--trust-compiled", help=TRUST_COMPILED_HELP)
TRUSTED_KEY_OPTION = typer.Option(None, "--trusted-key", help=TRUSTED_KEY_HELP)


def _load(core: Path, device: str, eager: bool, trust_compiled: bool, trusted_key: Optional[Path]):
    """load_core for run and serve: a core that cannot load exits 1 with the reason."""
    from ignition.runtime.core import CoreLoadError, load_core

    try:
        return load_core(core, device=device, eager=eager, trust_compiled=trust_compiled,
                         trusted_key=_trusted_key(trusted_key))
    except CoreLoadError as exc:
        console.print("[red]cannot load core:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)


SPECULATIVE_OPTION = typer.Option(None, "--speculative",
                                  help="Speculative decoding: ngram:S (prompt lookup) or draft:CORE:S (a draft core)")


def _speculative(text: Optional[str], loaded, device: str, eager: bool, trust_compiled: bool,
                 trusted_key: Optional[Path]) -> dict:
    """Engine options for --speculative; a bad option or draft core exits 2 (a draft core that cannot load: 1)."""
    from ignition.runtime.drafters import SpeculativeError, engine_options, parse_speculative

    try:
        speculation = parse_speculative(text) if text is not None else None
        return engine_options(speculation, loaded, lambda path: _load(path, device, eager, trust_compiled, trusted_key))
    except SpeculativeError as exc:
        raise _fail(str(exc))


@app.command("run")
def run_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    prompt: Optional[str] = typer.Argument(None, help="Prompt text (needs the core's tokenizer)"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids"),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    temperature: float = typer.Option(0.0), top_k: int = typer.Option(0), top_p: float = typer.Option(1.0),
    min_p: float = typer.Option(0.0), seed: Optional[int] = typer.Option(None),
    repetition_penalty: float = typer.Option(1.0), presence_penalty: float = typer.Option(0.0),
    frequency_penalty: float = typer.Option(0.0),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Natural alternatives per token (0..K)"),
    logprob_token_ids: Optional[str] = typer.Option(None, "--logprob-token-ids", help="Comma-separated ids to report"),
    prompt_logprobs: Optional[int] = typer.Option(None, "--prompt-logprobs", help="Alternatives per prompt token"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (see docs/api.md)"),
    device: str = DEVICE_OPTION,
    eager: bool = EAGER_OPTION,
    batch_invariant: bool = BATCH_INVARIANT_OPTION,
    trust_compiled: bool = TRUST_COMPILED_OPTION,
    trusted_key: Optional[Path] = TRUSTED_KEY_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
) -> None:
    """Generate with a core through the minimal loader and show tokens with their logprobs."""
    from ignition.runtime.present import render_run, run_json
    from ignition.runtime.requests import AdmissionError, Request, SamplingParams, check_sampling

    if (prompt is None) == (prompt_ids is None):
        raise _fail("give either a prompt text or --prompt-ids")
    if prompt is not None and not _is_utf8(prompt):
        raise _fail(f"the prompt is not valid UTF-8: {prompt!r}")
    sampling = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                              frequency_penalty, seed)
    _check_limits(max_tokens=max_tokens)
    try:
        check_sampling(sampling)
    except AdmissionError as exc:
        raise _fail(f"--{exc.param.replace('_', '-')}: {exc}") from None
    ids = list(_int_list(prompt_ids, "--prompt-ids")) if prompt_ids is not None else None
    selected = list(_int_list(logprob_token_ids, "--logprob-token-ids")) if logprob_token_ids else None
    loaded = _load(core, device, eager, trust_compiled, trusted_key)
    options = _speculative(speculative, loaded, device, eager, trust_compiled, trusted_key)
    if prompt is not None:
        if loaded.tokenizer is None:
            console.print("[red]error:[/red] this core has no tokenizer; pass --prompt-ids")
            raise typer.Exit(2)
        ids = loaded.tokenizer.encode(prompt).ids
    request = Request(prompt_ids=ids, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      logprob_token_ids=selected, ignore_eos=ignore_eos, sampling=sampling)
    from ignition.runtime.engine import Engine
    engine = Engine(loaded, batch_invariant=batch_invariant, **options)
    try:
        (result,) = engine.generate([request])
    except AdmissionError as exc:
        console.print("[red]rejected:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(run_json(result, loaded.tokenizer)))
    else:
        render_run(result, loaded.tokenizer, Console())
    raise typer.Exit(0 if result.error is None else 1)


@app.command("serve")
def serve_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Model id reported by /v1/models"),
    device: str = DEVICE_OPTION,
    eager: bool = EAGER_OPTION,
    batch_invariant: bool = BATCH_INVARIANT_OPTION,
    trust_compiled: bool = TRUST_COMPILED_OPTION,
    trusted_key: Optional[Path] = TRUSTED_KEY_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
) -> None:
    """Serve a core over a vLLM-compatible HTTP API (Completions, Chat, logprobs)."""
    from ignition.serve.app import serve

    _check_limits(port=port)
    loaded = _load(core, device, eager, trust_compiled, trusted_key)
    options = _speculative(speculative, loaded, device, eager, trust_compiled, trusted_key)
    serve(loaded, host=host, port=port, model_name=model_name or str(core), batch_invariant=batch_invariant,
          engine_options=options)


def _is_utf8(text: str) -> bool:
    """False for argv bytes that were not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def main() -> None:
    for stream in (sys.stdout, sys.stderr):  # paths from non-UTF-8 argv print escaped, not as a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        app()
    except Exception as exc:  # every input has its own clean error; reaching this is a bug
        if os.environ.get("IGNITION_TRACEBACK"):
            raise
        console.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, highlight=False)
        console.print("this is a bug in ignition; rerun with IGNITION_TRACEBACK=1 and report the traceback",
                      markup=False, highlight=False)
        sys.exit(70)  # EX_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
