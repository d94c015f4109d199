"""POST /v1/chat/completions, as vLLM's chat serving presents it; the prompt comes from the checkpoint's template."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from ignition.serve.context import ServerContext
from ignition.serve.defaults import CHAT
from ignition.serve.errors import ApiError, GenerationError
from ignition.serve.logprobs import chat_logprobs, prompt_logprobs
from ignition.serve.parsers import OutputParser
from ignition.serve.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                     ChatCompletionStreamResponse, ChatMessage, DeltaMessage, random_id)
from ignition.serve.requests import build_request, check_whole_vocabulary
from ignition.serve.streaming import (RequestOutput, ResponseView, best, collect, error_event, merged, respond_samples,
                                      sse)
from ignition.serve.templates import TemplateLimitError, render_bounded, special_token
from ignition.serve.tools import ToolCallReader, ToolUse, enforce, template_messages, tool_use


def _text_content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(p.get("text", "") for p in content)
    raise ApiError(f"messages[{index}].content: only text content is supported", f"messages[{index}].content")


def render_prompt(ctx: ServerContext, body: ChatCompletionRequest, tools: list[dict] | None = None) -> str:
    """The prompt text the chat template makes of the messages and ``tools`` (on a preprocessing thread)."""
    if body.chat_template is not None and not ctx.config.allow_request_chat_template:
        raise ApiError("this server does not accept chat templates in requests (start it with "
                       "--allow-request-chat-template); leave out `chat_template` to use the model's", "chat_template")
    template = body.chat_template if body.chat_template is not None else ctx.chat_template
    if template is None:
        raise ApiError(f"this core has no chat template (neither chat_template.jinja nor a 'chat_template' in "
                       f"{ctx.chat_template_source}): start the server with --chat-template or use /v1/completions",
                       "messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       "continue_final_message")
    messages = template_messages([dict(m, content=_text_content(m, i)) for i, m in enumerate(body.messages)])
    for i, message in enumerate(messages):
        ctx.check_text(message["content"], f"messages[{i}].content")
    variables = dict(messages=messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
                     bos_token=special_token(ctx.tokenizer_config, "bos_token") or "",
                     eos_token=special_token(ctx.tokenizer_config, "eos_token") or "")
    extra = body.chat_template_kwargs or {}
    for key in extra:
        if key in variables:
            raise ApiError(f"chat_template_kwargs.{key}: {key!r} is set by the server from the request "
                           f"(reserved: {', '.join(variables)}); pass it through its own field or leave it out",
                           f"chat_template_kwargs.{key}")
    variables |= extra
    limits = ctx.config.template_limits
    if body.chat_template is None:  # the messages may fill --max-prompt-bytes, and the prompt holds them all
        limits = dataclasses.replace(limits, max_output_bytes=max(limits.max_output_bytes,
                                                                  ctx.config.max_prompt_bytes))
    try:
        rendered = render_bounded(template, limits, variables)
    except TemplateLimitError as exc:
        if body.chat_template is not None:
            raise ApiError(f"the request's chat template was stopped: {exc}", "chat_template") from None
        raise ApiError(f"the chat template ({ctx.chat_template_source}) was stopped: {exc}", "messages") from None
    except Exception as exc:  # noqa: BLE001 (TemplateError, raise_exception, RecursionError, TypeError, ...)
        raise ApiError(f"the chat template failed: {type(exc).__name__}: {exc}", "messages") from None
    if body.continue_final_message and messages and messages[-1]["content"]:
        final = messages[-1]["content"]
        rendered = rendered[:rendered.rindex(final) + len(final)] if final in rendered else rendered
    return rendered


def chat_prompt_ids(ctx: ServerContext, body: ChatCompletionRequest, truncate: int | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """Render and tokenize (on a preprocessing thread); ``truncate``: keep that many last tokens."""
    if ctx.tokenizer is None:
        raise ApiError(f"this core has no tokenizer ({ctx.core.path}/tokenizer/tokenizer.json): Chat needs one; "
                       "use /v1/completions with token ids", "messages")
    return ctx.encode(render_prompt(ctx, body, tools), body.add_special_tokens, "messages", truncate)


def chat_tool_use(ctx: ServerContext, body: ChatCompletionRequest) -> ToolUse:
    """The request's tools and tool_choice, resolved as vLLM resolves them (serve/tools.py)."""
    choice = body.tool_choice
    return tool_use(ctx.config, None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools],
                    choice.model_dump() if hasattr(choice, "model_dump") else choice,
                    "tool_choice" in body.model_fields_set and choice is not None, body.parallel_tool_calls)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, http: HttpRequest) -> Response:
    ctx.check_model(body.model)
    if not body.messages:
        raise ApiError("messages must hold at least one message", "messages")
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if body.logprob_token_ids is not None and not body.logprobs:
        raise ApiError("when using `logprob_token_ids`, `logprobs` must be set to true.", "logprob_token_ids")
    check_whole_vocabulary(ctx, body.top_logprobs, "top_logprobs")
    check_whole_vocabulary(ctx, body.prompt_logprobs, "prompt_logprobs")
    features = ctx.core.features
    if body.logprobs and features["allow_logprobs"] and not 0 <= top <= ctx.core.k:
        raise ApiError(f"top_logprobs must be between 0 and {ctx.core.k}, got {top}", "top_logprobs")
    tools = chat_tool_use(ctx, body)
    if tools.parser_class is not None and tools.parser_class.keep_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})  # vLLM's hermes: delimiters may be special
    prompt_ids = await ctx.run(chat_prompt_ids, ctx, body, body.truncate_prompt_tokens, tools.template_tools)
    max_tokens = CHAT.resolve(body, len(prompt_ids), ctx.max_context)
    request = await ctx.run(functools.partial(build_request, max_tokens=max_tokens, prompt_logprobs=body.prompt_logprobs,
                                              logprobs=top if body.logprobs else None, samples=True),
                            ctx, body, prompt_ids, random_id("chatcmpl"))
    await enforce(ctx, tools, request, body.structured_outputs)
    view = _ChatView(ctx, body, request.request_id, prompt_ids, tools if tools.parser_class is not None else None)
    return await respond_samples(ctx, http, body, request, view)


async def _pieces(output: RequestOutput, index: int):
    """``(index, piece)`` for each piece of one sample's output."""
    while (piece := await output.next()) is not None:
        yield index, piece


class _ChatView(ResponseView):
    """Turns released pieces into Chat responses for one request: choice ``i`` is sample ``i`` (the best ``n``,
    best first, when ``best_of`` > ``n``); usage counts the prompt once and the returned choices' tokens."""

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                 tools: ToolUse | None = None):
        super().__init__(ctx, body, request_id, prompt_ids)
        self.tools = tools  # None: no tool calls are read, the output is content
        last = body.messages[-1]
        self.role = "assistant" if body.add_generation_prompt else last.get("role", "assistant")
        # echo: the last message is continued when it has the response's role (synthetic text: no token entries)
        self.echo = _text_content(last, len(body.messages) - 1) if body.echo and last.get("role") == self.role else ""

    async def full(self, outputs: list[RequestOutput]) -> Response:
        collected = await asyncio.gather(*(collect(output) for output in outputs))
        body = self.body
        choices, generated = [], 0
        for index, (texts, spans, _, last) in enumerate(best(outputs, collected, 1 if body.n is None else body.n)):
            logprobs = ChatCompletionLogProbs(content=chat_logprobs(spans, self.presenter)) if body.logprobs else None
            message, finish = ChatMessage(role=self.role, content=self.echo + "".join(texts)), last.finish_reason
            if self.tools is not None:  # every token keeps its Chat logprob entry, tool calls' too (vLLM)
                message, finish = self._tool_message("".join(texts), last.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=last.stop_reason,
                token_ids=last.token_ids(spans) if body.return_token_ids else None))
            generated += last.generated
        scores = collected[0][2]  # the prompt is scored once; every sample reports the same scores
        response = ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=choices,
            usage=self.usage(generated),
            prompt_logprobs=prompt_logprobs(scores, self.presenter) if scores else None,
            prompt_token_ids=self.prompt_ids if body.return_token_ids else None)
        return Response(response.model_dump_json(), media_type="application/json")

    def _tool_message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        reader = ToolCallReader(self.tools, OutputParser())
        content, _, _ = reader.step(text, [], final=True)
        calls = reader.tool_calls()
        if calls and not content:  # vLLM: null content beside auto calls, "" beside required or named ones
            content = None if self.tools.choice == "auto" and not self.echo else ""
        return (ChatMessage(role=self.role, content=None if content is None else self.echo + content,
                            tool_calls=calls),
                self.tools.finish_reason(bool(calls), finish_reason))

    def _chunk(self, index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None,
               token_ids=None, generated: int = 0) -> str:
        choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                    finish_reason=finish_reason)
        if finish_reason is not None:
            choice.stop_reason = stop_reason
        if token_ids is not None:
            choice.token_ids = token_ids
        chunk = ChatCompletionStreamResponse(id=self.request_id, object="chat.completion.chunk", created=self.created,
                                             model=self.ctx.model_name, choices=[choice])
        if delta.role is not None and self.body.return_token_ids:  # on each choice's first chunk, as vLLM
            chunk.prompt_token_ids = self.prompt_ids
        if self.body.stream_options is not None and self.body.stream_options.continuous_usage_stats:
            chunk.usage = self.usage(generated)
        return sse(chunk.model_dump_json(exclude_unset=True))

    @staticmethod
    def _tool_delta(reader: ToolCallReader, piece) -> tuple[DeltaMessage, list]:
        """The piece read for tool calls: its delta (content and/or call deltas; an empty content when neither),
        and the tokens whose entries go with it."""
        content, calls, spans = reader.step(piece.text, piece.spans, final=piece.finish_reason is not None)
        if not calls:
            return DeltaMessage(content=content or ""), spans
        return (DeltaMessage(tool_calls=calls) if content is None else DeltaMessage(content=content, tool_calls=calls),
                spans)

    async def stream(self, outputs: list[RequestOutput]):
        """vLLM's order: each choice's role chunk, then each choice's echo, then the samples' chunks as they come,
        each with its choice ``index``."""
        body, options = self.body, self.body.stream_options
        generated = [0] * len(outputs)
        try:
            for index in range(len(outputs)):
                yield self._chunk(index, DeltaMessage(role=self.role, content=""))
            for index in range(len(outputs) if self.echo else 0):
                yield self._chunk(index, DeltaMessage(content=self.echo))
            readers = [ToolCallReader(self.tools, OutputParser()) if self.tools else None for _ in outputs]
            async for index, piece in merged([_pieces(output, index) for index, output in enumerate(outputs)]):
                generated[index] = piece.generated
                delta, spans, finish = DeltaMessage(content=piece.text), piece.spans, piece.finish_reason
                if readers[index] is not None:
                    delta, spans = self._tool_delta(readers[index], piece)
                    finish = self.tools.finish_reason(bool(readers[index].calls), finish)
                content = chat_logprobs(spans, self.presenter) if body.logprobs else None
                if not (delta.content or delta.tool_calls) and not content and finish is None:
                    continue
                yield self._chunk(index, delta, ChatCompletionLogProbs(content=content) if body.logprobs else None,
                                  finish, piece.stop_reason,
                                  piece.token_ids() if body.return_token_ids else None, piece.generated)
            if options is not None and options.include_usage:
                final = ChatCompletionStreamResponse(id=self.request_id, object="chat.completion.chunk",
                                                     created=self.created, choices=[], model=self.ctx.model_name,
                                                     usage=self.usage(sum(generated)))
                yield sse(final.model_dump_json(exclude_unset=True, exclude_none=True))
        except GenerationError as exc:
            yield error_event(exc)
        yield "data: [DONE]\n\n"
