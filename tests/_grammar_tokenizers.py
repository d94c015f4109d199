"""A synthetic byte-level BPE tokenizer of any size, for the grammar tests and ``benchmarks/grammar.py``.

GPT-2's byte-level alphabet (all 256 bytes, so every text is encodable), then multi-character tokens in a fixed
order: JSON punctuation pieces, then letter/digit strings of growing length with and without a leading space
(``Ġ``). The token set is prefix-closed, so every token's merge ``(token[:-1], token[-1])`` joins two tokens that
exist; ``tokenizers`` loads it like any trained BPE. Special tokens come after the regular ones, Qwen-style.
Deterministic, offline, no training.
"""

from __future__ import annotations

import itertools
import json
import string

from ignition.serve.detokenize import byte_level_alphabet

JSON_PIECES = ['{"', '":', '",', '"}', '":"', '","', '"]', '["', '[{', '}]', '},', '{}', '[]', ': ', ', ', ' "',
               '": "', '", "', 'true', 'false', 'null', '00', '10', '-1', '.5', '\\n', '\\"']
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _candidates():
    yield from JSON_PIECES
    alphabet = string.ascii_lowercase + string.ascii_uppercase + string.digits
    for length in itertools.count(2):
        for letters in itertools.product(alphabet, repeat=length):
            word = "".join(letters)
            yield word
            yield " " + word


def byte_level_bpe(regular: int, specials: int = len(SPECIALS)) -> tuple[str, int]:
    """(tokenizer.json text, EOS id): ``regular`` ordinary tokens (>= 256), then ``specials`` special tokens, the
    first of which (``<|endoftext|>``) is the EOS."""
    to_char = {byte: char for char, byte in byte_level_alphabet().items()}
    vocab = {to_char[b]: b for b in range(256)}
    merges: list[list[str]] = []

    def add(text: str) -> None:
        token = "".join(to_char[b] for b in text.encode())
        for end in range(2, len(token)):  # prefix-closed: every prefix first
            add_token(token[:end])
        add_token(token)

    def add_token(token: str) -> None:
        if token not in vocab and len(vocab) < regular:
            vocab[token] = len(vocab)
            merges.append([token[:-1], token[-1]])

    for text in _candidates():
        if len(vocab) >= regular:
            break
        add(text)
    names = SPECIALS[:specials] + [f"<|extra_{i}|>" for i in range(max(0, specials - len(SPECIALS)))]
    added = [{"id": regular + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, name in enumerate(names)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    config = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
              "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
              "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                        "vocab": vocab, "merges": merges}}
    return json.dumps(config, ensure_ascii=False), regular
