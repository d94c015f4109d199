"""Host side of the structured-output inputs: each lane's ``token_bitmask`` row and logit-bias row.

A request's ``LaneConstraints`` holds what vLLM's sampling controls ask for, validated once at admission
(``LaneConstraints.build``), and writes one lane's rows per submission:

- ``fill_mask(row, generated)``: the grammar's allowed tokens (``runtime/grammar.py``), AND
  ``allowed_token_ids``, minus ``bad_words`` (a one-token word always; a longer word's last token when the
  generated tokens end with the rest of it), minus EOS and the stop ids while fewer than ``min_tokens`` tokens
  were generated. A lane with none of them gets an all-zero row, which the graph reads as "no mask"; a lane
  whose constraints leave no token at all raises ``ConstraintConflict`` instead of uploading an empty mask.
- ``fill_bias(ids, values)``: the sparse ``logit_bias`` (ids, -1 for empty entries).

vLLM parity: ``bad_words`` tokenization follows ``SamplingParams.update_from_tokenizer`` (``bad_word_sequences``)
and logit biases are clamped to [-100, 100] as vLLM's OpenAI front end clamps them. All of it shapes the
sampling logits only; reported logprobs stay the unconstrained model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ignition.catalog.contract import BITMASK_WORD_BITS, MAX_LOGIT_BIAS

LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""vLLM's OpenAI front end clamps each bias into this range (so does OpenAI's API, by rejecting)."""


class ConstraintError(ValueError):
    """A request's sampling constraints cannot be served; ``param`` names the request field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
        self.lane: int | None = None  # raised while filling a submission's rows: the row (lane) at fault


class ConstraintConflict(ConstraintError):
    """At some step a lane's constraints together allow no token (e.g. a grammar that must end while
    ``min_tokens`` still masks EOS): the request fails rather than sampling from an empty distribution."""


def set_bits(words: np.ndarray, ids: np.ndarray) -> None:
    """Set the bits of token ``ids`` in a row of int32 words (bit ``t % 32`` of word ``t // 32``)."""
    view = words.view(np.uint32)
    np.bitwise_or.at(view, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))


def clear_bits(words: np.ndarray, ids: np.ndarray) -> None:
    view = words.view(np.uint32)
    np.bitwise_and.at(view, ids >> 5, ~np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))


def vocabulary_row(words: int, vocab_size: int) -> np.ndarray:
    """int32 [words] with the bits of tokens [0, vocab_size) set: padded lanes are never allowed."""
    row = np.zeros(words, dtype=np.int32)
    full, rest = divmod(vocab_size, BITMASK_WORD_BITS)
    row[:full] = -1
    if rest:
        row.view(np.uint32)[full] = np.uint32((1 << rest) - 1)
    return row


def bad_word_sequences(words: Iterable[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word as ``word.lstrip()``, and again as ``" " + word.lstrip()``
    when that gives a different first token and the same length. ``encode`` adds no special tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise ConstraintError(f"bad_words entry {word!r} encodes to no tokens", "bad_words")
        sequences.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(sequences)


def _check_ids(ids: Iterable, vocab_size: int, param: str) -> list[int]:
    checked = []
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
            raise ConstraintError(f"{param}: token id {token!r} is outside the vocabulary [0, {vocab_size})", param)
        checked.append(int(token))
    return checked


def _check_bias(logit_bias: Mapping, vocab_size: int) -> dict[int, float]:
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ConstraintError(f"logit_bias holds {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                              "logit_bias")
    bias = {}
    for key, value in logit_bias.items():
        token = key
        if isinstance(key, str):  # OpenAI's JSON object keys are token ids written as strings
            try:
                token = int(key)
            except ValueError:
                raise ConstraintError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        (token,) = _check_ids([token], vocab_size, "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConstraintError(f"logit_bias[{key!r}] must be a finite number, got {value!r}", "logit_bias")
        if token in bias:
            raise ConstraintError(f"logit_bias names token id {token} twice", "logit_bias")
        bias[token] = min(LOGIT_BIAS_RANGE[1], max(LOGIT_BIAS_RANGE[0], float(value)))
    return bias


@dataclass(slots=True, eq=False)
class LaneConstraints:
    """One request's constraints on its sampling logits; build with ``LaneConstraints.build``."""

    vocab_size: int
    allowed_token_ids: np.ndarray | None = None  # int64 ids, distinct
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    stop_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # masked below min_tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: object | None = None  # a runtime.grammar.GrammarMatcher (fill(row), accept(token))

    @classmethod
    def build(cls, vocab_size: int, *, allowed_token_ids: Sequence[int] | None = None,
              bad_words: Sequence[Sequence[int]] = (), min_tokens: int = 0, max_tokens: int | None = None,
              stop_ids: Iterable[int] = (), logit_bias: Mapping | None = None, grammar=None) -> "LaneConstraints":
        """Validate every field (ConstraintError naming it); ``bad_words`` are token sequences (see
        ``bad_word_sequences``), ``stop_ids`` EOS and the request's stop ids."""
        allowed = None
        if allowed_token_ids is not None:
            ids = _check_ids(allowed_token_ids, vocab_size, "allowed_token_ids")
            if not ids:
                raise ConstraintError("allowed_token_ids must name at least one token", "allowed_token_ids")
            allowed = np.unique(np.asarray(ids, dtype=np.int64))
        sequences = tuple(tuple(_check_ids(s, vocab_size, "bad_words")) for s in bad_words)
        if any(not s for s in sequences):
            raise ConstraintError("bad_words holds an empty token sequence", "bad_words")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ConstraintError(f"min_tokens must be a non-negative integer, got {min_tokens!r}", "min_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise ConstraintError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        stops = np.unique(np.asarray([t for t in stop_ids if t is not None and 0 <= t < vocab_size], dtype=np.int64))
        constraints = cls(vocab_size, allowed, sequences, min_tokens, stops, _check_bias(logit_bias or {}, vocab_size),
                          grammar)
        if allowed is not None and min_tokens > 0 and not np.setdiff1d(allowed, stops).size:
            raise ConstraintConflict("allowed_token_ids holds only EOS/stop ids, which min_tokens masks",
                                     "allowed_token_ids")
        return constraints

    def fork(self) -> "LaneConstraints":
        """The same constraints with an independent grammar position: one per sample of an ``n > 1`` request."""
        grammar = None if self.grammar is None else self.grammar.fork()
        return LaneConstraints(self.vocab_size, self.allowed_token_ids, self.bad_words, self.min_tokens, self.stop_ids,
                               dict(self.logit_bias), grammar)

    @property
    def fields(self) -> tuple[str, ...]:
        """The request fields these constraints carry (for error messages); a grammar is ``response_format`` or
        ``structured_outputs``, named by its spec."""
        named = (("grammar", self.grammar is not None), ("allowed_token_ids", self.allowed_token_ids is not None),
                 ("bad_words", bool(self.bad_words)), ("min_tokens", self.min_tokens > 0),
                 ("logit_bias", bool(self.logit_bias)))
        return tuple(getattr(getattr(self.grammar, "spec", None), "param", "structured_outputs") if name == "grammar"
                     else name for name, present in named if present)

    @property
    def masks(self) -> bool:
        """Whether this request ever uploads a non-zero bitmask row."""
        return (self.grammar is not None or self.allowed_token_ids is not None or bool(self.bad_words)
                or (self.min_tokens > 0 and self.stop_ids.size > 0))

    def banned(self, generated: Sequence[int]) -> np.ndarray:
        """Token ids masked at the step after ``generated`` by bad_words and min_tokens."""
        banned = []
        for sequence in self.bad_words:
            prefix = len(sequence) - 1
            if prefix <= len(generated) and tuple(generated[len(generated) - prefix:]) == sequence[:prefix]:
                banned.append(sequence[-1])
        ids = np.asarray(banned, dtype=np.int64)
        if len(generated) < self.min_tokens:
            ids = np.concatenate([ids, self.stop_ids])
        return ids

    def fill_mask(self, row: np.ndarray, generated: Sequence[int], grammar_filled: bool = False) -> bool:
        """Write this step's int32 [VOCAB_WORDS] row; True when the lane is masked, False (a zero row) when not.
        ``grammar_filled``: the row already holds the grammar's mask (``fill_mask_rows``)."""
        banned = self.banned(generated)
        if self.grammar is None and self.allowed_token_ids is None and not banned.size:
            row.fill(0)
            return False
        if self.grammar is not None:
            if not grammar_filled:
                self.grammar.fill(row)
            row &= vocabulary_row(row.shape[0], self.vocab_size)
        else:
            row[:] = vocabulary_row(row.shape[0], self.vocab_size)
        if self.allowed_token_ids is not None:
            allowed = np.zeros_like(row)
            set_bits(allowed, self.allowed_token_ids)
            row &= allowed
        if banned.size:
            clear_bits(row, banned)
        if not row.any():
            raise ConstraintConflict(f"no token is allowed after {len(generated)} generated tokens: the grammar, "
                                     "allowed_token_ids, bad_words and min_tokens exclude every token")
        return True

    def fill_bias(self, ids: np.ndarray, values: np.ndarray) -> bool:
        """Write the int64 [B] ids (-1 empty) and float32 [B] values; True when the lane has a bias."""
        ids.fill(-1)
        values.fill(0.0)
        if not self.logit_bias:
            return False
        tokens = list(self.logit_bias)
        ids[:len(tokens)] = tokens
        values[:len(tokens)] = [self.logit_bias[t] for t in tokens]
        return True


def fill_mask_rows(bitmask: np.ndarray, lanes: Sequence[tuple[int, LaneConstraints, Sequence[int]]]) -> None:
    """Fill ``bitmask`` (int32 [rows, VOCAB_WORDS], zeroed first) for each (row, constraints, generated tokens):
    every grammar row at once on the grammar engine's thread pool, then each lane's own constraints."""
    bitmask.fill(0)
    grammars = [(constraints.grammar, index) for index, constraints, _ in lanes if constraints.grammar is not None]
    if grammars:
        type(grammars[0][0]).fill_many(grammars, bitmask)  # a GrammarViolation names its row in ``.lane``
    for index, constraints, generated in lanes:
        try:
            constraints.fill_mask(bitmask[index], generated, grammar_filled=True)
        except ConstraintError as exc:
            exc.lane = index  # the scheduler fails only this lane's request
            raise


__all__ = ["ConstraintConflict", "ConstraintError", "LaneConstraints", "bad_word_sequences", "clear_bits",
           "fill_mask_rows", "set_bits", "vocabulary_row"]
