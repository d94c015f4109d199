"""POST /v1/chat/completions, as vLLM's chat serving presents it; the prompt comes from the checkpoint's template."""

from __future__ import annotations

import functools
import json

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from ignition.serve.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                              ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                              ChatCompletionStreamResponse, ChatMessage, DeltaMessage, random_id)
from ignition.serve.common import (ApiError, GenerationError, RequestOutput, ResponseView, ServerContext,
                                             build_request, collect, error_event, respond, sse)
from ignition.serve.logprobs import chat_logprobs, prompt_logprobs

DEFAULT_MAX_TOKENS = 256  # when the core declares no context length to fill


def _text_content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(p.get("text", "") for p in content)
    raise ApiError(f"messages[{index}].content: only text content is supported", f"messages[{index}].content")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _special(config: dict, name: str) -> str:
    value = config.get(name)
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def chat_template_of(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def render_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> str:
    from jinja2 import TemplateError

    template = body.chat_template or chat_template_of(ctx.tokenizer_config)
    if template is None:
        raise ApiError(f"this core has no chat template ({ctx.core.path}/tokenizer/tokenizer_config.json has no "
                       "'chat_template'): pass `chat_template` or use /v1/completions", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       "continue_final_message")
    messages = [dict(m, content=_text_content(m, i)) for i, m in enumerate(body.messages)]
    try:
        rendered = _compiled(template).render(
            messages=messages, add_generation_prompt=body.add_generation_prompt,
            bos_token=_special(ctx.tokenizer_config, "bos_token"),
            eos_token=_special(ctx.tokenizer_config, "eos_token"),
            **(body.chat_template_kwargs or {}))
    except (TemplateError, ValueError, TypeError) as exc:
        raise ApiError(f"the chat template failed: {exc}", "messages") from exc
    if body.continue_final_message and messages and messages[-1]["content"]:
        final = messages[-1]["content"]
        rendered = rendered[:rendered.rindex(final) + len(final)] if final in rendered else rendered
    return rendered


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, http: HttpRequest) -> Response:
    ctx.check_model(body.model)
    if not body.messages:
        raise ApiError("messages must hold at least one message", "messages")
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if body.logprob_token_ids is not None and not body.logprobs:
        raise ApiError("when using `logprob_token_ids`, `logprobs` must be set to true.", "logprob_token_ids")
    features = ctx.core.features
    if body.logprobs and features["allow_logprobs"] and not 0 <= top <= features["max_logprobs"]:
        raise ApiError(f"top_logprobs must be between 0 and {features['max_logprobs']}, got {top}", "top_logprobs")
    prompt_ids = ctx.encode(render_prompt(ctx, body), body.add_special_tokens, "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = ctx.max_context - len(prompt_ids) if ctx.max_context else DEFAULT_MAX_TOKENS
    request = build_request(ctx, body, prompt_ids, random_id("chatcmpl"), max_tokens=max_tokens,
                            logprobs=top if body.logprobs else None, prompt_logprobs=body.prompt_logprobs)
    return await respond(ctx, http, body, request, _ChatView(ctx, body, request.request_id, prompt_ids))


class _ChatView(ResponseView):
    """Turns released pieces into Chat responses for one request."""

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request_id: str, prompt_ids: list[int]):
        super().__init__(ctx, body, request_id, prompt_ids)
        last = body.messages[-1]
        self.role = "assistant" if body.add_generation_prompt else last.get("role", "assistant")
        # echo: the last message is continued when it has the response's role (synthetic text: no token entries)
        self.echo = _text_content(last, len(body.messages) - 1) if body.echo and last.get("role") == self.role else ""

    async def full(self, output: RequestOutput) -> Response:
        texts, spans, scores, last = await collect(output)
        body = self.body
        logprobs = ChatCompletionLogProbs(content=chat_logprobs(spans, self.presenter)) if body.logprobs else None
        choice = ChatCompletionResponseChoice(
            index=0, message=ChatMessage(role=self.role, content=self.echo + "".join(texts)), logprobs=logprobs,
            finish_reason=last.finish_reason, stop_reason=last.stop_reason,
            token_ids=[s.token_id for s in spans] if body.return_token_ids else None)
        response = ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=[choice],
            usage=self.usage(last.generated),
            prompt_logprobs=prompt_logprobs(scores, self.presenter) if scores else None,
            prompt_token_ids=self.prompt_ids if body.return_token_ids else None)
        return Response(response.model_dump_json(), media_type="application/json")

    def _chunk(self, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None,
               token_ids=None) -> str:
        choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=logprobs,
                                                    finish_reason=finish_reason)
        if finish_reason is not None:
            choice.stop_reason = stop_reason
        if token_ids is not None:
            choice.token_ids = token_ids
        chunk = ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.ctx.model_name,
                                             choices=[choice])
        return sse(chunk.model_dump_json(exclude_unset=True))

    async def stream(self, output: RequestOutput):
        body, options, generated = self.body, self.body.stream_options, 0
        try:
            yield self._chunk(DeltaMessage(role=self.role, content=""))
            if self.echo:
                yield self._chunk(DeltaMessage(content=self.echo))
            while (piece := await output.next()) is not None:
                generated = piece.generated
                content = chat_logprobs(piece.spans, self.presenter) if body.logprobs else None
                if not piece.text and not content and piece.finish_reason is None:
                    continue
                yield self._chunk(DeltaMessage(content=piece.text),
                                  ChatCompletionLogProbs(content=content) if body.logprobs else None,
                                  piece.finish_reason, piece.stop_reason,
                                  [s.token_id for s in piece.spans] if body.return_token_ids else None)
            if options is not None and options.include_usage:
                final = ChatCompletionStreamResponse(id=self.request_id, created=self.created, choices=[],
                                                     model=self.ctx.model_name, usage=self.usage(generated))
                yield sse(final.model_dump_json(exclude_unset=True, exclude_none=True))
        except GenerationError as exc:
            yield error_event(exc)
        yield "data: [DONE]\n\n"
