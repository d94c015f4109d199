"""What Completions and Chat share: errors, request building, reading one request's output."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ignition.catalog.manifest import Features
from ignition.runtime.constraints import ConstraintError, LaneConstraints, bad_word_sequences
from ignition.runtime.core import LoadedCore
from ignition.runtime.grammar import GrammarCompiler, GrammarError, GrammarSetupError, GrammarSpec, grammar_spec
from ignition.serve.detokenize import Span, TextStream, TokenTable
from ignition.serve.protocol import (STRUCTURED_OUTPUT, UNSUPPORTED, CompletionRequest, ErrorInfo, ErrorResponse,
                                     GenerationFields, UsageInfo, warn_once)
from ignition.runtime.requests import Request, SamplingParams, check_admission, check_server_request
from ignition.serve.config import MAX_BATCH_PROMPTS, ServeConfig
from ignition.serve.engine import AsyncEngine, RequestStream
from ignition.serve.logprobs import Presenter
from ignition.serve.metrics import RequestRecord, ServerMetrics

PREPROCESS_THREADS = 2
"""Threads that tokenize, render templates and detokenize echoed prompts, off the event loop."""


class ApiError(Exception):
    """An error answered with vLLM's envelope: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                                             code=self.status.value))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status.value)


class GenerationError(Exception):
    """The loader failed a request after it was admitted; ``param``: the request field it is due to (a grammar
    that this tokenizer cannot follow, constraints that leave no token), else None (a loader failure)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@contextlib.contextmanager
def tokenizer_errors(param: str, what: str = "tokenize"):
    """The tokenizers library's failures on a request's text as a 400 naming ``param``: its bare ``Exception``,
    and the Rust panics pyo3 raises as ``PanicException``, a BaseException (a core's normalizer or
    pre-tokenizer regex that backtracks past Oniguruma's retry limit panics on some texts)."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 (only the two kinds above are answered; the rest re-raised)
        if type(exc).__name__ != "PanicException" and type(exc) is not Exception:
            raise
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ApiError(f"{param}: the tokenizer cannot {what} this text ({cause})", param) from None


def generation_api_error(exc: GenerationError) -> ApiError:
    """A 400 naming the field when the request's own constraints failed it, else a 500."""
    if getattr(exc, "param", None) is not None:
        return ApiError(str(exc), exc.param)
    return ApiError(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")


@dataclass(slots=True)
class ServerContext:
    """Everything a handler needs: the core, its engine, the tokenizer files, the server's options and metrics."""

    core: LoadedCore
    engine: AsyncEngine
    table: TokenTable
    model_name: str
    config: ServeConfig
    metrics: ServerMetrics
    tokenizer: object | None = None
    tokenizer_dir: Path | None = None
    tokenizer_config: dict = field(default_factory=dict)
    chat_template: str | None = None
    chat_template_source: str = ""
    max_batch_prompts: int = MAX_BATCH_PROMPTS
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=PREPROCESS_THREADS, thread_name_prefix="ignition-preprocess"))
    grammars: GrammarCompiler | str | None = None  # made on first use: the compiler, or why there is none
    grammars_lock: threading.Lock = field(default_factory=threading.Lock)
    longest_token: int | None = None  # characters of the tokenizer's longest vocabulary entry, read on first use

    @property
    def max_context(self) -> int | None:
        return self.engine.engine.max_context

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"The model `{name}` does not exist.", "model", HTTPStatus.NOT_FOUND, "NotFoundError")

    async def run(self, fn, *args):
        """``fn(*args)`` on a preprocessing thread: tokenizing, templating and detokenizing never block the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def grammar_compiler(self, param: str) -> GrammarCompiler:
        """The core's grammar compiler (made once, from the tokenizer's tokenizer.json text, the core's padded
        vocabulary and EOS), or a 400 naming ``param`` when the tokenizer cannot drive the grammar engine."""
        with self.grammars_lock:
            if self.grammars is None:
                self.grammars = self._make_grammar_compiler()
        if isinstance(self.grammars, str):
            raise ApiError(f"`{param}` cannot be served: {self.grammars}", param)
        return self.grammars

    def _make_grammar_compiler(self) -> GrammarCompiler | str:
        if self.tokenizer is None:
            return f"this core has no tokenizer ({self.core.path}/tokenizer/tokenizer.json) to compile grammars for"
        eos = self.core.manifest.get("eos_token_id")
        if eos is None:  # the graph then stops on no token; the grammar still needs one to end on
            name = self.tokenizer_config.get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
            eos = self.tokenizer.token_to_id(name) if isinstance(name, str) else None
        try:
            return GrammarCompiler(self.tokenizer.to_str(), int(self.core.manifest["vocab_padded"]), eos)
        except GrammarSetupError as exc:
            return str(exc)

    def check_text(self, text: str, param: str) -> bytes:
        """The UTF-8 of a prompt text, or a 400: lone surrogates, or more bytes than --max-prompt-bytes."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(f"{param} contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                           f"{exc.start}: text must be valid Unicode", param) from None
        if len(data) > self.config.max_prompt_bytes:
            raise ApiError(f"{param} has {len(data)} bytes of text; this server accepts at most "
                           f"{self.config.max_prompt_bytes} (--max-prompt-bytes)", param)
        return data

    def truncation(self, keep: int | None) -> int | None:
        """How many prompt tokens ``truncate_prompt_tokens`` keeps (the last ones, as in vLLM): -1 is the
        context length; None keeps all."""
        if keep is None or (keep == -1 and self.max_context is None):
            return None
        if keep == -1:
            return self.max_context
        if keep < 1:
            raise ApiError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {keep}",
                           "truncate_prompt_tokens")
        if self.max_context is not None and keep > self.max_context:
            raise ApiError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                           f"({self.max_context}); select a smaller truncation size", "truncate_prompt_tokens")
        return keep

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``ids`` (see ``truncation``)."""
        kept = self.truncation(keep)
        return ids if kept is None else ids[-kept:]

    def max_prompt_chars(self, tokens: int) -> int | None:
        """The most characters ``tokens`` tokens can cover: ``tokens`` times the longest vocabulary entry (None
        without a tokenizer). vLLM's bound (``TokenizeParams._text_len_check`` in vllm/renderers/params.py, with
        ``max_chars_per_token`` the longest token of vllm/tokenizers/hf.py): a longer text cannot fit, so it is
        refused before it is tokenized and tokenizing costs time and memory in proportion to the context."""
        if self.tokenizer is None:
            return None
        if self.longest_token is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self.longest_token = max(1, max((len(token) for token in vocab), default=1))
        return tokens * self.longest_token

    def encode(self, text: str, add_special_tokens: bool, param: str, truncate: int | None = None) -> list[int]:
        """Token ids of a prompt text, the last ``truncate`` (``truncate_prompt_tokens``) when given (call it
        through ``run``: a long text takes a while). A text longer than the context can hold is refused before
        it is tokenized (``max_prompt_chars``); with truncation only its last characters are tokenized."""
        if self.tokenizer is None:
            raise ApiError(f"this core has no tokenizer ({self.core.path}/tokenizer/tokenizer.json): send the "
                           "prompt as token ids", param)
        self.check_text(text, param)
        kept = self.truncation(truncate)
        if kept is not None:
            # the last ``kept`` tokens lie within the last kept * longest characters: one token more of text
            # (tokenized and dropped) keeps the cut away from the tokens kept
            text = text[-self.max_prompt_chars(kept + 1):]
        elif self.max_context is not None and len(text) > (bound := self.max_prompt_chars(self.max_context)):
            raise ApiError(f"{param} has {len(text)} characters, more than the context of {self.max_context} tokens "
                           f"can hold: this tokenizer's longest token has {self.longest_token} characters, so at "
                           f"most {bound} characters fit; shorten the prompt", param)
        # NOTE: encode_batch, not encode: only the batch call releases the GIL while Rust tokenizes, and a
        # multi-megabyte prompt holding it would stall the event loop as surely as tokenizing on it
        with tokenizer_errors(param):
            encoding = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if kept is not None:
            return encoding.ids[-kept:]
        if self.max_context is not None and len(encoding) > self.max_context:  # before a list of millions of ids
            raise ApiError(f"{param} has {len(encoding)} tokens, more than the context of {self.max_context} tokens",
                           param)
        return encoding.ids


def check_unsupported(body: GenerationFields) -> None:
    values = {**(body.model_extra or {}), **{name: getattr(body, name) for name in type(body).model_fields}}
    for name, served in UNSUPPORTED.items():
        value = values.get(name)
        if value is not None and value != served and value != []:
            raise ApiError(f"`{name}` = {_shown(value)} is not supported by this server (supported: {served!r})",
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
    raise ApiError(f"`text.format` = {_shown(text_format)} is not supported (supported: type text, json_object or "
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
    eos = ctx.core.manifest.get("eos_token_id")
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


def _shown(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
    slots = ctx.engine.engine.num_slots
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
                raise ApiError(f"`{name}` = {_shown(getattr(body, name))} is not supported by this endpoint "
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
                      constraints=constraints)
    check_admission(request, ctx.core.features, ctx.core.vocab_size, ctx.max_context)
    check_server_request(request, ctx.core.vocab_size)
    return request


class ResponseView:
    """What every response of one request needs: ids, token presentation, usage."""

    def __init__(self, ctx: ServerContext, body: GenerationFields, request_id: str, prompt_ids: list[int]):
        self.ctx, self.body, self.request_id, self.prompt_ids = ctx, body, request_id, prompt_ids
        self.created = int(time.time())
        self.generated = 0  # tokens streamed so far (continuous_usage_stats)
        as_ids = body.return_tokens_as_token_ids
        self.presenter = Presenter(ctx.table, not ctx.table.has_tokenizer if as_ids is None else as_ids)

    def usage(self, generated: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=len(self.prompt_ids), completion_tokens=generated,
                         total_tokens=len(self.prompt_ids) + generated)


@dataclass(slots=True)
class Piece:
    """Released output: text and its token spans, new prompt scores, and the finish when it is the last piece."""

    text: str
    spans: list[Span]
    prompt_scores: list[dict | None]
    finish_reason: str | None
    stop_reason: int | str | None
    generated: int  # tokens so far, the ending EOS or stop_token_ids token included (as vLLM counts)
    stop_token: int | None = None  # that ending token: listed in token_ids, without text or logprob entry

    def token_ids(self, spans: list[Span] | None = None) -> list[int]:
        """The ids of ``spans`` (default: this piece's), then the ending token when this piece has one."""
        ids = [s.token_id for s in (self.spans if spans is None else spans)]
        return ids if self.stop_token is None else ids + [self.stop_token]


class RequestOutput:
    """Reads one admitted request's deltas, decodes its text, and cancels it when abandoned."""

    def __init__(self, engine: AsyncEngine, stream: RequestStream, text: TextStream, record: RequestRecord):
        self.engine, self.stream, self.text, self.record = engine, stream, text, record
        self.generated = 0
        self.cumulative_logprob = 0.0  # of every generated token with a logprob entry: what best_of ranks by
        self.finished = False

    async def next(self) -> Piece | None:
        if self.finished:
            return None
        delta = await self.stream.get()
        if delta.finish_reason == "error" or delta.error is not None:
            self.finished = True
            self.record.finish("error")
            raise GenerationError(delta.error or "the loader failed this request", delta.error_param)
        for entry in delta.entries:
            self.text.add(entry.id, entry)
            if entry.logprob is not None:
                self.cumulative_logprob += entry.logprob
        self.generated += len(delta.entries)
        self.record.tokens(len(delta.entries))
        final = delta.finish_reason is not None
        release = self.text.release(final=final)
        finish, stop_reason, stop_token = delta.finish_reason, release.stop, None
        if release.stop is not None:
            if not final:
                self.engine.cancel(self.stream.request_id)  # the stop string ends it: free the slot now
            finish, final = "stop", True
        elif delta.stop_token is not None:
            stop_token = delta.stop_token
            stop_reason = None if delta.stop_by_eos else stop_token
            self.generated += 1
            self.record.tokens(1)
        self.finished = final
        if final:
            self.record.finish(finish)
        return Piece(release.text, release.spans, delta.prompt_entries, finish if final else None, stop_reason,
                     self.generated, stop_token)

    def close(self) -> None:
        """Cancel the request unless it already finished (a client disconnect, an error while streaming)."""
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.stream.request_id)
            self.record.finish("abort")


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(http: HttpRequest, work) -> tuple[bool, object]:
    """``(True, result)`` of the coroutine ``work``, or ``(False, None)`` when the client disconnects first (then
    ``work`` is cancelled: a submission still waiting on the engine cancels its request, AsyncEngine.submit)."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return True, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False, None
    finally:
        watcher.cancel()
        task.cancel()


async def until_disconnect(http: HttpRequest, work, outputs: list[RequestOutput]) -> Response:
    """Run a non-streaming handler; a client disconnect cancels it and its engine requests."""
    try:
        finished, response = await _unless_disconnected(http, work)
        return response if finished else Response(status_code=499)  # nobody reads a 499: the client is gone
    finally:
        for output in outputs:
            output.close()  # a no-op once the request finished


async def admit_all(ctx: ServerContext, http: HttpRequest, body: GenerationFields,
                    requests: list[Request]) -> list[list[RequestOutput]] | None:
    """Admit checked requests in order, each request's samples in index order; None when the client disconnects
    first: admission stops there and whatever was admitted is cancelled."""
    outputs: list[list[RequestOutput]] = []

    async def work() -> None:
        for request in requests:
            outputs.append(await admit_samples(ctx, body, request))

    finished = False
    try:
        finished, _ = await _unless_disconnected(http, work())
    finally:  # a disconnect, an AdmissionError or EngineStopped: nothing of this request runs on
        if not finished:
            for output in (o for samples in outputs for o in samples):
                output.close()
    return outputs if finished else None


async def merged(sources: list):
    """Items of several async generators as they come; backpressure holds (the queue has one place per source)."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(sources))
    end = object()

    async def pump(source):
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((end, None))
        except Exception as exc:  # a GenerationError: the stream reports it and ends
            await queue.put((None, exc))

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    remaining = len(tasks)
    try:
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def best(outputs: list[RequestOutput], results: list, n: int) -> list:
    """The results of the ``n`` samples with the highest cumulative logprob, best first (vLLM V0's best_of:
    ``RequestOutput.from_seq_group`` sorts by ``get_cumulative_logprob()``, vllm/outputs.py); all of them, in
    index order, when ``n`` is every sample. Ties keep index order."""
    if n == len(outputs):
        return list(results)
    order = sorted(range(len(outputs)), key=lambda i: -outputs[i].cumulative_logprob)
    return [results[i] for i in order[:n]]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_event(exc: Exception) -> str:
    """A failure after the stream started: vLLM's error object as an event (the status is already 200)."""
    error = generation_api_error(exc) if isinstance(exc, GenerationError) else \
        ApiError(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")
    return sse(error.body().model_dump_json())


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events of admitted requests; however the response ends, unfinished requests are cancelled."""

    def __init__(self, content, outputs: list[RequestOutput]):
        super().__init__(content, media_type="text/event-stream")
        self.outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for output in self.outputs:
                output.close()


async def collect(output: RequestOutput) -> tuple[list[str], list[Span], list[dict | None], Piece]:
    """Every piece of a non-streaming request: texts, spans, prompt scores, and the last piece."""
    texts, spans, scores, last = [], [], [], None
    try:
        while (piece := await output.next()) is not None:
            texts.append(piece.text)
            spans += piece.spans
            scores += piece.prompt_scores
            last = piece
    except GenerationError as exc:
        raise generation_api_error(exc) from exc
    return texts, spans, scores, last


def _text_stream(ctx: ServerContext, body: GenerationFields) -> TextStream:
    return TextStream(ctx.table, skip_special=body.skip_special_tokens, stops=body.stop_strings(),
                      include_stop=body.include_stop_str_in_output)


async def admit(ctx: ServerContext, body: GenerationFields, request: Request) -> RequestOutput:
    """Submit a checked request to the engine (its grammar compiled first); its output decodes text the way the
    body asks."""
    await attach_grammar(ctx, body, request)
    stream = await ctx.engine.submit(request)
    return RequestOutput(ctx.engine, stream, _text_stream(ctx, body),
                         ctx.metrics.start(request.request_id, len(request.prompt_ids)))


async def admit_samples(ctx: ServerContext, body: GenerationFields, request: Request) -> list[RequestOutput]:
    """Submit a checked request for ``request.n`` samples (its prompt is prefilled once); one output per sample,
    in index order, each an engine request of its own (metrics and logs count samples, as vLLM counts its
    child requests)."""
    if request.n == 1:
        return [await admit(ctx, body, request)]
    await attach_grammar(ctx, body, request)  # each sample forks it (runtime/samples.py)
    streams = await ctx.engine.submit_samples(request)
    return [RequestOutput(ctx.engine, stream, _text_stream(ctx, body),
                          ctx.metrics.start(stream.request_id, len(request.prompt_ids))) for stream in streams]


async def respond_samples(ctx: ServerContext, http: HttpRequest, body: GenerationFields, request: Request,
                          view: ResponseView) -> Response:
    """Submit an admitted request for its samples and answer with the view, which takes every sample's output."""
    outputs = await admit_samples(ctx, body, request)
    if body.stream:
        return EngineStreamingResponse(view.stream(outputs), outputs)
    return await until_disconnect(http, view.full(outputs), outputs)


async def respond(ctx: ServerContext, http: HttpRequest, body: GenerationFields, request: Request,
                  view: ResponseView) -> Response:
    """Submit an admitted request and answer with the view: an SSE stream or one full response."""
    output = await admit(ctx, body, request)
    if body.stream:
        return EngineStreamingResponse(view.stream(output), [output])
    return await until_disconnect(http, view.full(output), [output])
