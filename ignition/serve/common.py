"""What Completions and Chat share: errors, request building, reading one request's output."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ignition.runtime.core import LoadedCore
from ignition.serve.detokenize import Span, TextStream, TokenTable
from ignition.serve.protocol import UNSUPPORTED, ErrorInfo, ErrorResponse, GenerationFields, UsageInfo
from ignition.runtime.requests import Request, SamplingParams, check_admission, check_server_request
from ignition.serve.engine import AsyncEngine, RequestStream
from ignition.serve.logprobs import Presenter


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
    """The loader failed a request after it was admitted."""


@dataclass(slots=True)
class ServerContext:
    core: LoadedCore
    engine: AsyncEngine
    table: TokenTable
    model_name: str
    tokenizer_config: dict = field(default_factory=dict)

    @property
    def max_context(self) -> int | None:
        return self.engine.engine.max_context

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"The model `{name}` does not exist.", "model", HTTPStatus.NOT_FOUND, "NotFoundError")

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.core.tokenizer is None:
            raise ApiError(f"this core has no tokenizer ({self.core.path}/tokenizer/tokenizer.json): send the "
                           "prompt as token ids", param)
        return self.core.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def check_unsupported(body: GenerationFields) -> None:
    values = {**(body.model_extra or {}), **{name: getattr(body, name) for name in type(body).model_fields}}
    for name, served in UNSUPPORTED.items():
        value = values.get(name)
        if value is not None and value != served and value != []:
            raise ApiError(f"`{name}` = {value!r} is not supported by this server (supported: {served!r})", name)


def build_request(ctx: ServerContext, body: GenerationFields, prompt_ids: list[int], request_id: str, *,
                  max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> Request:
    """The engine request for an API body, or ApiError/AdmissionError (both 400) before admission."""
    check_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if body.stop_strings() and ctx.core.tokenizer is None:
        raise ApiError("stop strings need a tokenizer and this core has none; use stop_token_ids", "stop")
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
                      ignore_eos=body.ignore_eos, prompt_logprobs=prompt_logprobs, request_id=request_id)
    check_admission(request, ctx.core.features, ctx.core.vocab_size, ctx.max_context)
    check_server_request(request, ctx.core.vocab_size)
    return request


class ResponseView:
    """What every response of one request needs: ids, token presentation, usage."""

    def __init__(self, ctx: ServerContext, body: GenerationFields, request_id: str, prompt_ids: list[int]):
        self.ctx, self.body, self.request_id, self.prompt_ids = ctx, body, request_id, prompt_ids
        self.created = int(time.time())
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
    stop_reason: str | None
    generated: int


class RequestOutput:
    """Reads one admitted request's deltas, decodes its text, and cancels it when abandoned."""

    def __init__(self, engine: AsyncEngine, stream: RequestStream, text: TextStream):
        self.engine, self.stream, self.text = engine, stream, text
        self.generated = 0
        self.finished = False

    async def next(self) -> Piece | None:
        if self.finished:
            return None
        delta = await self.stream.get()
        if delta.finish_reason == "error" or delta.error is not None:
            self.finished = True
            raise GenerationError(delta.error or "the loader failed this request")
        for entry in delta.entries:
            self.text.add(entry.id, entry)
        self.generated += len(delta.entries)
        final = delta.finish_reason is not None
        release = self.text.release(final=final)
        finish = delta.finish_reason
        if release.stop is not None:
            if not final:
                self.engine.cancel(self.stream.request_id)  # the stop string ends it: free the slot now
            finish, final = "stop", True
        self.finished = final
        return Piece(release.text, release.spans, delta.prompt_entries, finish if final else None, release.stop,
                     self.generated)

    def close(self) -> None:
        """Cancel the request unless it already finished (a client disconnect, an error while streaming)."""
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.stream.request_id)


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(http: HttpRequest, work, output: RequestOutput) -> Response:
    """Run a non-streaming handler; a client disconnect cancels it and its engine request."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody reads it: the client is gone
    finally:
        watcher.cancel()
        task.cancel()
        output.close()  # a no-op once the request finished


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_event(exc: Exception) -> str:
    """A failure after the stream started: vLLM's error object as an event (the status is already 200)."""
    error = ApiError(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")
    return sse(error.body().model_dump_json())


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events of one request; however the response ends, an unfinished request is cancelled."""

    def __init__(self, content, output: RequestOutput):
        super().__init__(content, media_type="text/event-stream")
        self.output = output

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.output.close()


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
        raise ApiError(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError") from exc
    return texts, spans, scores, last


async def respond(ctx: ServerContext, http: HttpRequest, body: GenerationFields, request: Request,
                  view: ResponseView) -> Response:
    """Submit an admitted request and answer with the view: an SSE stream or one full response."""
    text = TextStream(ctx.table, skip_special=body.skip_special_tokens, stops=body.stop_strings(),
                      include_stop=body.include_stop_str_in_output)
    output = RequestOutput(ctx.engine, await ctx.engine.submit(request), text)
    if body.stream:
        return EngineStreamingResponse(view.stream(output), output)
    return await until_disconnect(http, view.full(output), output)
