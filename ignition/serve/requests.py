"""From an API body to the runtime's ``Request``: the fields this server refuses, the output constraint
(``response_format``, ``structured_outputs``), the sampling controls, ``n``/``best_of``, and admission."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

from ignition.catalog.manifest import Features
from ignition.runtime.constraints import ConstraintError, LaneConstraints, bad_word_sequences
from ignition.runtime.grammar import GrammarError, GrammarSpec, grammar_spec
from ignition.runtime.requests import Request, SamplingParams, check_admission, check_server_request
from ignition.serve.context import ServerContext
from ignition.serve.errors import ApiError, shown, tokenizer_errors
from ignition.serve.protocol import STRUCTURED_OUTPUT, UNSUPPORTED, CompletionRequest, GenerationFields, warn_once


def check_unsupported(body: GenerationFields) -> None:
    values = {**(body.model_extra or {}), **{name: getattr(body, name) for name in type(body).model_fields}}
    for name, served in UNSUPPORTED.items():
        value = values.get(name)
        if value is not None and value != served and value != []:
            raise ApiError(f"`{name}` = {shown(value)} is not supported by this server (supported: {served!r})",
                           name)
    for name in sorted(STRUCTURED_OUTPUT & values.keys()):
        if values[name] is not None:
            raise ApiError(f"`{name}`: structural tags are not supported by this server; constrain the output with "
                           "`response_format` or `structured_outputs` (json, regex, choice, grammar)", name)


# -- structured output and sampling controls (runtime/grammar_spec.py, grammar.py, constraints.py) --------------
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
"""vLLM's deprecated top-level fields -> their ``structured_outputs`` keys. vLLM 0.10.2-0.11 accepted them with a
deprecation warning and v0.12 removed them (docs.vllm.ai, "Structured Outputs"); here they keep working, warned
about once per field name, so an older client is never silently unconstrained."""
CONTROLS = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens")


def responses_format(text: dict | None) -> dict | None:
    """A Responses ``text.format`` as Chat's ``response_format`` (OpenAI flattens ``name``/``schema``/``strict``
    into the format object); 400 naming ``text.format`` for any other shape."""
    text_format = (text or {}).get("format") if isinstance(text, dict) else None
    if text_format is None:
        return None
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {key: text_format[key] for key in ("name", "schema", "strict")
                                                       if key in text_format}}
    raise ApiError(f"`text.format` = {shown(text_format)} is not supported (supported: type text, json_object or "
                   "json_schema)", "text.format")


def structured_spec(body: GenerationFields, disable_any_whitespace: bool = False) -> GrammarSpec | None:
    """The request's output constraint (``response_format``, ``structured_outputs``, the deprecated ``guided_*``
    aliases, or Responses' ``text.format``), or None; a malformed one is a 400 naming its field.
    ``disable_any_whitespace``: the server's default (``--structured-outputs-config``)."""
    responses = isinstance(getattr(body, "text", None), dict)  # /v1/responses: text.format is its response_format
    response_format = responses_format(body.text) if responses else body.response_format
    structured = body.structured_outputs
    aliases = {name: getattr(body, name) for name in GUIDED_ALIASES if getattr(body, name) is not None}
    if aliases:
        if structured is not None:
            raise ApiError(f"`{next(iter(aliases))}` is a deprecated alias of `structured_outputs`; send one of them",
                           next(iter(aliases)))
        for name in aliases:
            warn_once(name, f"the request field {name!r} is deprecated (removed in vLLM 0.12): it was read as "
                            f"structured_outputs.{GUIDED_ALIASES[name]}")
        structured = {GUIDED_ALIASES[name]: value for name, value in aliases.items()}
    try:
        spec = grammar_spec(response_format, structured, disable_any_whitespace)
    except GrammarError as exc:
        raise ApiError(str(exc), _renamed_param(exc.param, responses, aliases)) from None
    if spec is not None and (responses or aliases):
        spec = dataclasses.replace(spec, param=_renamed_param(spec.param, responses, aliases))
    return spec


def _renamed_param(param: str | None, responses: bool, aliases: dict) -> str | None:
    """The field the client sent: ``text.format`` on /v1/responses, the ``guided_*`` alias it used."""
    if responses and param is not None and param.startswith("response_format"):
        return "text.format" + param[len("response_format"):]
    for name, key in GUIDED_ALIASES.items():
        if name in aliases and param in (f"structured_outputs.{key}", "structured_outputs"):
            return name
    return param


def sampling_constraints(ctx: ServerContext, body: GenerationFields, spec: GrammarSpec | None,
                         max_tokens: int) -> LaneConstraints | None:
    """The request's ``LaneConstraints`` without its grammar (``attach_grammar`` adds it once compiled), or None
    when it sets no constraint. 400s name the field: a core exported without the structured-output inputs, ids
    outside the vocabulary, more than 300 biases, ``min_tokens`` above ``max_tokens``, ..."""
    present = [spec.param] if spec is not None else []
    present += [name for name in CONTROLS if getattr(body, name) not in (None, 0, [], {})
                or (name == "allowed_token_ids" and body.allowed_token_ids == [])]  # vLLM: "... is not None and empty"
    if not present:
        return None
    if not Features.from_json(ctx.core.features).structured_output:
        raise ApiError(f"`{present[0]}` needs the structured-output inputs (features.structured_output: the token "
                       f"bitmask and logit bias), and this core was exported without them; export it again with "
                       f"`ignition export-core` to serve {', '.join(f'`{name}`' for name in present)}", present[0])
    if spec is not None:
        ctx.grammar_compiler(spec.param)  # a 400 now if the tokenizer cannot drive the grammar engine
    if body.bad_words and ctx.tokenizer is None:
        raise ApiError("bad_words are tokenized with the core's tokenizer, and this core has none", "bad_words")
    for word in body.bad_words or ():
        ctx.check_text(word, "bad_words")
    stop_ids = ending_ids(ctx, body.ignore_eos, body.stop_token_ids)
    try:
        bad_words = bad_word_sequences(body.bad_words, functools.partial(_encode_plain, ctx.tokenizer)) \
            if body.bad_words else ()
        return LaneConstraints.build(ctx.core.vocab_size, allowed_token_ids=body.allowed_token_ids,
                                     bad_words=bad_words, min_tokens=body.min_tokens, max_tokens=max_tokens,
                                     stop_ids=stop_ids, logit_bias=body.logit_bias)
    except ConstraintError as exc:
        raise ApiError(str(exc), exc.param) from None


def ending_ids(ctx: ServerContext, ignore_eos: bool, stop_token_ids) -> list[int]:
    """The ids that end a request (EOS unless ignored, then its stop ids): what ``min_tokens`` masks and a grammar
    may end on."""
    eos = ctx.core.spec.eos_token_id
    return ([] if ignore_eos or eos is None else [eos]) + list(stop_token_ids or ())


def _encode_plain(tokenizer, text: str) -> list[int]:
    with tokenizer_errors("bad_words"):
        return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


async def attach_grammar(ctx: ServerContext, body: GenerationFields, request: Request) -> None:
    """Compile the request's constraint off the event loop (the compiler's worker threads; cached by spec) and
    give the request its own matcher; a spec the engine cannot compile is a 400 naming the field and, for JSON
    Schema, the keywords."""
    # canonical JSON of a large schema: not on the event loop
    spec = await ctx.run(structured_spec, body, ctx.config.disable_any_whitespace)
    if spec is None or request.constraints is None:
        return
    compiler = ctx.grammar_compiler(spec.param)
    try:
        compiled = await asyncio.wrap_future(compiler.submit(spec))
    except GrammarError as exc:
        raise ApiError(str(exc), spec.param) from None
    request.constraints.grammar = compiler.matcher(compiled)


def check_whole_vocabulary(ctx: ServerContext, value: int | None, param: str) -> None:
    """vLLM reads -1 as "the logprobs of every token"; a core reports at most K natural alternatives."""
    if value == -1:
        k = Features.from_json(ctx.core.features).effective_k
        raise ApiError(f"{param}=-1 asks for the logprobs of the whole vocabulary ({ctx.core.vocab_size} tokens, as "
                       f"in vLLM); this core reports at most {k} alternatives per position: ask for 0 to {k}, or "
                       "name the tokens you need with `logprob_token_ids`", param)


def sample_counts(ctx: ServerContext, body: GenerationFields) -> tuple[int, int]:
    """``(n, best_of)``: the choices to return and the samples to draw per prompt (``best_of`` defaults to ``n``).

    vLLM V0's rules (``SamplingParams._verify_args``, vllm/sampling_params.py): n >= 1 and best_of >= n; the best
    ``n`` of ``best_of`` are those with the highest cumulative logprob, so best_of > n is not streamed (vLLM
    0.6.4+: "best_of must equal n to use output_kind=DELTA") and needs sampling (vLLM V0 refuses best_of > 1 with
    greedy sampling: the samples would all be the same). A prompt's samples decode together, one slot each,
    so best_of is at most the core's slot count. vLLM V1 (>= 0.7) refuses best_of > 1 and current vLLM has no
    such field; this server keeps V0's behaviour (docs/serving.md).
    """
    n = 1 if body.n is None else body.n
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}", "n")
    best_of = n if body.best_of is None else body.best_of
    if best_of < n:
        raise ApiError(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}", "best_of")
    slots = ctx.engine.num_slots
    if best_of > slots:
        param = "best_of" if best_of > n else "n"
        raise ApiError(f"{param} = {best_of} is more than this core's {slots} slots: the samples of a prompt decode "
                       f"together, one slot each, so {param} can be at most {slots}", param)
    if best_of > n:
        if body.stream:
            raise ApiError(f"best_of ({best_of}) must equal n ({n}) when streaming: the best {n} of {best_of} samples "
                           "are known only when all have finished", "best_of")
        if not ctx.core.features["allow_logprobs"]:
            raise ApiError("best_of > n ranks the samples by cumulative logprob, and this core was exported without "
                           "logprob outputs", "best_of")
        if not body.temperature:
            raise ApiError(f"best_of ({best_of}) must equal n ({n}) with greedy sampling (temperature 0, this server's "
                           "default): every sample would be the same", "best_of")
    return n, best_of


def build_request(ctx: ServerContext, body: GenerationFields, prompt_ids: list[int], request_id: str, *,
                  max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, samples: bool = False) -> Request:
    """The engine request for an API body, or ApiError/AdmissionError (both 400) before admission. ``samples``:
    the endpoint serves ``n`` and ``best_of`` (Completions, Chat); the request then draws ``best_of`` samples."""
    check_unsupported(body)
    drawn = 1
    if samples:
        n, drawn = sample_counts(ctx, body)
        if drawn > n and logprobs is None and not body.logprob_token_ids:
            logprobs = 0  # the ranking reads each sampled token's logprob; the response shows them only if asked
    else:
        for name in ("n", "best_of"):
            if getattr(body, name) not in (None, 1):
                raise ApiError(f"`{name}` = {shown(getattr(body, name))} is not supported by this endpoint "
                               "(supported: 1)", name)
    if max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):  # vLLM's echo_without_generation
        raise ApiError("max_tokens must be at least 1, got 0", "max_tokens")
    if body.stream_options is not None and not body.stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if body.stop_strings() and ctx.tokenizer is None:
        raise ApiError("stop strings need a tokenizer and this core has none; use stop_token_ids", "stop")
    spec = structured_spec(body, ctx.config.disable_any_whitespace)
    constraints = sampling_constraints(ctx, body, spec, max_tokens)
    top_k = body.top_k if body.top_k is not None else 0
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_k=0 if top_k == -1 else top_k,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        repetition_penalty=defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed)
    request = Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling,
                      logprobs=None if body.logprob_token_ids else logprobs,
                      logprob_token_ids=body.logprob_token_ids, stop_token_ids=list(body.stop_token_ids or ()),
                      ignore_eos=body.ignore_eos, prompt_logprobs=prompt_logprobs, request_id=request_id, n=drawn,
                      constraints=constraints, cache_salt=body.cache_salt)
    check_admission(request, ctx.core.features, ctx.core.vocab_size, ctx.max_context)
    check_server_request(request, ctx.core.vocab_size)
    return request
