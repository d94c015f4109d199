"""POST /v1/completions, as vLLM's completion serving presents it (echo, logprobs, prompt_logprobs, SSE)."""

from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from ignition.serve.detokenize import Release, decode_all
from ignition.serve.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                              CompletionResponseChoice, CompletionResponseStreamChoice,
                                              CompletionStreamResponse, random_id)
from ignition.serve.common import (ApiError, GenerationError, RequestOutput, ResponseView, ServerContext,
                                             build_request, collect, error_event, respond, sse)
from ignition.serve.logprobs import add_completion_logprobs, prompt_entry, prompt_logprobs

DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) Completions default


def _empty_logprobs() -> CompletionLogProbs:
    """Every field explicitly set: stream chunks are written with exclude_unset."""
    return CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])


def prompt_ids_of(ctx: ServerContext, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if prompt is None:
        raise ApiError("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(f"batched prompts ({len(prompt)}) are not supported: send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.encode(prompt, body.add_special_tokens, "prompt")
    return list(prompt)


async def create_completion(ctx: ServerContext, body: CompletionRequest, http: HttpRequest) -> Response:
    ctx.check_model(body.model)
    prompt_ids = prompt_ids_of(ctx, body)
    if body.logprob_token_ids is not None and body.logprobs is None:
        raise ApiError("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    echo_scores = bool(body.echo) and body.logprobs is not None
    if echo_scores and not ctx.core.features["prompt_logprobs"]:
        raise ApiError("echo with logprobs reports the prompt's logprobs, and this core was exported without "
                       "prompt scoring (--prompt-logprobs)", "echo")
    prompt_scores = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if echo_scores else None)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    request = build_request(ctx, body, prompt_ids, random_id("cmpl"), max_tokens=max_tokens, logprobs=body.logprobs,
                            prompt_logprobs=prompt_scores)
    return await respond(ctx, http, body, request, _CompletionView(ctx, body, request.request_id, prompt_ids))


class _CompletionView(ResponseView):
    """Turns released pieces into Completions responses for one request."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest, request_id: str, prompt_ids: list[int]):
        super().__init__(ctx, body, request_id, prompt_ids)
        self.echo: Release | None = None
        if body.echo:  # the detokenized prompt; its offsets start the response's text
            self.echo = decode_all(ctx.table, prompt_ids, skip_special=body.skip_special_tokens,
                                   strip_leading=ctx.table.strip_leading)
        self.offset_base = len(self.echo.text) if self.echo else 0

    def _echo_logprobs(self, out: CompletionLogProbs, scores: list[dict | None]) -> None:
        for span, score in zip(self.echo.spans, scores):
            span.payload = prompt_entry(score)
        add_completion_logprobs(out, self.echo.spans, self.presenter, 0)

    async def full(self, output: RequestOutput) -> Response:
        texts, spans, scores, last = await collect(output)
        body, logprobs = self.body, None
        if body.logprobs is not None:
            logprobs = _empty_logprobs()
            if self.echo is not None:
                self._echo_logprobs(logprobs, scores)
            add_completion_logprobs(logprobs, spans, self.presenter, self.offset_base)
        prefix = self.echo.text if self.echo is not None else ""
        choice = CompletionResponseChoice(
            index=0, text=prefix + "".join(texts), logprobs=logprobs, finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            prompt_logprobs=prompt_logprobs(scores, self.presenter) if scores else None,
            token_ids=[s.token_id for s in spans] if body.return_token_ids else None,
            prompt_token_ids=self.prompt_ids if body.return_token_ids else None)
        response = CompletionResponse(id=self.request_id, created=self.created, model=self.ctx.model_name,
                                      choices=[choice], usage=self.usage(last.generated))
        return Response(response.model_dump_json(), media_type="application/json")

    async def stream(self, output: RequestOutput):
        body = self.body
        options = body.stream_options
        scores: list[dict | None] = []
        echo_pending = self.echo is not None
        generated = 0
        try:
            while (piece := await output.next()) is not None:
                generated = piece.generated
                scores += piece.prompt_scores
                logprobs = _empty_logprobs() if body.logprobs is not None else None
                text = piece.text
                if echo_pending:
                    if not piece.spans and not text and piece.finish_reason is None:
                        continue  # prompt scores still arriving: the echo goes out with them, in one chunk
                    if logprobs is not None:
                        self._echo_logprobs(logprobs, scores)
                    text, echo_pending = self.echo.text + text, False
                if logprobs is not None:
                    add_completion_logprobs(logprobs, piece.spans, self.presenter, self.offset_base)
                if not text and not (logprobs and logprobs.tokens) and piece.finish_reason is None:
                    continue
                choice = CompletionResponseStreamChoice(
                    index=0, text=text, logprobs=logprobs, finish_reason=piece.finish_reason,
                    stop_reason=piece.stop_reason)
                if body.return_token_ids:
                    choice.token_ids = [s.token_id for s in piece.spans]
                chunk = CompletionStreamResponse(id=self.request_id, created=self.created, model=self.ctx.model_name,
                                                 choices=[choice])
                if options is not None and options.continuous_usage_stats:
                    chunk.usage = self.usage(generated)
                yield sse(chunk.model_dump_json(exclude_unset=True))
            if options is not None and options.include_usage:
                final = CompletionStreamResponse(id=self.request_id, created=self.created, model=self.ctx.model_name,
                                                 choices=[], usage=self.usage(generated))
                yield sse(final.model_dump_json(exclude_none=True))
        except GenerationError as exc:
            yield error_event(exc)
        yield "data: [DONE]\n\n"
