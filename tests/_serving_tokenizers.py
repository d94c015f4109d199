"""Tokenizers trained by the serving tests: multi-byte characters split across tokens on purpose."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Many distinct multi-byte characters, each rare, so merges stay short and characters split across tokens;
# a literal U+FFFD is frequent enough to become one token of its own.
CORPUS = ["the cat sat on the mat. héllo wörld, naïve café, zürich, señor",
          "price: €100 — 中文 字 人 国 😀 😃 ∑ ≈ → ü ñ ç ø å ß",
          "\ufffd\ufffd broken \ufffd text \ufffd",
          "ελληνικά кириллица עברית العربية"] * 10


def _train(model, pre_tokenizer, decoder, normalizer, vocab_size: int):
    from tokenizers import Tokenizer, trainers
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizer, decoder
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_level_tokenizer():
    from tokenizers import decoders, models, pre_tokenizers
    return _train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), None, 200)


def byte_fallback_tokenizer():
    """SentencePiece style: ``▁`` for spaces, characters outside the vocabulary as ``<0xNN>`` pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    config = json.loads(_train(models.BPE(), pre_tokenizers.Metaspace(), decoders.Metaspace(), None, 160).to_str())
    ascii_pieces = {p: i for p, i in config["model"]["vocab"].items() if all(ord(c) < 128 or c == "▁" for c in p)}
    pieces = sorted(ascii_pieces, key=ascii_pieces.get)
    pieces += [f"<0x{b:02X}>" for b in range(0x80, 0x100) if b not in (0xC0, 0xC1)]  # every byte a non-ASCII text needs
    merges = [m if isinstance(m, list) else m.split(" ") for m in config["model"]["merges"]]
    config["model"].update(vocab={p: i for i, p in enumerate(pieces)}, byte_fallback=True,
                           merges=[m for m in merges if "".join(m) in ascii_pieces])
    config["added_tokens"] = [dict(t, id=pieces.index(t["content"])) for t in config["added_tokens"]]
    config["pre_tokenizer"] = None
    config["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    config["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(config))


def write_tokenizer_dir(tokenizer, directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|end|>", "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def char_index_oracle(data: bytes) -> list[int]:
    """For every byte, the index of the character of ``data.decode('utf-8', 'replace')`` that holds it.

    A split point is a character boundary exactly when decoding both halves separately gives the same text.
    """
    text = data.decode("utf-8", "replace")
    boundaries = [k for k in range(1, len(data)) if data[:k].decode("utf-8", "replace")
                  + data[k:].decode("utf-8", "replace") == text]
    return [sum(1 for k in boundaries if k <= p) for p in range(len(data))]


def offsets_oracle(pieces: list[bytes]) -> list[int]:
    """Each token's offset: the character holding its first byte; a token without bytes sits before the next."""
    data = b"".join(pieces)
    holder, offsets, position = char_index_oracle(data), [], 0
    for piece in pieces:
        offsets.append(holder[position] if piece else len(data[:position].decode("utf-8", "replace")))
        position += len(piece)
    return offsets


def splits_a_character(pieces: list[bytes]) -> bool:
    """Whether a valid multi-byte character starts in one token and ends in a later one."""
    data, position = b"".join(pieces), 0
    text = data.decode("utf-8", "replace")
    holder = char_index_oracle(data)
    for piece in pieces[:-1]:
        position += len(piece)
        if piece and 0 < position < len(data) and holder[position - 1] == holder[position] \
                and text[holder[position]] != "\ufffd":
            return True
    return False
