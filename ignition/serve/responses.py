"""POST /v1/responses: the OpenAI Responses API over the engine, with output-text logprobs.

The input (a string, or messages) is rendered with the core's chat template, as Chat renders
messages. The released text goes through the server's output parser (parsers.py): reasoning
becomes a ``reasoning`` item, content one assistant ``message`` with one ``output_text`` part.
With ``include=["message.output_text.logprobs"]`` a token gets an output-text entry only when
its first byte lies in a content source range; delimiters, stripped whitespace and reasoning
get none. Streaming sends the Responses events in OpenAI's order: response.created,
response.in_progress, then per item output_item.added, content_part.added, the deltas,
the text's done, content_part.done, output_item.done, and response.completed (also when
max_output_tokens ended it, with status "incomplete" and incomplete_details, as vLLM sends it;
response.failed after an error event).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import Response
from pydantic import Field

from ignition.runtime.requests import AdmissionError, Request
from ignition.serve.chat import render_prompt
from ignition.serve.context import ServerContext
from ignition.serve.defaults import RESPONSES
from ignition.serve.errors import ApiError, GenerationError, generation_api_error
from ignition.serve.logprobs import chat_logprobs
from ignition.serve.parsers import CONTENT, PARSERS, OutputParser, TokenAttribution
from ignition.serve.protocol import ChatCompletionRequest, ErrorResponse, GenerationFields, OpenAIBaseModel
from ignition.serve.requests import build_request
from ignition.serve.streaming import RequestOutput, ResponseView, respond
from ignition.serve.tool_parsers import TOOL_CALL, ToolCallingParser
from ignition.serve.tools import ToolUse, enforce, messages_with_tool_item, responses_tool_use

LOGPROBS_INCLUDE = "message.output_text.logprobs"
PARAMS = {"max_tokens": "max_output_tokens", "logprobs": "include", "prompt": "input", "messages": "input"}
"""Loader and Chat parameter names -> the Responses field a rejection names."""


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- wire models -------------------------------------------------------------------------------
class ResponsesRequest(GenerationFields):
    """OpenAI's create-response body, plus the sampling extensions Completions and Chat take."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    background: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"


class TopLogprob(OpenAIBaseModel):
    token: str
    bytes: list[int]
    logprob: float


class OutputLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)
    logprobs: list[OutputLogprob] | None = None


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningItem(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    completed_at: int | None = None
    model: str
    output: list[OutputMessage | ReasoningItem | FunctionCallItem]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str | None = None
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False


RESPONSES_OK = {200: {"description": "One response object, or Responses server-sent events with `stream: true`",
                      "content": {"application/json": {}, "text/event-stream": {}}}}
"""What /openapi.json documents for /v1/responses besides the server's error statuses."""


# -- the request -------------------------------------------------------------------------------
def _check_request(ctx: ServerContext, body: ResponsesRequest) -> None:
    for name in ("prompt", "conversation"):  # stored prompts and conversations live on OpenAI's side
        if (body.model_extra or {}).get(name) is not None:
            raise ApiError(f"`{name}` is not supported by this server: send the whole conversation as `input`", name)
    if body.previous_response_id is not None:
        raise ApiError("responses are not stored, so `previous_response_id` cannot be resolved: send the whole "
                       "conversation as `input`", "previous_response_id")
    if body.background:
        raise ApiError("`background` = True is not supported by this server (supported: False)", "background")
    if body.truncation == "auto":
        raise ApiError("`truncation` = 'auto' is not supported by this server (supported: 'disabled')", "truncation")
    if body.prompt_logprobs is not None:
        raise ApiError("`prompt_logprobs` are not available on /v1/responses; use /v1/completions", "prompt_logprobs")
    unknown = [item for item in body.include or () if item != LOGPROBS_INCLUDE]
    if unknown:
        raise ApiError(f"`include` value {unknown[0]!r} is not supported (supported: {[LOGPROBS_INCLUDE]})", "include")
    top, features = body.top_logprobs or 0, ctx.core.features
    if LOGPROBS_INCLUDE not in (body.include or ()):
        if top:
            raise ApiError(f"`top_logprobs` = {top} needs include=['{LOGPROBS_INCLUDE}']", "top_logprobs")
        if body.logprob_token_ids is not None:
            raise ApiError(f"`logprob_token_ids` needs include=['{LOGPROBS_INCLUDE}']", "logprob_token_ids")
    elif features["allow_logprobs"] and not 0 <= top <= ctx.core.k:
        raise ApiError(f"top_logprobs must be between 0 and {ctx.core.k}, got {top}", "top_logprobs")


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise ApiError(f"{where}[{j}]: only text parts (input_text, output_text) are supported",
                               f"{where}[{j}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ApiError(f"{where}: expected a string or a list of text parts", where)


def input_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """Chat messages of the input: instructions as the system message, reasoning items of earlier turns dropped."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    if not body.input:
        raise ApiError("input must hold at least one item", "input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # earlier turns' reasoning is not re-sent, as reasoning chat templates drop it
        if kind in ("function_call", "function_call_output"):
            messages_with_tool_item(messages, item, i, _text_of)
            continue
        role = item.get("role")
        if kind != "message" or role not in ("user", "assistant", "system", "developer"):
            raise ApiError(f"input[{i}]: expected a message with role user, assistant, system or developer "
                           f"(or a reasoning item), got type {kind!r} and role {role!r}", f"input[{i}]")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), f"input[{i}].content")})
    return messages


def _renamed(exc: ApiError | AdmissionError, body: ResponsesRequest) -> ApiError:
    param = PARAMS.get(exc.param, exc.param)
    if param is not None and param.startswith("messages["):  # a message Chat would name: its Responses field
        param = "instructions" if body.instructions and param.startswith("messages[0]") else "input"
    message = str(exc).replace("max_tokens", "max_output_tokens") if param == "max_output_tokens" else str(exc)
    status = getattr(exc, "status", HTTPStatus.BAD_REQUEST)
    return ApiError(message, param, status, getattr(exc, "err_type", "BadRequestError"))


def _prepare(ctx: ServerContext, body: ResponsesRequest, tools: ToolUse) -> tuple[str, list[int], Request]:
    """Render, tokenize and check the engine request (on a preprocessing thread, as Chat does)."""
    effort = (body.reasoning or {}).get("effort")
    try:
        chat = ChatCompletionRequest(messages=input_messages(body),
                                     chat_template_kwargs={"reasoning_effort": effort} if effort is not None else None)
        prompt_text = render_prompt(ctx, chat, tools.template_tools)
        prompt_ids = ctx.encode(prompt_text, False, "input", body.truncate_prompt_tokens)
        max_tokens = RESPONSES.resolve(body, len(prompt_ids), ctx.max_context)
        wants = LOGPROBS_INCLUDE in (body.include or ())
        engine_body = body.model_copy(update={"tools": None, "tool_choice": None})  # both resolved in `tools`
        request = build_request(ctx, engine_body, prompt_ids, _id("resp"), max_tokens=max_tokens,
                                logprobs=(body.top_logprobs or 0) if wants else None, prompt_logprobs=None)
    except (ApiError, AdmissionError) as exc:
        raise _renamed(exc, body) from exc
    return prompt_text, prompt_ids, request


async def create_response(ctx: ServerContext, body: ResponsesRequest, http: HttpRequest) -> Response:
    ctx.check_model(body.model)
    _check_request(ctx, body)
    tools = responses_tool_use(ctx.config, body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools.parser_class is not None and tools.parser_class.keep_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})  # vLLM's hermes: delimiters may be special
    prompt_text, prompt_ids, request = await ctx.run(_prepare, ctx, body, tools)
    try:
        await enforce(ctx, tools, request, getattr(body, "structured_outputs", None))
    except ApiError as exc:
        raise _renamed(exc, body) from exc
    parser = PARSERS[ctx.config.reasoning_parser](prompt_text)
    if tools.parser_class is not None:  # tool calls are read from the content; they get no output-text entries
        parser = ToolCallingParser(parser, tools.parser())
    view = _ResponsesView(ctx, body, request.request_id, prompt_ids, parser, LOGPROBS_INCLUDE in (body.include or ()),
                          tools.parallel)
    return await respond(ctx, http, body, request, view)


# -- the response ------------------------------------------------------------------------------
@dataclass(slots=True)
class _Item:
    kind: str  # parsers.REASONING or CONTENT, or tool_parsers.TOOL_CALL
    id: str
    texts: list[str] = field(default_factory=list)  # a call's: its arguments text
    logprobs: list = field(default_factory=list)  # ChatCompletionLogProbsContent of content tokens
    name: str = ""  # a call's function

    def part(self, logprobs: bool, text: str | None = None) -> OutputText | ReasoningText:
        text = "".join(self.texts) if text is None else text
        if self.kind != CONTENT:
            return ReasoningText(text=text)
        return OutputText(text=text, logprobs=[OutputLogprob.model_validate(e.model_dump()) for e in self.logprobs]
                          if logprobs else None)

    def item(self, status: str, logprobs: bool, empty: bool = False) -> OutputMessage | ReasoningItem | FunctionCallItem:
        if self.kind == TOOL_CALL:  # vLLM's ids: fc_ for the item, call_ for the call
            return FunctionCallItem(id=self.id, call_id="call_" + self.id.removeprefix("fc_"), name=self.name,
                                    arguments="" if empty else "".join(self.texts), status=status)
        parts = [] if empty else [self.part(logprobs)]
        if self.kind == CONTENT:
            return OutputMessage(id=self.id, status=status, content=parts)
        return ReasoningItem(id=self.id, status=status, content=parts)


def _delta_logprobs(content) -> list[dict]:
    """Logprobs of delta and text-done events: OpenAI's event schema carries no bytes."""
    return [{"token": e.token, "logprob": e.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in e.top_logprobs]} for e in content]


class _ResponsesView(ResponseView):
    """Turns released pieces into a response object, or into Responses events, for one request."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, request_id: str, prompt_ids: list[int],
                 parser: OutputParser, logprobs: bool, parallel_calls: bool = True):
        super().__init__(ctx, body, request_id, prompt_ids)
        self.parallel_calls = parallel_calls  # False: calls after the first are dropped
        table, skip = ctx.table, body.skip_special_tokens
        self.attribution = TokenAttribution(parser,
                                            lambda t: bool(table.bytes[t]) and not (skip and t in table.special))
        self.logprobs = logprobs
        self.items: list[_Item] = []
        self.sequence = 0

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self, item: _Item) -> dict:
        return {"output_index": self.items.index(item), "item_id": item.id, "content_index": 0}

    def _open(self, item: _Item) -> list[str]:
        where = self._where(item)
        if item.kind == TOOL_CALL:
            return [self._event("response.output_item.added", output_index=where["output_index"],
                                item=item.item("in_progress", False, empty=True).model_dump(mode="json"))]
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item=item.item("in_progress", self.logprobs, empty=True).model_dump(mode="json")),
                self._event("response.content_part.added", **where,
                            part=item.part(self.logprobs, "").model_dump(mode="json"))]

    def _close(self, item: _Item, status: str) -> list[str]:
        where = self._where(item)
        if item.kind == TOOL_CALL:
            done = item.item(status, False)
            return [self._event("response.function_call_arguments.done", output_index=where["output_index"],
                                item_id=item.id, arguments=done.arguments),
                    self._event("response.output_item.done", output_index=where["output_index"],
                                item=done.model_dump(mode="json"))]
        part = item.part(self.logprobs)
        if item.kind == CONTENT:
            done = self._event("response.output_text.done", **where, text=part.text,
                               logprobs=_delta_logprobs(item.logprobs))
        else:
            done = self._event("response.reasoning_text.done", **where, text=part.text)
        return [done, self._event("response.content_part.done", **where, part=part.model_dump(mode="json")),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item.item(status, self.logprobs).model_dump(mode="json"))]

    def _apply(self, attributed) -> list[str]:
        """Add parsed text to the items; the stream events that say so."""
        events = []
        for parsed, spans in attributed:
            if parsed.kind == TOOL_CALL:
                events += self._call(parsed)
                continue
            if not self.items or self.items[-1].kind != parsed.kind:
                if self.items:
                    events += self._close(self.items[-1], "completed")
                self.items.append(_Item(parsed.kind, _id("msg" if parsed.kind == CONTENT else "rs")))
                events += self._open(self.items[-1])
            item = self.items[-1]
            item.texts.append(parsed.text)
            if parsed.kind == CONTENT:
                content = chat_logprobs(spans, self.presenter) if self.logprobs else []
                item.logprobs += content
                events.append(self._event("response.output_text.delta", **self._where(item), delta=parsed.text,
                                          logprobs=_delta_logprobs(content)))
            else:
                events.append(self._event("response.reasoning_text.delta", **self._where(item), delta=parsed.text))
        return events

    def _call(self, parsed) -> list[str]:
        """A call starts (its own function_call item) or its arguments grow."""
        if not self.parallel_calls and parsed.index > 0:
            return []
        events = []
        if parsed.name is not None:
            if self.items:
                events += self._close(self.items[-1], "completed")
            self.items.append(_Item(TOOL_CALL, _id("fc"), name=parsed.name))
            return events + self._open(self.items[-1])
        item = self.items[-1]
        item.texts.append(parsed.text)
        return [self._event("response.function_call_arguments.delta", output_index=self.items.index(item),
                            item_id=item.id, delta=parsed.text)]

    def _finish(self, finish_reason: str | None) -> tuple[list[str], str]:
        events = self._apply(self.attribution.finish())
        if not self.items:  # nothing was generated: an empty message, as OpenAI answers
            self.items.append(_Item(CONTENT, _id("msg")))
            events += self._open(self.items[-1])
        status = "incomplete" if finish_reason == "length" else "completed"
        return events + self._close(self.items[-1], status), status

    def _response(self, status: str, generated: int, error: str | None = None) -> ResponseObject:
        body, done = self.body, status != "in_progress"
        output = [] if not done else [item.item("completed" if status == "completed" or item is not self.items[-1]
                                                else "incomplete", self.logprobs) for item in self.items]
        usage = ResponseUsage(
            input_tokens=len(self.prompt_ids), input_tokens_details={"cached_tokens": 0, "cache_write_tokens": 0},
            output_tokens=generated, output_tokens_details={"reasoning_tokens": self.attribution.reasoning_tokens},
            total_tokens=len(self.prompt_ids) + generated) if done else None
        return ResponseObject(
            id=self.request_id, created_at=self.created, status=status, model=self.ctx.model_name, output=output,
            completed_at=int(time.time()) if status == "completed" else None,
            error={"code": "server_error", "message": error} if error else None,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls, reasoning=body.reasoning,
            temperature=0.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, text=body.text or {"format": {"type": "text"}},
            tool_choice=body.tool_choice, tools=body.tools, top_logprobs=body.top_logprobs,
            truncation=body.truncation, usage=usage, user=body.user)

    async def full(self, output: RequestOutput) -> Response:
        try:
            while (piece := await output.next()) is not None:
                self._apply(self.attribution.feed(piece.text, piece.spans))
                last = piece
        except GenerationError as exc:
            raise generation_api_error(exc) from exc
        _, status = self._finish(last.finish_reason)
        return Response(self._response(status, last.generated).model_dump_json(), media_type="application/json")

    async def stream(self, output: RequestOutput):
        started = self._response("in_progress", 0).model_dump(mode="json")
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        generated = 0
        try:
            while (piece := await output.next()) is not None:
                generated = piece.generated
                for event in self._apply(self.attribution.feed(piece.text, piece.spans)):
                    yield event
                finish = piece.finish_reason
        except GenerationError as exc:
            yield self._event("error", code="server_error", message=str(exc), param=None)
            failed = self._response("failed", generated, error=str(exc))
            yield self._event("response.failed", response=failed.model_dump(mode="json"))
            return
        events, status = self._finish(finish)
        for event in events:
            yield event
        final = self._response(status, generated).model_dump(mode="json")
        # NOTE: response.completed even when incomplete (its status and incomplete_details say so), as vLLM
        # streams it: the openai SDK's get_final_response() waits for response.completed and raises without it
        yield self._event("response.completed", response=final)


def register(app: FastAPI, errors: dict[int, dict]) -> None:
    """Serve POST /v1/responses on an app made by create_app (``errors``: its documented error statuses); the
    app's ServeConfig names the reasoning parser, read per request."""

    @app.post("/v1/responses", responses={**RESPONSES_OK, **errors})
    async def responses(body: ResponsesRequest, request: HttpRequest) -> Response:
        return await create_response(request.app.state.ctx, body, request)
