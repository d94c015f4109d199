"""Token presentation: raw token bytes, incremental UTF-8 decoding, text offsets and stop strings.

A token's bytes come from the tokenizer's decoder steps applied to that token alone, keeping
byte-level and byte-fallback pieces as raw bytes: no UTF-8 replacement and no stream-boundary
cleanup (a leading-space strip) happen per token. Text is decoded incrementally from those
bytes with the Unicode "maximal subpart" replacement rule, exactly what
``bytes.decode("utf-8", "replace")`` produces for the whole stream, while every byte is
mapped to the character it belongs to. A token's offset is the index of the character that
holds its first byte; a token without bytes sits before the next character. Tokens are
released only at character boundaries, so a token whose bytes end inside a character waits,
with its text, until the following bytes complete (or replace) that character.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_steps(decoder: dict | None) -> tuple[list, int] | None:
    """Per-token steps (str|bytes -> str|bytes) and the leading spaces the stream start drops; None if unknown."""
    if decoder is None:
        return [], 0
    kind = decoder["type"]
    if kind == "Sequence":
        steps, strip = [], 0
        for child in decoder["decoders"]:
            parsed = _decoder_steps(child)
            if parsed is None:
                return None
            steps += parsed[0]
            strip = max(strip, parsed[1])
        return steps, strip
    if kind == "ByteLevel":
        alphabet = {c: bytes([b]) for c, b in byte_level_alphabet().items()}
        return [lambda p: b"".join(alphabet.get(c) or c.encode() for c in p)], 0
    if kind == "ByteFallback":
        return [lambda p: bytes([int(m.group(1), 16)]) if (m := _BYTE_FALLBACK.match(p)) else p], 0
    if kind == "Replace":
        pattern, content = decoder["pattern"], decoder["content"]
        if "String" in pattern:
            return [lambda p, s=pattern["String"]: p.replace(s, content)], 0
        regex = re.compile(pattern["Regex"])
        return [lambda p: regex.sub(content, p)], 0
    if kind == "Metaspace":
        leading = 0 if decoder.get("prepend_scheme") == "never" or decoder.get("add_prefix_space") is False else 1
        return [lambda p, r=decoder["replacement"]: p.replace(r, " ")], leading
    if kind == "Strip":
        return [], decoder.get("start", 0) if decoder.get("content") == " " else 0
    if kind == "Fuse":
        return [], 0
    if kind == "WordPiece":
        prefix = decoder.get("prefix", "##")
        return [lambda p: p[len(prefix):] if p.startswith(prefix) else " " + p], 1
    if kind == "BPEDecoder":
        return [lambda p, s=decoder.get("suffix", "</w>"): p.replace(s, " ")], 0
    return None


def _apply(steps: list, piece: str) -> bytes:
    value: str | bytes = piece
    for step in steps:
        if isinstance(value, str):
            value = step(value)
    return value.encode("utf-8") if isinstance(value, str) else value


def token_name(data: bytes) -> str:
    """How a token is written in logprob entries: its text, or ``bytes:\\xNN...`` when not valid UTF-8 alone."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenTable:
    """Bytes, names and special flags of every id the core can produce (ids beyond the tokenizer: empty)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.has_tokenizer = tokenizer is not None
        self.bytes: list[bytes] = [b""] * vocab_size
        self.special: frozenset[int] = frozenset()
        self.strip_leading = 0  # stream-boundary cleanup: spaces the decoder drops at the start of a text
        if tokenizer is not None:
            config = json.loads(tokenizer.to_str())
            self.special = frozenset(t["id"] for t in config.get("added_tokens", []) if t.get("special"))
            parsed = _decoder_steps(config.get("decoder"))
            if parsed is not None:
                self.strip_leading = parsed[1]
            for token_id in range(min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))):
                piece = tokenizer.id_to_token(token_id)
                if piece is None:
                    continue
                if parsed is None:  # an unknown decoder: ask the tokenizer (replacement may have happened)
                    self.bytes[token_id] = tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
                else:
                    self.bytes[token_id] = _apply(parsed[0], piece)
        self.names = [token_name(b) for b in self.bytes]

    def __len__(self) -> int:
        return len(self.bytes)


class Utf8Decoder:
    """Incremental UTF-8 decoding that replaces each maximal invalid subpart with one U+FFFD."""

    __slots__ = ("chars", "pending", "need", "low", "high")

    def __init__(self):
        self.chars = 0  # characters completed so far
        self.pending = bytearray()  # an incomplete sequence; it becomes character number self.chars
        self.need = self.low = self.high = 0

    def feed(self, byte: int) -> tuple[str, int]:
        """Consume one byte; return the characters it completes and the index of the character holding it."""
        if self.pending:
            if self.low <= byte <= self.high:
                self.pending.append(byte)
                self.need -= 1
                self.low, self.high = 0x80, 0xBF
                index = self.chars
                if self.need:
                    return "", index
                text = self.pending.decode("utf-8")
                self.pending.clear()
                self.chars += 1
                return text, index
            flushed = self.flush()  # the pending prefix is one replaced character; the byte starts afresh
            text, index = self._start(byte)
            return flushed + text, index
        return self._start(byte)

    def _start(self, byte: int) -> tuple[str, int]:
        index = self.chars
        if byte < 0x80:
            self.chars += 1
            return chr(byte), index
        if 0xC2 <= byte <= 0xDF:
            self.need, self.low, self.high = 1, 0x80, 0xBF
        elif 0xE0 <= byte <= 0xEF:
            self.need, self.low, self.high = 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
        elif 0xF0 <= byte <= 0xF4:
            self.need, self.low, self.high = 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
        else:
            self.chars += 1
            return REPLACEMENT, index
        self.pending.append(byte)
        return "", index

    def flush(self) -> str:
        """End of stream: an incomplete sequence becomes one U+FFFD."""
        if not self.pending:
            return ""
        self.pending.clear()
        self.chars += 1
        return REPLACEMENT


@dataclass(slots=True)
class Span:
    """One released token: its id, what the caller attached to it, and its character offset."""

    token_id: int
    payload: object
    offset: int


@dataclass(slots=True)
class Release:
    text: str
    spans: list[Span]
    stop: str | None = None  # the stop string that ended the text


class TextStream:
    """One output's text: tokens in, released (text, spans) out; keeps only what is not yet released."""

    def __init__(self, table: TokenTable, *, skip_special: bool = True, stops: tuple[str, ...] = (),
                 include_stop: bool = False, strip_leading: int = 0):
        self.table, self.skip_special = table, skip_special
        self.stops, self.include_stop = tuple(s for s in stops if s), include_stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1  # a stop may still start here
        self.utf8 = Utf8Decoder()
        self.strip_left, self.dropped = strip_leading, 0
        self.base = 0  # characters released so far
        self.tail = ""  # complete characters not yet released
        self.pending: list[tuple[int, object, int, int, bool]] = []  # (id, payload, offset, end chars, clean end)
        self.search_from = 0
        self.stop: str | None = None
        self.cut: int | None = None  # absolute character where the text ends after a stop
        self.done = False

    def _append(self, text: str) -> None:
        while self.strip_left and text:
            if text[0] != " ":
                self.strip_left = 0
                break
            text, self.strip_left, self.dropped = text[1:], self.strip_left - 1, self.dropped + 1
        self.tail += text

    def add(self, token_id: int, payload: object = None) -> None:
        if self.stop is not None or self.done:
            return
        data = b"" if self.skip_special and token_id in self.table.special else self.table.bytes[token_id]
        offset = None
        for byte in data:
            text, index = self.utf8.feed(byte)
            self._append(text)
            if offset is None:
                offset = max(0, index - self.dropped)
        if offset is None:  # no bytes: the token sits before the next character
            offset = self.utf8.chars + (1 if self.utf8.pending else 0) - self.dropped
        self.pending.append((token_id, payload, offset, self.utf8.chars - self.dropped, not self.utf8.pending))
        if self.stops:
            self._find_stop()

    def _find_stop(self) -> None:
        start = max(self.search_from - self.base, 0)
        found = [(self.tail.find(s, start), -len(s), s) for s in self.stops]
        found = [f for f in found if f[0] >= 0]
        if found:
            position, _, stop = min(found)
            self.stop = stop
            self.cut = self.base + position + (len(stop) if self.include_stop else 0)
        else:
            self.search_from = max(self.base, self.base + len(self.tail) - self.holdback)

    def release(self, final: bool = False) -> Release:
        """Text and spans that can no longer change; ``final`` ends the stream (pending bytes become U+FFFD)."""
        if self.done:
            return Release("", [])
        if final and self.stop is None:
            self._append(self.utf8.flush())
            if self.stops:
                self._find_stop()
        if self.stop is not None:
            spans = [Span(t, p, o) for t, p, o, _, _ in self.pending if o < self.cut]
            text, self.pending, self.done = self.tail[:self.cut - self.base], [], True
            return Release(text, spans, self.stop)
        if final:
            spans = [Span(t, p, o) for t, p, o, _, _ in self.pending]
            text, self.pending, self.tail, self.done = self.tail, [], "", True
            return Release(text, spans)
        limit = self.base + len(self.tail) - (self.holdback if self.stops else 0)
        count, end = 0, self.base
        for index, (_, _, _, chars, clean) in enumerate(self.pending):
            if chars > limit:
                break
            if clean:
                count, end = index + 1, chars
        if not count:
            return Release("", [])
        spans = [Span(t, p, o) for t, p, o, _, _ in self.pending[:count]]
        text, self.tail = self.tail[:end - self.base], self.tail[end - self.base:]
        del self.pending[:count]
        self.base = end
        return Release(text, spans)


def decode_all(table: TokenTable, token_ids, *, skip_special: bool = True, strip_leading: int = 0) -> Release:
    """A whole token sequence at once (prompts, echo)."""
    stream = TextStream(table, skip_special=skip_special, strip_leading=strip_leading)
    for token_id in token_ids:
        stream.add(token_id)
    return stream.release(final=True)
