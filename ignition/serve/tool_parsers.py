"""Tool-call parsers: content text in, content and tool calls out, with source ranges (as parsers.py).

``--tool-call-parser`` chooses one. A tool-call parser reads the *content* events of the output
parser (parsers.py) and splits them into content that stays content and ToolCallText events: a
call's first event carries its name and empty arguments (synthetic), the following ones repeat
the argument text verbatim, each with its source range. Delimiters, the call's JSON around the
arguments, and whitespace next to a call belong to no event, so a token whose first byte lies in
a call gets no output-text logprob entry (TokenAttribution selects content sources only).

Formats:

* ``hermes`` (Qwen2.5, Qwen3, Hermes 2 Pro): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  anywhere in the content, as many as the model writes.
* ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole output is calls, optionally after
  ``<|python_tag|>``: ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``.
  An output that does not start (after whitespace) that way is content.

A call whose JSON puts the arguments before the name is held until it closes, then reported with
its arguments re-serialized (``json.dumps``, synthetic text); a ``<tool_call>`` block that is not a
call object stays content verbatim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ignition.serve.parsers import CONTENT, ParsedText

TOOL_CALL = "tool_call"
_WS = " \t\r\n"


@dataclass(slots=True, frozen=True)
class ToolCallText:
    """Part of tool call ``index``: its first event has ``name`` (and empty ``text``), then argument text."""

    index: int
    name: str | None
    text: str
    source: tuple[int, int] | None
    kind: str = TOOL_CALL


def _literal(text: str, at: int, literal: str):
    """Index after ``literal`` at ``at``; None while ``text`` may still continue into it; False when it cannot."""
    rest = text[at:at + len(literal)]
    if rest == literal:
        return at + len(literal)
    return None if literal.startswith(rest) else False


def _skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WS:
        at += 1
    return at


def _string(text: str, at: int):
    """(decoded string, index after it) for the JSON string at ``at``; None when unfinished; False if none."""
    if at >= len(text):
        return None
    if text[at] != '"':
        return False
    i = at + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            try:
                return json.loads(text[at:i + 1]), i + 1
            except ValueError:
                return False
        i += 1
    return None


def call_head(text: str, at: int, argument_keys: tuple[str, ...]):
    """``{"name": "f", "arguments": `` at ``at`` (whitespace allowed between tokens): ``(name, index of the
    arguments value)``; None while ``text`` may still become one; False when it cannot."""
    steps = [("lit", "{"), ("lit", '"name"'), ("lit", ":"), ("str", None), ("lit", ","), ("key", None), ("lit", ":")]
    name = None
    for kind, literal in steps:
        at = _skip_ws(text, at)
        if at >= len(text):
            return None
        if kind == "str":
            found = _string(text, at)
            if not found:
                return found
            name, at = found
            if not isinstance(name, str) or not name:
                return False
            continue
        if kind == "key":
            choices = [_literal(text, at, f'"{key}"') for key in argument_keys]
            ends = [c for c in choices if c]
            if ends:
                at = ends[0]
                continue
            return None if any(c is None for c in choices) else False
        end = _literal(text, at, literal)
        if not end:
            return end
        at = end
    at = _skip_ws(text, at)
    return None if at >= len(text) else (name, at)


class JsonValueEnd:
    """Finds where one JSON value ends, a character at a time (strings and nesting respected)."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.scalar = 0, False, False, None

    def feed(self, ch: str) -> int:
        """1: ``ch`` belongs to the value and ends it; 0: it belongs and the value goes on; -1: the value ended
        before ``ch`` (a scalar followed by a delimiter)."""
        if self.scalar is None:
            self.scalar = ch not in "{["
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return 1 if self.scalar and self.depth == 0 else 0
            return 0
        if ch == '"':
            self.in_string = True
            return 0
        if self.scalar and self.depth == 0:
            return -1 if ch in ",}]" + _WS else 0
        if ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return 1 if self.depth == 0 else 0
        return 0


def _whole_call(body: str, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object, whatever its key order; None when it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = next((call[key] for key in argument_keys if key in call), {})
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """Shared machinery: a buffer of undecided content characters with their output positions."""

    name = ""
    ARGUMENT_KEYS: tuple[str, ...] = ("arguments",)
    keep_special_tokens = False  # decode with special tokens when the call delimiters may be special tokens

    def __init__(self):
        self.buffer = ""
        self.positions: list[int] = []  # output character of each buffered character
        self.fed_end = 0  # output position after the last content character fed
        self.calls = 0  # calls started so far
        self.state = "start"
        self.value: JsonValueEnd | None = None

    @property
    def consumed(self) -> int | None:
        """Output characters before this are decided (None: nothing is held here)."""
        return self.positions[0] if self.buffer else None

    def feed(self, event: ParsedText) -> list:
        start = event.source[0] if event.source else self.fed_end
        self.buffer += event.text
        self.positions += range(start, start + len(event.text))
        self.fed_end = start + len(event.text)
        return self._advance(final=False)

    def finish(self) -> list:
        return self._advance(final=True)

    def _skip(self, length: int) -> None:
        self.buffer, self.positions = self.buffer[length:], self.positions[length:]

    def _emit(self, out: list, length: int, index: int | None = None) -> None:
        """The first ``length`` buffered characters as content (or arguments of call ``index``), one event per
        contiguous run of output characters."""
        at = 0
        while at < length:
            end = at + 1
            while end < length and self.positions[end] == self.positions[end - 1] + 1:
                end += 1
            text, source = self.buffer[at:end], (self.positions[at], self.positions[end - 1] + 1)
            out.append(ParsedText(CONTENT, text, source) if index is None else ToolCallText(index, None, text, source))
            at = end
        self._skip(length)

    def _start_call(self, out: list, name: str) -> int:
        out.append(ToolCallText(self.calls, name, "", None))
        self.calls += 1
        self.value = JsonValueEnd()
        return self.calls - 1

    def _arguments(self, out: list) -> bool:
        """Stream buffered argument text of the current call; True once its value ended."""
        for i, ch in enumerate(self.buffer):
            ended = self.value.feed(ch)
            if ended:
                self._emit(out, i + (ended > 0), self.calls - 1)
                return True
        self._emit(out, len(self.buffer), self.calls - 1)
        return False

    def _whole(self, out: list, body: str, length: int) -> bool:
        """A call held whole (``body`` its JSON, ``length`` buffered characters with delimiters): reported with
        re-serialized arguments (True), or left as content when it is not a call object (False)."""
        parsed = _whole_call(body, self.ARGUMENT_KEYS)
        if parsed is None:
            self._emit(out, length)
            return False
        index = self._start_call(out, parsed[0])
        out.append(ToolCallText(index, None, parsed[1], None))
        self._skip(length)
        return True

    def _advance(self, final: bool) -> list:
        raise NotImplementedError

    @classmethod
    def grammar(cls, call_schema: str, several: bool) -> str:
        """A Lark grammar (llguidance) of output that is only calls in this format: one, or ``several`` (at least
        one); ``call_schema`` is the JSON Schema of one call object."""
        raise NotImplementedError


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    keep_special_tokens = True  # vLLM's hermes parser: some tokenizers mark <tool_call> special

    @classmethod
    def grammar(cls, call_schema: str, several: bool) -> str:
        calls = 'call ("\\n" call)*' if several else "call"
        return (f"start: {calls}\n"
                f'call: "{cls.OPEN}\\n" body "\\n{cls.CLOSE}"\n'  # Qwen's templates put each call on its own lines
                f"body: %json {call_schema}\n")

    def __init__(self):
        super().__init__()
        self.state = "content"

    def _held_open(self) -> int:
        """Characters at the end that may still become OPEN, with the whitespace before them."""
        held = next((n for n in range(min(len(self.buffer), len(self.OPEN) - 1), 0, -1)
                     if self.OPEN.startswith(self.buffer[-n:])), 0)
        kept = self.buffer[:len(self.buffer) - held]
        return len(self.buffer) - len(kept.rstrip(_WS))

    def _advance(self, final: bool) -> list:
        out: list = []
        while self.buffer:
            state = self.state
            if state == "content":
                found = self.buffer.find(self.OPEN)
                if found >= 0:
                    self._emit(out, len(self.buffer[:found].rstrip(_WS)))
                    self._skip(len(self.buffer) - len(self.buffer.lstrip(_WS)))
                    self.state = "head"
                    continue
                self._emit(out, len(self.buffer) if final else len(self.buffer) - self._held_open())
                return out
            if state == "head":
                head = call_head(self.buffer, len(self.OPEN), self.ARGUMENT_KEYS)
                if head:
                    self._start_call(out, head[0])
                    self._skip(head[1])
                    self.state = "arguments"
                elif head is False or final:
                    self.state = "whole"
                else:
                    return out
            elif state == "arguments":
                if not self._arguments(out):
                    return out
                self.state = "tail"
            elif state in ("tail", "whole"):
                found = self.buffer.find(self.CLOSE)
                if found < 0 and not final:
                    return out
                length = len(self.buffer) if found < 0 else found + len(self.CLOSE)
                called = True
                if state == "whole":
                    called = self._whole(out, self.buffer[len(self.OPEN):found if found >= 0 else None], length)
                else:
                    self._skip(length)  # the call object's closing brace and whitespace
                self.state = "lead" if called else "content"
            else:  # lead: whitespace after a call
                self._skip(len(self.buffer) - len(self.buffer.lstrip(_WS)))
                if self.buffer:
                    self.state = "content"
        return out


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.x JSON calls: the output is ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGUMENT_KEYS = ("parameters", "arguments")

    @classmethod
    def grammar(cls, call_schema: str, several: bool) -> str:
        calls = 'call ("; " call)*' if several else "call"
        return f"start: {calls}\ncall: %json {call_schema}\n"

    def _advance(self, final: bool) -> list:
        out: list = []
        while self.buffer:
            state = self.state
            if state in ("start", "tag"):
                at = _skip_ws(self.buffer, 0)
                if at == len(self.buffer) and (state == "tag" or not final):
                    if final:
                        self._skip(at)  # whitespace after the last call
                    return out
                tag = _literal(self.buffer, at, self.TAG) if state == "start" else False
                if tag:
                    self._skip(tag)
                    self.state = "tag"
                elif tag is None and not final:
                    return out
                elif self.buffer[at:at + 1] == "{":
                    self._skip(at)
                    self.state = "head"
                else:
                    self.state = "content"
            elif state == "content":
                self._emit(out, len(self.buffer))
            elif state == "head":
                head = call_head(self.buffer, 0, self.ARGUMENT_KEYS)
                if head:
                    self._start_call(out, head[0])
                    self._skip(head[1])
                    self.state = "arguments"
                elif head is False or final:
                    self.state = "whole"
                else:
                    return out
            elif state == "arguments":
                if not self._arguments(out):
                    return out
                self.state = "tail"
            elif state == "whole":  # the rest is one call object with another key order, or content
                end = _object_end(self.buffer)
                if end is None and not final:
                    return out
                called = self._whole(out, self.buffer[:end], len(self.buffer) if end is None else end)
                self.state = "tail" if called else "content"
            else:  # tail: the call object's closing brace, then ";" and the next call, or the end
                separator = self.buffer.find(";")
                if separator < 0:
                    self._skip(len(self.buffer))
                    return out
                self._skip(separator + 1)
                self.state = "tag"
        return out


def _object_end(text: str) -> int | None:
    """Index after the JSON object that starts ``text``, or None while it is unfinished."""
    value = JsonValueEnd()
    for i, ch in enumerate(text):
        if value.feed(ch) > 0:
            return i + 1
    return None


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {HermesToolParser.name: HermesToolParser,
                                                  Llama3JsonToolParser.name: Llama3JsonToolParser}
"""--tool-call-parser choices."""


class ToolCallingParser:
    """An output parser (parsers.py) whose content goes through a tool-call parser; TokenAttribution drives it
    like any output parser: ``consumed`` is where both have decided, ``reasoning_range`` the output parser's."""

    def __init__(self, output, tools: ToolCallParser):
        self.output, self.tools = output, tools

    @property
    def consumed(self) -> int:
        held = self.tools.consumed
        return self.output.consumed if held is None else min(held, self.output.consumed)

    @property
    def reasoning_range(self):
        return self.output.reasoning_range

    def feed(self, text: str) -> list:
        return self._route(self.output.feed(text), final=False)

    def finish(self) -> list:
        return self._route(self.output.finish(), final=True)

    def _route(self, events: list, final: bool) -> list:
        out = []
        for event in events:
            out += self.tools.feed(event) if event.kind == CONTENT else [event]
        return out + (self.tools.finish() if final else [])
