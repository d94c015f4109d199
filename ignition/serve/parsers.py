"""Output parsers for /v1/responses: generated text in, reasoning and content with source ranges out.

A parser reads the released output text in order and reports ParsedText events. An event's
``source`` is the half-open range [start, end) of output characters it repeats verbatim;
synthetic text has none. Ranges count characters of the decoded output, the unit in which the
text stream locates a token's first byte (``Span.offset`` is the character holding it), so "a
token's first byte lies in a content range" reads "its offset lies in a content event's source".
A character holds whole bytes, so a character range is exactly the byte range of its characters.

``consumed`` says how far the output is decided: every character before it was reported, or
stripped, or recognised as a delimiter. Delimiters and stripped whitespace belong to no event.
Attribution (see TokenAttribution) releases a token as soon as ``consumed`` passes its first byte.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ignition.serve.detokenize import Span

REASONING, CONTENT = "reasoning", "content"


@dataclass(slots=True, frozen=True)
class ParsedText:
    kind: str  # REASONING or CONTENT
    text: str
    source: tuple[int, int] | None  # output characters [start, end) this text repeats; None for synthetic text


class OutputParser:
    """The plain parser: the whole output is content, each piece its own source."""

    name = "plain"

    def __init__(self, prompt_text: str = ""):
        self.consumed = 0
        self.reasoning_range: tuple[int, int | None] | None = None  # the reasoning block, delimiters included

    def feed(self, text: str) -> list[ParsedText]:
        """Events for the next released text (possibly none yet: a parser may hold an undecided tail)."""
        if not text:
            return []
        start, self.consumed = self.consumed, self.consumed + len(text)
        return [ParsedText(CONTENT, text, (start, self.consumed))]

    def finish(self) -> list[ParsedText]:
        """The output ended: whatever is still held."""
        return []


class ThinkParser(OutputParser):
    """``<think>reasoning</think>content``, the DeepSeek-R1 / Qwen3 convention.

    The output reasons when it starts (after whitespace) with ``<think>``, or from its first
    character when the prompt already opened the block (a template ending in ``<think>``).
    Whitespace after ``<think>``, before ``</think>`` and after ``</think>`` is stripped; a block
    still open at the end is all reasoning. Without a block, the output is content verbatim.
    """

    name = "think"
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, prompt_text: str = ""):
        super().__init__(prompt_text)
        opened = prompt_text.rstrip().endswith(self.OPEN)
        self.state = "reasoning_lead" if opened else "start"
        self.reasoning_range = (0, None) if opened else None
        self.buffer = ""  # undecided text, starting at output character self.consumed

    def feed(self, text: str) -> list[ParsedText]:
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> list[ParsedText]:
        events = self._advance(final=True)
        if self.reasoning_range is not None and self.reasoning_range[1] is None:
            self._skip(len(self.buffer))  # trailing whitespace of an unclosed block
            self.reasoning_range = (self.reasoning_range[0], self.consumed)
        return events

    def _emit(self, events: list[ParsedText], kind: str, length: int) -> None:
        if length:
            events.append(ParsedText(kind, self.buffer[:length], (self.consumed, self.consumed + length)))
            self._skip(length)

    def _skip(self, length: int) -> None:
        self.buffer, self.consumed = self.buffer[length:], self.consumed + length

    def _advance(self, final: bool) -> list[ParsedText]:
        events: list[ParsedText] = []
        while True:
            state, buffer = self.state, self.buffer
            if state == "start":
                rest = buffer.lstrip()
                if rest.startswith(self.OPEN):
                    self.reasoning_range = (self.consumed + len(buffer) - len(rest), None)
                    self._skip(len(buffer) - len(rest) + len(self.OPEN))
                    self.state = "reasoning_lead"
                elif not final and (not rest or self.OPEN.startswith(rest)):
                    return events  # may still become <think>
                else:
                    self.state = "content"
            elif state in ("reasoning_lead", "content_lead"):
                rest = buffer.lstrip()
                self._skip(len(buffer) - len(rest))
                if not rest:
                    return events
                self.state = state.removesuffix("_lead")
            elif state == "reasoning":
                close = buffer.find(self.CLOSE)
                if close >= 0:
                    reasoning = len(buffer[:close].rstrip())
                    self._emit(events, REASONING, reasoning)
                    self._skip(close - reasoning + len(self.CLOSE))
                    self.reasoning_range = (self.reasoning_range[0], self.consumed)
                    self.state = "content_lead"
                    continue
                held = 0 if final else next((n for n in range(min(len(buffer), len(self.CLOSE) - 1), 0, -1)
                                             if self.CLOSE.startswith(buffer[-n:])), 0)
                self._emit(events, REASONING, len(buffer[:len(buffer) - held].rstrip()))
                return events
            else:  # content
                self._emit(events, CONTENT, len(buffer))
                return events


PARSERS: dict[str, type[OutputParser]] = {OutputParser.name: OutputParser, ThinkParser.name: ThinkParser}
"""--reasoning-parser choices."""


class TokenAttribution:
    """Which released tokens receive output-text entries, and how many tokens reasoned.

    A token is selected only when its first byte lies in a content event's source range; a
    token without bytes has no first byte and is never selected. Tokens wait here only until the
    parser has consumed their first character, so the queue holds no more than the parser's
    undecided tail.
    """

    def __init__(self, parser: OutputParser, has_bytes: Callable[[int], bool]):
        self.parser, self.has_bytes = parser, has_bytes
        self.waiting: deque[Span] = deque()
        self.reasoning_tokens = 0

    def feed(self, text: str, spans: list[Span]) -> list[tuple[ParsedText, list[Span]]]:
        self.waiting.extend(spans)
        return self._attribute(self.parser.feed(text))

    def finish(self) -> list[tuple[ParsedText, list[Span]]]:
        return self._attribute(self.parser.finish(), final=True)

    def _attribute(self, events: list[ParsedText], final: bool = False) -> list[tuple[ParsedText, list[Span]]]:
        out = [(event, []) for event in events]
        content = [(event.source, bucket) for event, bucket in out if event.kind == CONTENT and event.source]
        while self.waiting and (final or self.waiting[0].offset < self.parser.consumed):
            span = self.waiting.popleft()
            block = self.parser.reasoning_range
            if block is not None and block[0] <= span.offset and (block[1] is None or span.offset < block[1]):
                self.reasoning_tokens += 1
            if not self.has_bytes(span.token_id):
                continue
            for (start, end), bucket in content:
                if start <= span.offset < end:
                    bucket.append(span)
                    break
        return out
