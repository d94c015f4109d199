"""Token presentation: bytes from the decoder, incremental UTF-8, offsets, release points and stop strings.

Oracles: ``bytes.decode("utf-8", "replace")`` of the whole stream for text, and, for offsets,
the character boundaries of that decode found by splitting the bytes (char_index_oracle).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _serving_tokenizers import byte_fallback_tokenizer, byte_level_tokenizer, char_index_oracle
from ignition.serve.detokenize import TextStream, TokenTable, Utf8Decoder, decode_all, token_name

VOCAB = 250
# ASCII, continuation bytes at the range edges, every kind of lead byte, and bytes never valid in UTF-8
UTF8_HEAVY = st.lists(st.sampled_from([*range(0x00, 0x80, 7), 0x80, 0x82, 0x8F, 0x90, 0x9F, 0xA0, 0xAC, 0xBD, 0xBF,
                                       0xC0, 0xC3, 0xDF, 0xE0, 0xE2, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]),
                      max_size=24).map(bytes)


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def byte_fallback():
    return byte_fallback_tokenizer()


@settings(max_examples=300, deadline=None)
@given(UTF8_HEAVY)
def test_utf8_decoder_matches_python_and_maps_every_byte(data):
    decoder, text, indexes = Utf8Decoder(), "", []
    for byte in data:
        piece, index = decoder.feed(byte)
        text += piece
        indexes.append(index)
    text += decoder.flush()
    assert text == data.decode("utf-8", "replace")
    assert indexes == char_index_oracle(data)


def test_token_names():
    assert token_name("é".encode()) == "é"
    assert token_name(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert token_name(b"\xef\xbf\xbd") == "\ufffd"  # a literal replacement character is text
    assert token_name(b"") == ""


def test_byte_level_bytes_are_raw_pieces(byte_level):
    table = TokenTable(byte_level, VOCAB)
    ids = byte_level.encode("naïve € 中 😀 \ufffd").ids
    assert b"".join(table.bytes[i] for i in ids) == "naïve € 中 😀 \ufffd".encode()
    assert any(table.names[i].startswith("bytes:") for i in ids)  # at least one character is split
    assert table.special == {byte_level.token_to_id(t) for t in ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")}
    assert table.bytes[byte_level.get_vocab_size():] == [b""] * (VOCAB - byte_level.get_vocab_size())
    assert table.strip_leading == 0
    for token_id in range(byte_level.get_vocab_size()):  # each piece's bytes, lossily, are the tokenizer's decode
        if token_id not in table.special:
            assert table.bytes[token_id].decode("utf-8", "replace") == byte_level.decode([token_id])


def test_byte_fallback_bytes_and_leading_space(byte_fallback):
    table = TokenTable(byte_fallback, VOCAB)
    assert table.bytes[byte_fallback.token_to_id("<0xE2>")] == b"\xe2"
    assert table.strip_leading == 1
    ids = byte_fallback.encode("héllo € 中 😀").ids
    assert b"".join(table.bytes[i] for i in ids) == " héllo € 中 😀".encode()  # pieces keep their space
    release = decode_all(table, ids, strip_leading=table.strip_leading)
    assert release.text == byte_fallback.decode(ids) == "héllo € 中 😀"  # the stream start drops it
    assert [s.offset for s in release.spans][:3] == [0, 0, 1]


@functools.cache
def byte_level_table() -> TokenTable:
    return TokenTable(byte_level_tokenizer(), VOCAB)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), max_size=30), st.randoms(use_true_random=False))
def test_stream_matches_whole_decode(ids, rng):
    table = byte_level_table()
    pieces = [b"" if i in table.special else table.bytes[i] for i in ids]
    data = b"".join(pieces)
    text, oracle = data.decode("utf-8", "replace"), char_index_oracle(data)
    stream, released, spans = TextStream(table), "", []
    for token_id in ids:
        stream.add(token_id, token_id)
        if rng.random() < 0.5:
            piece = stream.release()
            released += piece.text
            spans += piece.spans
            done = sum(len(p) for p in pieces[:len(spans)])  # released only at character boundaries
            assert released == data[:done].decode("utf-8", "replace")
            assert released + data[done:].decode("utf-8", "replace") == text
    final = stream.release(final=True)
    released += final.text
    spans += final.spans
    assert released == text
    assert [s.token_id for s in spans] == ids
    position = 0
    for span, piece in zip(spans, pieces):
        expected = oracle[position] if piece else len(data[:position].decode("utf-8", "replace"))
        assert span.offset == expected
        position += len(piece)


def test_split_character_is_held_until_complete(byte_level):
    table = TokenTable(byte_level, VOCAB)
    lead = next(i for i in range(VOCAB) if table.bytes[i] == b"\xe2")
    middle = next(i for i in range(VOCAB) if table.bytes[i] == b"\x82")
    last = next(i for i in range(VOCAB) if table.bytes[i] == b"\xac")
    stream = TextStream(table)
    stream.add(byte_level.token_to_id("x"), "x")
    stream.add(lead, "lead")
    assert stream.release().text == "x"  # the lead waits: its character is not known yet
    stream.add(middle, "middle")
    assert stream.release().spans == []
    stream.add(last, "last")
    piece = stream.release()
    assert piece.text == "€"
    assert [(s.payload, s.offset) for s in piece.spans] == [("lead", 1), ("middle", 1), ("last", 1)]
    stream.add(lead, "lead2")  # an unfinished character at the end becomes one U+FFFD
    stream.add(byte_level.token_to_id("x"), "x2")
    assert stream.release(final=True).text == "\ufffdx"


def test_literal_replacement_character_is_text(byte_level):
    table = TokenTable(byte_level, VOCAB)
    literal = next(i for i in range(VOCAB) if table.bytes[i] == "\ufffd".encode())
    stream = TextStream(table)
    stream.add(literal, "literal")
    piece = stream.release()
    assert (piece.text, piece.spans[0].offset) == ("\ufffd", 0)


def test_zero_width_tokens_sit_before_the_next_character(byte_level):
    table = TokenTable(byte_level, VOCAB)
    end, x = byte_level.token_to_id("<|end|>"), byte_level.token_to_id("x")
    release = decode_all(table, [x, end, 249, x])
    assert (release.text, [s.offset for s in release.spans]) == ("xx", [0, 1, 1, 1])
    release = decode_all(table, [x, end, x], skip_special=False)
    assert release.text == "x<|end|>x"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_keep_only_contributing_tokens(byte_level, include):
    table = TokenTable(byte_level, VOCAB)
    ids = byte_level.encode("the cat sat on the mat").ids
    stream = TextStream(table, stops=("t on", "zz"), include_stop=include)
    released, spans = "", []
    for token_id in ids:
        stream.add(token_id, token_id)
        piece = stream.release()
        released += piece.text
        spans += piece.spans
        if piece.stop:
            break
    assert piece.stop == "t on"
    cut = "the cat sat on the mat".index("t on") + (4 if include else 0)
    assert released == "the cat sat on the mat"[:cut]
    text = "the cat sat on the mat"
    offsets, position = [], 0
    for token_id in ids:
        offsets.append(position)
        position += len(table.bytes[token_id].decode())
    assert [s.token_id for s in spans] == [t for t, o in zip(ids, offsets) if o < cut]
    assert "".join(table.names[s.token_id] for s in spans).startswith(text[:cut])  # partial tokens keep full bytes


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(4, 120), min_size=1, max_size=25), st.integers(0, 30), st.integers(1, 4))
def test_stop_strings_never_leak(ids, start, length):
    table = byte_level_table()
    text = decode_all(table, ids).text
    stop = text[start:start + length]
    if not stop:
        return
    stream, released = TextStream(table, stops=(stop,)), ""
    for token_id in ids:
        stream.add(token_id)
        piece = stream.release()
        released += piece.text
        assert stop not in released
        if piece.stop:
            break
    else:
        released += stream.release(final=True).text
    assert released == text[:text.find(stop)]
