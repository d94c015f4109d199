"""Grammar test cases shared by the tests and ``benchmarks/grammar.py``: JSON schemas, and a synthetic byte-level BPE
tokenizer of any size.

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


def token_pieces(tokenizer_json: str) -> dict[int, bytes]:
    """Regular token id -> its bytes (special tokens have none)."""
    to_byte = byte_level_alphabet()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    return {i: bytes(to_byte[c] for c in token) for token, i in vocab.items()}


def preference(pieces: dict[int, bytes], eos: int):
    """Rank of each token for the ``closing`` picker: lower is preferred."""
    def rank(token: int) -> tuple:
        piece = pieces.get(token)
        if token == eos:
            return 0, token
        if piece is None:  # other special tokens: never allowed by a grammar anyway
            return 9, token
        if piece and all(c in b'"}]' for c in piece):  # a quote first: inside a string, brackets are text
            return 1, not piece.startswith(b'"'), -len(piece), token
        if piece == b",":
            return 2, token
        if any(c in b" \n\r\t" for c in piece):
            return 5, token
        if piece.isalnum():
            return 4, token
        return 3, token
    return rank


SCHEMAS = {  # name -> JSON Schema: the constructs structured output must honour
    "flat_required": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                       "admin": {"type": "boolean"}},
                      "required": ["name", "age", "admin"], "additionalProperties": False},
    "nested_objects": {"type": "object", "required": ["user"], "properties": {"user": {
        "type": "object", "required": ["address", "id"], "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "required": ["city", "zip"], "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "string_enum": {"type": "object", "required": ["color"],
                    "properties": {"color": {"enum": ["red", "green", "blue", "with \"quote\""]}}},
    "mixed_enum": {"enum": ["a", 1, 2.5, None, True, {"k": [1, 2]}]},
    "const": {"type": "object", "required": ["version"], "properties": {"version": {"const": "v1.2"}}},
    "int_array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "object_array_bounds": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "required": ["id", "tags"], "properties": {
            "id": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2}}}},
    "anyof_scalar": {"anyOf": [{"type": "string", "minLength": 2}, {"type": "integer", "minimum": 10}]},
    "anyof_objects": {"type": "object", "required": ["shape"], "properties": {"shape": {"anyOf": [
        {"type": "object", "required": ["radius"], "properties": {"radius": {"type": "number", "minimum": 0}},
         "additionalProperties": False},
        {"type": "object", "required": ["w", "h"], "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
         "additionalProperties": False}]}}},
    "integer_range": {"type": "object", "required": ["n", "m"], "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 10},
        "m": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}}},
    "number_range": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "string_lengths": {"type": "object", "required": ["code", "note"], "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 3}, "note": {"type": "string", "maxLength": 8}}},
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    "defs_and_ref": {"$defs": {"point": {"type": "object", "required": ["x", "y"],
                                         "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
                     "type": "object", "required": ["start", "end"],
                     "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "recursive_tree": {"$defs": {"node": {"type": "object", "required": ["value"], "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "additional_properties_map": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "nullable_types": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": ["string", "null"]}, "b": {"type": ["integer", "boolean"]}}},
    "tuple_prefix_items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"},
                                                            {"type": "boolean"}], "items": False, "minItems": 3},
    "all_of": {"allOf": [{"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}},
                         {"required": ["b"], "properties": {"b": {"type": "string", "enum": ["x", "y"]}}}]},
    "formats": {"type": "object", "required": ["id", "ip"], "properties": {
        "id": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"}}},
    "optional_properties": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                                             "c": {"type": "array", "items": {"type": "number"}}}},
    "deep_mixed": {"type": "object", "required": ["items", "meta"], "properties": {
        "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "object", "required": ["kind"],
                  "properties": {"kind": {"enum": ["a", "b"]}, "score": {"type": "number"}}}},
        "meta": {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"},
                                                                      "note": {"type": ["string", "null"]}}}}},
}
