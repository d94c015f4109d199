"""Tool calling for Chat and Responses: the request's choice, what the template sees, how the output is read.

``tool_use`` resolves ``tools`` and ``tool_choice`` as vLLM's ``check_tool_usage`` and chat serving do:
with tools and no ``tool_choice`` the choice is ``auto``; ``auto`` needs ``--enable-auto-tool-choice`` and
``--tool-call-parser``; ``none`` passes the tools to the template but reads no calls; ``required`` and a
named function are enforced with a grammar in the tool parser's own format (``grammar``), so the same
parser reads them. ``ToolUse.parser()`` makes the request's tool-call parser (None: content only).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass

from ignition.catalog.manifest import Features
from ignition.runtime.constraints import LaneConstraints
from ignition.runtime.grammar import GrammarError, GrammarSpec
from ignition.runtime.grammar_spec import guidance_options, json_schema_object, whitespace_options
from ignition.serve.errors import ApiError
from ignition.serve.requests import ending_ids
from ignition.serve.config import ServeConfig
from ignition.serve.detokenize import Span
from ignition.serve.parsers import CONTENT
from ignition.serve.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, random_id
from ignition.serve.tool_parsers import (TOOL_CALL, TOOL_PARSERS, HermesToolParser, ToolCallingParser,
                                         ToolCallParser)

AUTO_NEEDS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
"""vLLM's refusal, word for word (clients and guides search for it)."""


@dataclass(slots=True, frozen=True)
class ToolUse:
    choice: str  # none | auto | required | named
    tools: tuple[dict, ...]  # Chat-format tool definitions, as the chat template receives them
    named: str | None = None  # the function of a named choice
    parser_class: type[ToolCallParser] | None = None  # None: the output is content only
    parallel: bool = True  # False: only the first call is returned

    def parser(self) -> ToolCallParser | None:
        return None if self.parser_class is None else self.parser_class()

    @property
    def template_tools(self) -> list[dict] | None:
        return list(self.tools) if self.tools else None

    def finish_reason(self, called: bool, finish_reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when auto or required called a tool and the output ended by itself; a named
        call keeps ``stop``; a cut output (``length``) keeps its reason (vLLM reports ``tool_calls`` there too,
        with arguments that do not parse)."""
        if called and self.choice in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def grammar(self, whitespace_flexible: bool = True, whitespace_pattern: str | None = None) -> str:
        """The Lark grammar (llguidance) that enforces ``required`` or a named call in the parser's format; the
        whitespace options (``grammar_spec.whitespace_options``) shape the calls' JSON as they shape
        ``response_format``'s."""
        tools = [t for t in self.tools if self.named is None or t["function"]["name"] == self.named]
        schemas = [_call_schema(self.parser_class or HermesToolParser, t["function"], i) for i, t in enumerate(tools)]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = guidance_options(whitespace_flexible, whitespace_pattern)
        return (self.parser_class or HermesToolParser).grammar(json.dumps(schema, ensure_ascii=False),
                                                               several=self.parallel and self.named is None)


def _call_schema(parser: type[ToolCallParser], function: dict, index: int) -> dict:
    """A call object of ``function``: its name, then its arguments (property order is output order), whose
    objects are closed as ``response_format``'s are."""
    try:
        arguments = json_schema_object(function.get("parameters") or {"type": "object"},
                                       f"tools[{index}].function.parameters")
    except GrammarError as exc:
        raise ApiError(str(exc), exc.param) from None
    key = parser.ARGUMENT_KEYS[0]
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: arguments},
            "required": ["name", key], "additionalProperties": False}


def tool_use(config: ServeConfig, tools: list[dict] | None, tool_choice, choice_sent: bool,
             parallel: bool | None = True) -> ToolUse:
    """The request's tool use; ApiError (400) naming ``tools`` or ``tool_choice``. ``tools`` in Chat format;
    ``tool_choice`` "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    ``choice_sent``: the request set ``tool_choice`` (to something other than null)."""
    if tools is not None and not tools:
        raise ApiError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", "tools")
    if not choice_sent:
        tool_choice = "auto" if tools else "none"
    if not isinstance(tool_choice, dict) and tool_choice not in ("none", "auto", "required"):
        raise ApiError(f"Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, \"none\", \"auto\" or "
                       "\"required\" are supported.", "tool_choice")
    if tool_choice == "none":
        return ToolUse("none", tuple(tools or ()))
    if not tools:
        raise ApiError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    parser = TOOL_PARSERS[config.tool_call_parser] if config.tool_call_parser else None
    if tool_choice == "auto":
        if not (config.enable_auto_tool_choice and parser is not None):
            raise ApiError(AUTO_NEEDS, "tool_choice")
        return ToolUse("auto", tuple(tools), parser_class=parser, parallel=parallel is not False)
    if tool_choice == "required":
        return ToolUse("required", tuple(tools), parser_class=parser or HermesToolParser,
                       parallel=parallel is not False)
    name = tool_choice["function"]["name"]
    if name not in names:
        raise ApiError(f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools` "
                       f"({', '.join(map(repr, names))})", "tool_choice")
    return ToolUse("named", tuple(tools), named=name, parser_class=parser or HermesToolParser, parallel=False)


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` with their JSON-text arguments parsed, as Hugging Face tool templates expect
    them (vLLM's chat_utils does the same); a 400 names arguments that are not JSON."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            parsed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(f"messages[{i}].tool_calls[{j}]: expected {{'type': 'function', 'function': "
                                   "{'name': ..., 'arguments': ...}}", f"messages[{i}].tool_calls[{j}]")
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError as exc:
                        raise ApiError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc}",
                                       f"messages[{i}].tool_calls[{j}].function.arguments") from None
                parsed.append({**call, "function": {**function, "arguments": arguments}})
            message = {**message, "tool_calls": parsed}
        out.append(message)
    return out


def messages_with_tool_item(messages: list[dict], item: dict, i: int, text_of) -> None:
    """An earlier turn's call (an assistant message's tool call; consecutive calls share one message) or a call's
    output (a ``tool`` message; ``text_of(content, where)`` reads its text), as vLLM's Responses serving renders
    them."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ApiError(f"input[{i}]: a {item['type']} item needs a string call_id", f"input[{i}].call_id")
    if item["type"] == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": text_of(output, f"input[{i}].output")})
        return
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
        raise ApiError(f"input[{i}]: a function_call item needs a string name and arguments", f"input[{i}]")
    call = {"id": call_id, "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def responses_tool_use(config: ServeConfig, body_tools: list, choice, parallel: bool | None) -> ToolUse:
    """Responses' flat function tools and tool_choice, in Chat's shape, resolved as Chat resolves them."""
    tools = []
    for i, tool in enumerate(body_tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ApiError(f"tools[{i}]: only function tools are supported, got type {kind!r}", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(f"tools[{i}].name: a function tool needs a name", f"tools[{i}].name")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise ApiError(f"tools[{i}].parameters must be a JSON Schema object", f"tools[{i}].parameters")
        tools.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                       if tool.get(key) is not None}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(f"`tool_choice` = {choice!r}: expected 'none', 'auto', 'required' or "
                           "{'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in ("none", "auto", "required"):
        raise ApiError(f"`tool_choice` = {choice!r}: expected 'none', 'auto', 'required' or "
                       "{'type': 'function', 'name': ...}", "tool_choice")
    if not tools and choice == "auto":  # Responses' default choice: nothing to call
        choice = "none"
    return tool_use(config, tools or None, choice, True, parallel)


class ToolCallReader:
    """One sample's output read for tool calls, piece by piece: content, the calls' deltas, and the tokens whose
    first character is decided (a Chat chunk carries exactly those tokens' logprob entries, as it carries their
    text). The full response is the same reading of the whole output, so streamed deltas add up to it."""

    def __init__(self, use: ToolUse, output_parser):
        self.use = use
        self.parser = ToolCallingParser(output_parser, use.parser())
        self.waiting: deque[Span] = deque()
        self.ids: list[str] = []  # one per call started
        self.calls: list[list[str]] = []  # [name, arguments] per call

    def step(self, text: str, spans: list[Span], final: bool) -> tuple[str | None, list[DeltaToolCall], list[Span]]:
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        self.waiting.extend(spans)
        decided = []
        while self.waiting and (final or self.waiting[0].offset < self.parser.consumed):
            decided.append(self.waiting.popleft())
        content, deltas = [], {}  # one delta per call index: vLLM and OpenAI never repeat an index in a chunk
        for event in events:
            if event.kind == CONTENT:
                content.append(event.text)
            elif event.kind == TOOL_CALL and (self.use.parallel or event.index == 0):
                if event.name is not None:  # a call starts: vLLM's first delta of a call
                    self.ids.append(random_id("chatcmpl-tool"))
                    self.calls.append([event.name, ""])
                    deltas[event.index] = DeltaToolCall(index=event.index, id=self.ids[-1], type="function",
                                                        function=DeltaFunctionCall(name=event.name, arguments=""))
                elif event.text:
                    self.calls[event.index][1] += event.text
                    if event.index in deltas:  # the header and the first arguments arrive in one piece
                        deltas[event.index].function.arguments += event.text
                    else:
                        deltas[event.index] = DeltaToolCall(index=event.index,
                                                            function=DeltaFunctionCall(arguments=event.text))
        return ("".join(content) if content else None), list(deltas.values()), decided

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
                for call_id, (name, arguments) in zip(self.ids, self.calls)]


async def enforce(ctx, use: ToolUse, request, structured_outputs: dict | None = None) -> None:
    """``required`` and named choices: the engine request is constrained with ``use.grammar()`` (the parser's
    delimiters around the calls' JSON Schemas, with the whitespace options of ``structured_outputs`` and the
    server's default), compiled off the event loop and cached like any request grammar.
    A 400 names ``tool_choice`` when the core has no structured-output inputs, when the request already carries a
    grammar (``response_format`` / ``structured_outputs``), or when the tools' schemas cannot be compiled."""
    if use.choice not in ("required", "named"):
        return
    if not Features.from_json(ctx.core.features).structured_output:
        raise ApiError("tool_choice 'required' or a named function is enforced with the token bitmask "
                       "(features.structured_output), and this core was exported without it; export it again with "
                       "`ignition export-core`, or use tool_choice 'auto'", "tool_choice")
    if request.constraints is not None and request.constraints.grammar is not None:
        raise ApiError("tool_choice 'required' or a named function cannot be combined with response_format or "
                       "structured_outputs: both constrain the output", "tool_choice")
    try:
        flexible, pattern = whitespace_options(structured_outputs, ctx.config.disable_any_whitespace)
    except GrammarError as exc:
        raise ApiError(str(exc), exc.param) from None
    compiler = ctx.grammar_compiler("tool_choice")
    grammar = GrammarSpec("grammar", use.grammar(flexible, pattern), "tool_choice")
    try:
        compiled = await asyncio.wrap_future(compiler.submit(grammar))
    except GrammarError as exc:
        raise ApiError(f"the tools' parameters cannot be enforced: {exc}", "tool_choice") from None
    if request.constraints is None:
        request.constraints = LaneConstraints.build(ctx.core.vocab_size, max_tokens=request.max_tokens,
                                                    stop_ids=ending_ids(ctx, request.ignore_eos,
                                                                        request.stop_token_ids))
    request.constraints.grammar = compiler.matcher(compiled)
