"""``ignition run``: one request through the minimal loader, its tokens shown with their logprobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ignition.cli import loading
from ignition.cli.checks import check_limits, identify_core, int_list, is_utf8
from ignition.cli.errors import EXIT_CORE, EXIT_OK, CoreError, UsageError
from ignition.cli.group import app
from ignition.runtime.requests import DEFAULT_MAX_TOKENS, SamplingParams

SAMPLING = SamplingParams()
"""``run``'s sampling defaults: the runtime's (which reads the catalog's)."""


@app.command("run")
@loading.with_shared_options
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
    *,
    shared: loading.SharedOptions,
) -> None:
    """Generate with a core through the minimal loader and show tokens with their logprobs."""
    from ignition.runtime.present import render_run, run_json
    from ignition.runtime.requests import AdmissionError, Request, SamplingParams, check_sampling

    identify_core(core)
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("give either a prompt text or --prompt-ids")
    if prompt is not None and not is_utf8(prompt):
        raise UsageError(f"the prompt is not valid UTF-8: {prompt!r}")
    sampling = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                              frequency_penalty, seed)
    check_limits(max_tokens=max_tokens)
    try:
        check_sampling(sampling)
    except AdmissionError as exc:
        raise UsageError(f"--{exc.param.replace('_', '-')}: {exc}") from None
    ids = list(int_list(prompt_ids, "--prompt-ids")) if prompt_ids is not None else None
    selected = list(int_list(logprob_token_ids, "--logprob-token-ids")) if logprob_token_ids else None
    request = Request(prompt_ids=ids or [], max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      logprob_token_ids=selected, ignore_eos=ignore_eos, sampling=sampling)
    loading.check_run_options(core, request, text_prompt=prompt is not None)
    loading.check_speculative(shared.speculative)
    options = shared.load_options(core)
    loaded = loading.load(core, options)
    engine_options = shared.engine_options(loaded)
    if prompt is not None:
        if loaded.tokenizer is None:
            raise UsageError("this core has no tokenizer; pass --prompt-ids")
        request.prompt_ids = loaded.tokenizer.encode(prompt).ids
    from ignition.runtime.engine import Engine
    from ignition.runtime.parallel.group import ParallelError
    from ignition.runtime.verified import CoreRunError
    engine = Engine(loaded, batch_invariant=shared.batch_invariant, **engine_options)
    try:
        (result,) = engine.generate([request])
    except AdmissionError as exc:
        raise CoreError(str(exc), label="rejected") from None
    except ParallelError as exc:  # a tensor-parallel rank died or timed out
        raise CoreError(str(exc)) from None
    except CoreRunError as exc:  # the core's graph failed (an index out of range, an allocation): a core error
        raise CoreError(str(exc), label="core error") from None
    if as_json:
        print(json.dumps(run_json(result, loaded.tokenizer)))
    else:
        render_run(result, loaded.tokenizer, Console())
    raise typer.Exit(EXIT_OK if result.error is None else EXIT_CORE)

