"""The ``ignition`` command line: export-core, validate-core, inspect-core, run, serve.

Everything a command can check cheaply is checked before its heavy work (an export, a load):
option ranges, that a core path is a core, that ``--out`` may be written, that the port is
free, that ``run``'s logprob options fit the core (read from its manifest alone). Long work
reports its stages on stderr as they start: a rich status line in a terminal, plain timestamped
lines otherwise (CI logs, files). The console, the stage log and those early checks live in
ignition/cli_support.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ignition.catalog.parallel import SHARDABLE_RECIPES
from ignition.cli_support import (RUNTIME_HELP, TRUST_COMPILED_HELP, TRUSTED_KEY_HELP, StageLog, _bind,
                                  _check_export_names, _check_limits, _fail, _identify_core, _int_list,
                                  _not_a_core_message, _read_manifest, _runtime, _trusted_key, console)
from ignition.exporter.workers import PARALLEL_CAPTURE_BYTES
from ignition.recipes.base import ExportOptions
from ignition.runtime.rendezvous import LOOPBACK
from ignition.runtime.requests import DEFAULT_MAX_TOKENS, SamplingParams

EXPORT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportOptions)}
"""``export-core``'s defaults: ExportOptions' own."""

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
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
    logprob_k: int = typer.Option(EXPORT_DEFAULTS["logprob_k"], "--logprob-k", help="Natural alternatives K (below 20 needs --no-logprob-ids)"),
    logprob_ids: bool = typer.Option(EXPORT_DEFAULTS["logprob_ids"], "--logprob-ids/--no-logprob-ids",
                                     help="Export the explicit-ID inputs (off: a natural-only core, packed width 2+2K)"),
    prompt_logprobs: bool = typer.Option(False, "--prompt-logprobs", help="Also export scored-prefill graphs"),
    max_seq_len: int = typer.Option(EXPORT_DEFAULTS["max_seq_len"], help="KV capacity per slot (tokens)"),
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
        raise _fail(str(exc))
    _check_export_names(recipe, targets, tokenizer)
    from ignition.exporter.export import ExportError, export_core
    from ignition.catalog.hashing import core_digest
    from ignition.exporter.signing import SigningError, load_signing_key
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
            tokenizer=tokenizer, onnx=onnx, tensor_parallel=tensor_parallel,
            speculative_tokens=_int_list(speculative_tokens, "--speculative-tokens"), mixed=mixed,
            packed_prefill=packed_prefill, capture_jobs=jobs)
    except (RecipeError, ValueError) as exc:
        raise _fail(str(exc))
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        from ignition.recipes.checkpoint import CheckpointError, read_config
        try:  # sizes and non-finite numbers refused by name before any recipe allocates by them
            read_config(checkpoint)
        except CheckpointError as exc:
            raise _fail(str(exc))
    started = time.perf_counter()
    try:
        with StageLog("export") as progress:
            timings = export_core(options, out, overwrite=overwrite, signing_key=signing_key, progress=progress)
    except PublishError as exc:  # --out cannot be written or replaced: nothing was touched
        raise _fail(str(exc))
    except (ExportError, RecipeError, FileExistsError, ValueError) as exc:
        console.print("[red]export failed:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    total = time.perf_counter() - started  # wall clock: capture workers' seconds overlap
    console.print(f"[green]exported[/green] {escape(str(out))} in {total:.1f} s", soft_wrap=True)
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
PACK_LINEARS_OPTION = typer.Option(True, "--pack-linears/--no-pack-linears",
                                   help="CPU: run FP32 projections, and BF16 ones where the packed product keeps "
                                        "aten.linear's bits, on weights packed once for oneDNN (--no-pack-linears: "
                                        "torch's own aten.linear)")
DROP_FILE_CACHE_OPTION = typer.Option(True, "--drop-file-cache/--keep-file-cache",
                                      help="Drop the weights file's pages from the page cache as the loader reads "
                                           "them: its own copy is the one used (--keep-file-cache: a later load "
                                           "reads the file from the cache instead of the disk)")
BATCH_INVARIANT_OPTION = typer.Option(False, "--batch-invariant",
                                      help="Decode in the largest variant: results independent of co-batching")
TRUST_COMPILED_OPTION = typer.Option(False, "--trust-compiled", help=TRUST_COMPILED_HELP)
TRUSTED_KEY_OPTION = typer.Option(None, "--trusted-key", help=TRUSTED_KEY_HELP)
RUNTIME_OPTION = typer.Option("torch", "--runtime", callback=_runtime, help=RUNTIME_HELP)


TENSOR_PARALLEL_OPTION = typer.Option(1, "--tensor-parallel", min=1, help="Ranks of a sharded core to start (gloo on "
                                      "CPU, NCCL on CUDA); this process is rank 0")
TP_HOST_OPTION = typer.Option(LOOPBACK, "--tp-host", help="Address the tensor-parallel store and ranks listen on "
                              "(loopback unless set; another one is warned about)")


def _load_options(device: str, eager: bool, trust_compiled: bool, trusted_key: Optional[Path],
                  runtime: str = "torch", tensor_parallel: int = 1, tp_host: str = LOOPBACK, pack_linears: bool = True,
                  drop_file_cache: bool = True):
    """The one LoadOptions of run and serve, validated before anything loads; a choice that cannot work here
    (--device, --runtime, --tensor-parallel, --trusted-key) exits 2 naming it."""
    from ignition.runtime.options import LoadOptions
    from ignition.runtime.verified import LoadOptionError

    try:
        return LoadOptions.create(device, runtime, tensor_parallel, eager=eager, trust_compiled=trust_compiled,
                                  trusted_key=_trusted_key(trusted_key), tp_host=tp_host, pack_linears=pack_linears,
                                  drop_file_cache=drop_file_cache)
    except LoadOptionError as exc:
        raise _fail(str(exc))


def _load(core: Path, options):
    """load_core for run and serve, its stages on stderr and a last line with the seconds of each; a
    core that cannot load exits 1 with the reason (a path that is no core at all: 2). With
    ``options.ranks`` > 1 the other ranks start too and stop when this process exits
    (ignition/runtime/parallel.py)."""
    from ignition.runtime.core import CoreLoadError, LoadOptionError, NotACoreError, load_core
    from ignition.runtime.parallel import ParallelError, ParallelOptionError, start_for_process
    from ignition.runtime.rendezvous import torchrun_follower

    if options.ranks > 1 and torchrun_follower():  # a torchrun rank >= 1 replays rank 0's submissions, then exits
        from ignition.runtime.rank_worker import torchrun_worker
        raise typer.Exit(torchrun_worker(core, options))
    try:
        with StageLog("load") as progress:
            if options.ranks > 1:
                loaded = start_for_process(core, options)
            else:
                loaded = load_core(core, options, progress=progress)
    except NotACoreError as exc:
        raise _fail(_not_a_core_message(exc, core))
    except LoadOptionError as exc:  # --device or --runtime that cannot work here: a usage error
        raise _fail(str(exc))
    except ParallelOptionError as exc:  # --runtime or --tensor-parallel that cannot work: a usage error
        raise _fail(str(exc))
    except ParallelError as exc:
        console.print("[red]error:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    except CoreLoadError as exc:
        console.print("[red]cannot load core:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    stages = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in loaded.timings.items())
    console.print(f"loaded {core} on {loaded.device} in {loaded.load_seconds:.2f} s ({stages})",
                  markup=False, highlight=False, soft_wrap=True)
    return loaded


def _check_run_options(core: Path, request, text_prompt: bool) -> None:
    """``run``'s request against the core's manifest, before loading: logprob options beyond the core's K
    or features, and (with --prompt-ids) the whole admission check; exit 2 naming the option."""
    from ignition.runtime.requests import AdmissionError, check_admission, check_options

    manifest = _read_manifest(core)
    if manifest is None:
        return  # loading reports what is wrong with the core
    if text_prompt and manifest.get("tokenizer") is None:
        raise _fail("this core has no tokenizer; pass --prompt-ids")
    try:
        if text_prompt:
            check_options(request, manifest["features"], manifest["vocab_size"])
        else:
            check_admission(request, manifest["features"], manifest["vocab_size"],
                            manifest["model"].get("max_seq_len"))
    except AdmissionError as exc:
        option = "--" + {"prompt": "prompt_ids"}.get(exc.param, exc.param).replace("_", "-")
        raise _fail(f"{option}: {exc}") from None


SPECULATIVE_OPTION = typer.Option(None, "--speculative",
                                  help="Speculative decoding: ngram:S (prompt lookup) or draft:CORE:S (a draft core)")


def _check_speculative(text: Optional[str]) -> None:
    """--speculative's syntax, before anything loads (exit 2)."""
    from ignition.runtime.drafters import SpeculativeError, parse_speculative

    if text is not None:
        try:
            parse_speculative(text)
        except SpeculativeError as exc:
            raise _fail(str(exc))


def _speculative(text: Optional[str], loaded) -> dict:
    """Engine options for --speculative; a bad option or draft core exits 2 (a draft core that cannot load: 1).
    ``--trust-compiled`` names the target core only: a draft core's compiled packages load only when its own
    signature verifies against ``--trusted-key``."""
    from ignition.runtime.drafters import SpeculativeError, engine_options, parse_speculative

    try:
        speculation = parse_speculative(text) if text is not None else None
        return engine_options(speculation, loaded, lambda path: _load(path, loaded.options.for_draft()))
    except SpeculativeError as exc:
        raise _fail(str(exc))


SAMPLING = SamplingParams()
"""``run``'s sampling defaults: the runtime's (which reads the catalog's)."""


@app.command("run")
def run_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    prompt: Optional[str] = typer.Argument(None, help="Prompt text (needs the core's tokenizer)"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids"),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens"),
    temperature: float = typer.Option(SAMPLING.temperature), top_k: int = typer.Option(SAMPLING.top_k),
    top_p: float = typer.Option(SAMPLING.top_p), min_p: float = typer.Option(SAMPLING.min_p),
    seed: Optional[int] = typer.Option(SAMPLING.seed),
    repetition_penalty: float = typer.Option(SAMPLING.repetition_penalty),
    presence_penalty: float = typer.Option(SAMPLING.presence_penalty),
    frequency_penalty: float = typer.Option(SAMPLING.frequency_penalty),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Natural alternatives per token (0..K)"),
    logprob_token_ids: Optional[str] = typer.Option(None, "--logprob-token-ids", help="Comma-separated ids to report"),
    prompt_logprobs: Optional[int] = typer.Option(None, "--prompt-logprobs", help="Alternatives per prompt token"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (see docs/api.md)"),
    device: str = DEVICE_OPTION,
    eager: bool = EAGER_OPTION,
    pack_linears: bool = PACK_LINEARS_OPTION,
    drop_file_cache: bool = DROP_FILE_CACHE_OPTION,
    batch_invariant: bool = BATCH_INVARIANT_OPTION,
    trust_compiled: bool = TRUST_COMPILED_OPTION,
    trusted_key: Optional[Path] = TRUSTED_KEY_OPTION,
    runtime: str = RUNTIME_OPTION,
    tensor_parallel: int = TENSOR_PARALLEL_OPTION,
    tp_host: str = TP_HOST_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
) -> None:
    """Generate with a core through the minimal loader and show tokens with their logprobs."""
    from ignition.runtime.present import render_run, run_json
    from ignition.runtime.requests import AdmissionError, Request, SamplingParams, check_sampling

    _identify_core(core)
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
    request = Request(prompt_ids=ids or [], max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      logprob_token_ids=selected, ignore_eos=ignore_eos, sampling=sampling)
    _check_run_options(core, request, text_prompt=prompt is not None)
    _check_speculative(speculative)
    loaded = _load(core, _load_options(device, eager, trust_compiled, trusted_key, runtime, tensor_parallel, tp_host,
                                       pack_linears, drop_file_cache))
    options = _speculative(speculative, loaded)
    if prompt is not None:
        if loaded.tokenizer is None:
            raise _fail("this core has no tokenizer; pass --prompt-ids")
        request.prompt_ids = loaded.tokenizer.encode(prompt).ids
    from ignition.runtime.scheduler import Engine
    from ignition.runtime.parallel import ParallelError
    engine = Engine(loaded, batch_invariant=batch_invariant, **options)
    try:
        (result,) = engine.generate([request])
    except AdmissionError as exc:
        console.print("[red]rejected:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    except ParallelError as exc:  # a tensor-parallel rank died or timed out
        console.print("[red]error:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(run_json(result, loaded.tokenizer)))
    else:
        render_run(result, loaded.tokenizer, Console())
    raise typer.Exit(0 if result.error is None else 1)


from ignition.serve.config import MAX_BATCH_PROMPTS, MAX_BODY_BYTES, MAX_PROMPT_BYTES  # noqa: E402 (for --help)


@app.command("serve")
def serve_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                             help="Model id reported by /v1/models and required in `model` "
                                                  "(default: the core path)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer KEY` on /v1/* "
                                          "and /invocations, as vLLM (default: $IGNITION_API_KEY, then "
                                          "$VLLM_API_KEY)"),
    allowed_origins: Optional[str] = typer.Option(None, "--allowed-origins",
                                                  help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: none)"),
    max_batch_prompts: int = typer.Option(MAX_BATCH_PROMPTS, "--max-batch-prompts",
                                          help="Most prompts in one Completions request (400 above)"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                help="Prompt plus max_tokens per request (default: the core's context)"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="Chat template file or Jinja text, instead of the tokenizer's"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer",
                                             help="Tokenizer directory (tokenizer.json, tokenizer_config.json, "
                                                  "chat_template.jinja) instead of CORE/tokenizer"),
    allow_request_chat_template: bool = typer.Option(False, "--allow-request-chat-template",
                                                     help="Accept `chat_template` in requests (rendered with "
                                                          "time, step, nesting and size bounds)"),
    max_body_bytes: int = typer.Option(MAX_BODY_BYTES, "--max-body-bytes", help="Largest request body (413 above)"),
    max_prompt_bytes: int = typer.Option(MAX_PROMPT_BYTES, "--max-prompt-bytes",
                                         help="Largest text prompt or chat messages, in UTF-8 bytes (400 above)"),
    enable_docs: bool = typer.Option(False, "--enable-docs", help="Serve /docs, /redoc and /openapi.json"),
    disable_log_requests: bool = typer.Option(False, "--disable-log-requests",
                                              help="No log line per finished request"),
    reasoning_parser: str = typer.Option("plain", "--reasoning-parser",
                                         help="How /v1/responses splits output: plain (all content) or think "
                                              "(<think>reasoning</think>content)"),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser",
                                                   help="How tool calls are read from the output: hermes "
                                                        "(<tool_call>{...}</tool_call>, Qwen) or llama3_json"),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help="Let the model choose to call tools (tool_choice auto, the "
                                                      "default with tools); needs --tool-call-parser"),
    device: str = DEVICE_OPTION,
    eager: bool = EAGER_OPTION,
    pack_linears: bool = PACK_LINEARS_OPTION,
    drop_file_cache: bool = DROP_FILE_CACHE_OPTION,
    batch_invariant: bool = BATCH_INVARIANT_OPTION,
    trust_compiled: bool = TRUST_COMPILED_OPTION,
    trusted_key: Optional[Path] = TRUSTED_KEY_OPTION,
    runtime: str = RUNTIME_OPTION,
    tensor_parallel: int = TENSOR_PARALLEL_OPTION,
    tp_host: str = TP_HOST_OPTION,
    speculative: Optional[str] = SPECULATIVE_OPTION,
) -> None:
    """Serve a core over a vLLM-compatible HTTP API (Completions, Chat, Responses, tokenizer, metrics)."""
    from ignition.runtime.parallel import ParallelError
    from ignition.runtime.rendezvous import torchrun_follower
    from ignition.serve.app import ServeSetupError, serve
    from ignition.serve.config import ChatTemplateError, ServeConfig, api_keys_from, read_chat_template
    from ignition.serve.guards import parse_allowed_origins
    from ignition.serve.parsers import PARSERS
    from ignition.serve.tool_parsers import TOOL_PARSERS

    _check_limits(port=port, max_model_len=max_model_len, max_body_bytes=max_body_bytes,
                  max_prompt_bytes=max_prompt_bytes)
    if api_key is not None and not api_key.strip():
        raise _fail("--api-key is empty: give the key clients must send, or leave the option out to serve without one")
    if max_batch_prompts < 1:
        raise _fail(f"--max-batch-prompts must be at least 1, got {max_batch_prompts}")
    try:
        origins = parse_allowed_origins(allowed_origins) if allowed_origins is not None else ()
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if reasoning_parser not in PARSERS:
        raise _fail(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {reasoning_parser!r}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise _fail(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise _fail("--enable-auto-tool-choice requires --tool-call-parser (which format the model writes calls in)")
    if tokenizer is not None and not tokenizer.is_dir():
        raise _fail(f"--tokenizer {tokenizer}: not a directory")
    try:
        template = read_chat_template(chat_template) if chat_template is not None else None
    except ChatTemplateError as exc:
        raise _fail(str(exc)) from None
    config = ServeConfig(api_keys=api_keys_from(api_key), max_model_len=max_model_len, max_body_bytes=max_body_bytes,
                         max_prompt_bytes=max_prompt_bytes, chat_template=template, tokenizer=tokenizer,
                         allow_request_chat_template=allow_request_chat_template, enable_docs=enable_docs,
                         log_requests=not disable_log_requests, reasoning_parser=reasoning_parser,
                         tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice)
    _check_speculative(speculative)
    _identify_core(core)
    load_options = _load_options(device, eager, trust_compiled, trusted_key, runtime, tensor_parallel, tp_host,
                                 pack_linears, drop_file_cache)
    if _read_manifest(core) is None:  # a core whose manifest does not parse: its findings, not the port, first
        _load(core, load_options)  # exits 1 with them
        raise _fail(f"{core}/manifest.json changed while the server started")
    if tensor_parallel > 1 and torchrun_follower():  # torchrun rank >= 1: follows rank 0, exits in _load
        _load(core, load_options)
    sock = _bind(host, port)
    loaded = _load(core, load_options)
    name = model_name or str(core)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def ready() -> None:
        console.print(f"ready: serving {core} as {name} on {url} (loaded in {loaded.load_seconds:.1f} s)",
                      markup=False, highlight=False, soft_wrap=True)

    options = _speculative(speculative, loaded)
    try:
        serve(loaded, host=host, port=port, model_name=name, batch_invariant=batch_invariant, config=config,
              sock=sock, on_ready=ready, engine_options=options, allowed_origins=origins,
              max_batch_prompts=max_batch_prompts)
    except ServeSetupError as exc:
        raise _fail(str(exc)) from None
    except ParallelError as exc:  # a tensor-parallel rank died while serving: the server stopped
        console.print("[red]error:[/red]", escape(str(exc)), highlight=False)
        raise typer.Exit(1)


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
