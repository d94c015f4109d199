"""``ignition export-core``: a recipe's graphs captured, validated and published as a core."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ignition.catalog.parallel import SHARDABLE_RECIPES
from ignition.cli.checks import check_export_names, int_list
from ignition.cli.console import StageLog, console
from ignition.cli.errors import CoreError, UsageError
from ignition.cli.group import app
from ignition.exporter.workers import PARALLEL_CAPTURE_BYTES
from ignition.recipes.base import ExportOptions

EXPORT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportOptions)}
"""``export-core``'s defaults: ExportOptions' own."""


@app.command("export-core")
def export_core_cmd(
    checkpoint: Optional[Path] = typer.Argument(None, help="Hugging Face checkpoint directory (toy: optional .safetensors)"),
    recipe: str = typer.Option(..., "--recipe", help="Recipe name: toy, qwen3, llama, qwen3_moe, deepseek_v3, gemma3"),
    out: Path = typer.Option(..., "--out", help="Core directory to create"),
    capacities: str = typer.Option(",".join(map(str, EXPORT_DEFAULTS["capacities"])), help="Decode capacities, comma-separated"),
    chunk_limit: int = typer.Option(EXPORT_DEFAULTS["chunk_limit"], help="Prefill chunk limit (largest chunk capacity)"),
    completion_token_capacity: int = typer.Option(0, help="T: token positions per record (0 means 8)"),
    targets: str = typer.Option("", help="Kernel targets to prepare, e.g. cuda:90,cuda:120"),
    dtype: Optional[str] = typer.Option(None, help="Weight dtype: bfloat16, float16, float32"),
    k: int = typer.Option(EXPORT_DEFAULTS["k"], "--logprob-k", help="Natural alternatives K (below 20 needs --no-logprob-ids)"),
    logprob_ids: bool = typer.Option(EXPORT_DEFAULTS["logprob_ids"], "--logprob-ids/--no-logprob-ids",
                                     help="Export the explicit-ID inputs (off: a natural-only core, packed width 2+2K)"),
    prompt_logprobs: bool = typer.Option(False, "--prompt-logprobs", help="Also export scored-prefill graphs"),
    max_seq_len: int = typer.Option(EXPORT_DEFAULTS["max_seq_len"], help="Longest sequence (tokens)"),
    block_size: int = typer.Option(EXPORT_DEFAULTS["block_size"], "--block-size",
                                   help="Positions per block of the paged KV caches (a divisor of the key window granule)"),
    compile: Optional[str] = typer.Option(None, "--compile", help="Additionally compile variants: inductor"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing core at --out"),
    seed: int = typer.Option(EXPORT_DEFAULTS["seed"], help="Seed for recipes that generate weights (toy)"),
    tokenizer: Optional[Path] = typer.Option(None, help="Tokenizer directory to ship in the core (default: the checkpoint's own)"),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="Ed25519 private key (PEM): write signature.json over the core digest"),
    onnx: bool = typer.Option(False, "--onnx", help="Also write graphs/<variant>.onnx (opset 18) for --runtime onnxruntime"),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", min=1,
                                        help="Rank shards in the core (" + ", ".join(SHARDABLE_RECIPES) + ")"),
    speculative_tokens: str = typer.Option("", "--speculative-tokens",
                                           help="Draft tokens S of verify.s{S}.c{capacity} variants, comma-separated"),
    mixed: bool = typer.Option(False, "--mixed", help="Also export mixed prompt/decode variants mixed.t{C}.c{capacity}"),
    jobs: int = typer.Option(0, "--jobs", help="Processes capturing variants at once (0: one per core when the "
                                                  f"weights reach {PARALLEL_CAPTURE_BYTES >> 20} MiB, else 1)"),
    packed_prefill: bool = typer.Option(True, "--packed-prefill/--no-packed-prefill",
                                        help="Export packed.t{C}.c{capacity}: several prompts' chunks per submission "
                                             "(qwen3, llama; not with --compile, --onnx, --tensor-parallel)"),
) -> None:
    """Run a recipe, prepare kernels, capture every graph variant, validate, and publish a core."""
    from ignition.exporter.publish import PublishError, check_output

    try:  # before anything else: a result that could not be published is not worth computing
        check_output(out, overwrite, {"checkpoint": checkpoint, "tokenizer directory": tokenizer})
    except PublishError as exc:
        raise UsageError(str(exc)) from None
    check_export_names(recipe, targets, tokenizer)
    from ignition.exporter.export import ExportError, export_core
    from ignition.catalog.hashing import core_digest
    from ignition.exporter.signing import SigningError, load_signing_key
    from ignition.recipes.base import RecipeError

    try:
        signing_key = load_signing_key(sign_key) if sign_key is not None else None
    except SigningError as exc:
        raise UsageError(f"--sign-key {exc}") from None

    try:
        options = ExportOptions(
            recipe=recipe, checkpoint=checkpoint, capacities=int_list(capacities, "--capacities"),
            chunk_limit=chunk_limit, completion_token_capacity=completion_token_capacity,
            targets=tuple(t.strip() for t in targets.split(",") if t.strip()), dtype=dtype,
            k=k, logprob_ids=logprob_ids, prompt_logprobs=prompt_logprobs, max_seq_len=max_seq_len, compile=compile, seed=seed,
            tokenizer=tokenizer, onnx=onnx, tensor_parallel=tensor_parallel,
            speculative_tokens=int_list(speculative_tokens, "--speculative-tokens"), mixed=mixed,
            packed_prefill=packed_prefill, capture_jobs=jobs, block_size=block_size)
    except (RecipeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        from ignition.recipes.checkpoint import CheckpointError, read_config
        try:  # sizes and non-finite numbers refused by name before any recipe allocates by them
            read_config(checkpoint)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
    started = time.perf_counter()
    try:
        with StageLog("export") as progress:
            timings = export_core(options, out, overwrite=overwrite, signing_key=signing_key, progress=progress)
    except PublishError as exc:  # --out cannot be written or replaced: nothing was touched
        raise UsageError(str(exc)) from None
    except (ExportError, RecipeError, FileExistsError, ValueError) as exc:
        raise CoreError(str(exc), label="export failed") from None
    total = time.perf_counter() - started  # wall clock: capture workers' seconds overlap
    console.print(f"[green]exported[/green] {escape(str(out))} in {total:.1f} s", soft_wrap=True)
    console.print(f"  digest sha256:{core_digest(json.loads((out / 'manifest.json').read_bytes()))}"
                  + (" (signed)" if signing_key is not None else ""), highlight=False, soft_wrap=True)
    for stage, seconds in timings.items():
        console.print(f"  {stage:<28} {seconds:8.2f} s")

