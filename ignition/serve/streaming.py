"""Reading an admitted request's output and answering with it: ``RequestOutput`` decodes each delta into a
``Piece``; a response is one full body or server-sent events, and a client that disconnects cancels its requests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from ignition.runtime.requests import Request
from ignition.serve.context import ServerContext
from ignition.serve.detokenize import Span, TextStream
from ignition.serve.engine import AsyncEngine, RequestStream
from ignition.serve.errors import ApiError, GenerationError, generation_api_error
from ignition.serve.logprobs import Presenter
from ignition.serve.metrics import RequestRecord
from ignition.serve.protocol import GenerationFields, UsageInfo
from ignition.serve.requests import attach_grammar


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
