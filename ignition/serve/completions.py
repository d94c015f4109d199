"""POST /v1/completions, as vLLM's completion serving presents it (echo, logprobs, prompt_logprobs, SSE).

A batch (a list of strings or of token-id lists) becomes one engine request per prompt, all
checked before any is admitted, so they share the engine's lanes. Each prompt's request draws
``best_of`` (default ``n``) samples from one prefill; choice ``j`` of prompt ``i`` has ``index``
``i * n + j`` in the response and in every stream chunk (vLLM's ``output.index + prompt_idx *
num_choices``), and usage counts each prompt once and the returned choices' tokens.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from ignition.runtime.requests import AdmissionError
from ignition.serve.context import ServerContext
from ignition.serve.defaults import COMPLETIONS
from ignition.serve.detokenize import Release, decode_all
from ignition.serve.errors import ApiError
from ignition.serve.logprobs import add_completion_logprobs, prompt_entry, prompt_logprobs
from ignition.serve.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                     CompletionResponseChoice, CompletionResponseStreamChoice,
                                     CompletionStreamResponse, UsageInfo, random_id)
from ignition.serve.requests import build_request, check_whole_vocabulary
from ignition.serve.streaming import (EngineStreamingResponse, RequestOutput, ResponseView, admit_all, best, collect,
                                      error_event, merged, sse, until_disconnect)


def _empty_logprobs() -> CompletionLogProbs:
    """Every field explicitly set: stream chunks are written with exclude_unset."""
    return CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])


def prompts_of(body: CompletionRequest, limit: int) -> list[str | list[int]]:
    """The request's prompts: one string or id list, or a batch of at most ``limit`` of either."""
    prompt = body.prompt
    if prompt is None:
        raise ApiError("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > limit:
            raise ApiError(f"prompt holds a batch of {len(prompt)} prompts; this server accepts at most {limit} "
                           "per request (--max-batch-prompts)", "prompt")
        return list(prompt)
    return [prompt]


def _prompt_ids(ctx: ServerContext, body: CompletionRequest, prompts: list) -> list[list[int]]:
    """Token ids of every prompt (on a preprocessing thread); errors name the prompt of a batch."""
    out = []
    for index, prompt in enumerate(prompts):
        try:
            out.append(ctx.encode(prompt, body.add_special_tokens, "prompt", body.truncate_prompt_tokens)
                       if isinstance(prompt, str) else ctx.truncate(list(prompt), body.truncate_prompt_tokens))
        except ApiError as exc:
            raise _in_batch(exc, index, len(prompts)) from None
    return out


def _in_batch(exc: ApiError | AdmissionError, index: int, count: int) -> ApiError:
    if isinstance(exc, ApiError):
        exc.message = f"prompt {index} of {count}: {exc.message}" if count > 1 else exc.message
        return exc
    return ApiError(f"prompt {index} of {count}: {exc}" if count > 1 else str(exc), exc.param)


async def create_completion(ctx: ServerContext, body: CompletionRequest, http: HttpRequest) -> Response:
    ctx.check_model(body.model)
    prompts = prompts_of(body, ctx.max_batch_prompts)
    if body.logprob_token_ids is not None and body.logprobs is None:
        raise ApiError("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    check_whole_vocabulary(ctx, body.logprobs, "logprobs")
    check_whole_vocabulary(ctx, body.prompt_logprobs, "prompt_logprobs")
    echo_scores = bool(body.echo) and body.logprobs is not None
    if echo_scores and not ctx.core.features["prompt_logprobs"]:
        raise ApiError("echo with logprobs reports the prompt's logprobs, and this core was exported without "
                       "prompt scoring (--prompt-logprobs)", "echo")
    prompt_scores = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if echo_scores else None)
    max_tokens = COMPLETIONS.resolve(body, 0, ctx.max_context)
    if any(isinstance(p, str) for p in prompts):
        all_ids = await ctx.run(_prompt_ids, ctx, body, prompts)
    else:
        all_ids = _prompt_ids(ctx, body, prompts)
    response_id = random_id("cmpl")
    # admission checks and echo detokenizing walk every prompt token: a preprocessing thread does it
    requests, views = await ctx.run(_prepare, ctx, body, response_id, all_ids, max_tokens, prompt_scores)
    outputs = await admit_all(ctx, http, body, requests)
    if outputs is None:
        return Response(status_code=499)  # the client left during admission: nobody reads this
    every = [output for samples in outputs for output in samples]
    if body.stream:
        return EngineStreamingResponse(_stream(ctx, body, response_id, views, outputs), every)
    return await until_disconnect(http, _full(ctx, body, response_id, views, outputs), every)


def _prepare(ctx: ServerContext, body: CompletionRequest, response_id: str, all_ids: list[list[int]],
             max_tokens: int, prompt_scores: int | None):
    """The engine request and the response view of every prompt; ApiError (400) before any is admitted."""
    requests, batched = [], len(all_ids) > 1
    for index, ids in enumerate(all_ids):
        try:
            requests.append(build_request(ctx, body, ids, f"{response_id}-{index}" if batched else response_id,
                                          max_tokens=max_tokens, logprobs=body.logprobs,
                                          prompt_logprobs=prompt_scores, samples=True))
        except (ApiError, AdmissionError) as exc:
            raise _in_batch(exc, index, len(all_ids)) from None
    created = int(time.time())
    views = [_CompletionView(ctx, body, response_id, ids) for ids in all_ids]
    for view in views:
        view.created = created
    return requests, views


def _usage(views: list[_CompletionView], generated: list[int]) -> UsageInfo:
    prompt = sum(len(v.prompt_ids) for v in views)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=sum(generated), total_tokens=prompt + sum(generated))


async def _full(ctx: ServerContext, body: CompletionRequest, response_id: str, views: list[_CompletionView],
                outputs: list[list[RequestOutput]]) -> Response:
    n = 1 if body.n is None else body.n
    per_prompt = await asyncio.gather(*(asyncio.gather(*(view.choice(output, 0) for output in samples))
                                        for view, samples in zip(views, outputs)))
    returned = [result for samples, results in zip(outputs, per_prompt) for result in best(samples, results, n)]
    for index, (choice, _) in enumerate(returned):
        choice.index = index  # prompt i's choices are i * n .. i * n + n - 1, best first when best_of > n
    response = CompletionResponse(id=response_id, created=views[0].created, model=ctx.model_name,
                                  choices=[choice for choice, _ in returned],
                                  usage=_usage(views, [generated for _, generated in returned]))
    return Response(response.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServerContext, body: CompletionRequest, response_id: str, views: list[_CompletionView],
                  outputs: list[list[RequestOutput]]):
    n = len(outputs[0])  # best_of equals n when streaming (requests.sample_counts)
    try:
        sources = [view.chunks(output, i * n + j) for i, (view, samples) in enumerate(zip(views, outputs))
                   for j, output in enumerate(samples)]
        async for chunk in merged(sources):
            yield sse(chunk.model_dump_json(exclude_unset=True))
        if body.stream_options is not None and body.stream_options.include_usage:
            final = CompletionStreamResponse(id=response_id, object="text_completion", created=views[0].created,
                                             model=ctx.model_name, choices=[],
                                             usage=_usage(views, [o.generated for samples in outputs for o in samples]))
            yield sse(final.model_dump_json(exclude_none=True))
    except Exception as exc:  # noqa: BLE001 (GenerationError: reported as vLLM does, then the stream ends)
        yield error_event(exc)
    yield "data: [DONE]\n\n"


class _CompletionView(ResponseView):
    """Turns released pieces into Completions choices for one prompt."""

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

    async def choice(self, output: RequestOutput, index: int) -> tuple[CompletionResponseChoice, int]:
        texts, spans, scores, last = await collect(output)
        body, logprobs = self.body, None
        if body.logprobs is not None:
            logprobs = _empty_logprobs()
            if self.echo is not None:
                self._echo_logprobs(logprobs, scores)
            add_completion_logprobs(logprobs, spans, self.presenter, self.offset_base)
        prefix = self.echo.text if self.echo is not None else ""
        choice = CompletionResponseChoice(
            index=index, text=prefix + "".join(texts), logprobs=logprobs, finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            prompt_logprobs=prompt_logprobs(scores, self.presenter) if scores else None,
            token_ids=last.token_ids(spans) if body.return_token_ids else None,
            prompt_token_ids=self.prompt_ids if body.return_token_ids else None)
        return choice, last.generated

    async def chunks(self, output: RequestOutput, index: int):
        """Stream chunks of this prompt's choice (``index``); the caller adds usage and [DONE]."""
        body = self.body
        options = body.stream_options
        scores: list[dict | None] = []
        echo_pending, first = self.echo is not None, True
        while (piece := await output.next()) is not None:
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
                index=index, text=text, logprobs=logprobs, finish_reason=piece.finish_reason,
                stop_reason=piece.stop_reason)
            if body.return_token_ids:
                choice.token_ids = piece.token_ids()
                if first:
                    choice.prompt_token_ids = self.prompt_ids
            first = False
            chunk = CompletionStreamResponse(id=self.request_id, object="text_completion", created=self.created,
                                             model=self.ctx.model_name, choices=[choice])
            if options is not None and options.continuous_usage_stats:
                chunk.usage = self.usage(piece.generated)
            yield chunk
