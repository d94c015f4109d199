"""ABI6 completion records, packed logprob positions and scored prompt rows: layouts and host-side decoding.

A record is one int64 vector ``[16 + T]`` per lane per frame: the header fields below,
then T emitted token ids. A packed position is int32 ``[2 + 2*A]``: chosen id, chosen
FP32 logprob bits, then (id, FP32 bits) pairs. A prompt row is int32 ``[3 + 2*K]``: the
actual token id, its FP32 logprob bits and its rank, then (id, FP32 bits) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from ignition.catalog.buffers import BUFFERS, RECORDS
from ignition.catalog.contract import INVALID_TOKEN_ID, PACKED_CHOSEN_WORDS, PROMPT_ROW_HEADER_WORDS, RECORD_HEADER_WORDS
from ignition.catalog.enums import FinishReason, RoundKind


class RecordField(IntEnum):
    """Header word index of an ABI6 record."""

    SLOT = 0  # physical slot of the lane (-1: none)
    EPOCH = 1  # the slot's generation counter when the record was written
    ROUND_KIND = 2  # RoundKind
    EMITTED_COUNT = 3  # emitted token ids at positions [0, count)
    FINISH_REASON = 4  # FinishReason of the last emitted token (0: still running)
    FORCED_MASK = 5  # bit i: position i is a forced token and has no logprob entry
    RESERVED_6 = 6  # zero (the contract adds no completion-record fields; payload presence is derived, see has_payload)
    GENERATED_BEFORE = 7  # tokens the request had generated before this round
    SEQUENCE_LENGTH = 8  # KV length of the slot after this round
    FRAME = 9  # frame index the record was written into
    OPERATION = 10  # Operation of the producing graph
    RESERVED_11 = 11
    RESERVED_12 = 12
    RESERVED_13 = 13
    RESERVED_14 = 14
    RESERVED_15 = 15


assert len(RecordField) == RECORD_HEADER_WORDS

RECORD_WORD_BITS = 8 * np.dtype(BUFFERS[RECORDS].dtype).itemsize
MAX_RECORD_POSITIONS = RECORD_WORD_BITS
"""Largest T a record can describe: FORCED_MASK is one header word of the record's dtype (int64, fixed by the
contract) with one bit per position, and the contract adds no record fields, so there is no second mask word."""


@dataclass(frozen=True, slots=True)
class Record:
    slot: int
    epoch: int
    round_kind: RoundKind
    emitted: tuple[int, ...]
    finish_reason: FinishReason
    forced: tuple[bool, ...]
    generated_before: int
    sequence_length: int
    frame: int
    operation: int


def decode_record(words) -> Record:
    """Decode one int64 ``[16 + T]`` record (numpy or list)."""
    w = np.asarray(words, dtype=np.int64)
    count = int(w[RecordField.EMITTED_COUNT])
    t = w.shape[0] - RECORD_HEADER_WORDS
    if not 0 <= count <= t:
        raise ValueError(f"record emitted count {count} outside [0, T={t}]")
    forced_mask = int(w[RecordField.FORCED_MASK]) & ((1 << RECORD_WORD_BITS) - 1)
    return Record(
        slot=int(w[RecordField.SLOT]),
        epoch=int(w[RecordField.EPOCH]),
        round_kind=RoundKind(int(w[RecordField.ROUND_KIND])),
        emitted=tuple(int(x) for x in w[RECORD_HEADER_WORDS:RECORD_HEADER_WORDS + count]),
        finish_reason=FinishReason(int(w[RecordField.FINISH_REASON])),
        forced=tuple(bool(forced_mask >> i & 1) for i in range(count)),
        generated_before=int(w[RecordField.GENERATED_BEFORE]),
        sequence_length=int(w[RecordField.SEQUENCE_LENGTH]),
        frame=int(w[RecordField.FRAME]),
        operation=int(w[RecordField.OPERATION]),
    )


def has_payload(record: Record, position: int, requested: bool) -> bool:
    """Whether ``completion_logprobs`` holds a payload for this record position in its frame.

    Derived, never stored: the lane's uploaded request flag, and the record emits the position
    and did not force it. The shared commit gates the reduction on exactly this (plus slot and
    epoch), so a reader never decodes stale payload of a position the record does not emit.
    """
    return requested and 0 <= position < len(record.emitted) and not record.forced[position]


def bits_to_float(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.int32).view(np.float32)


@dataclass(frozen=True, slots=True)
class PackedPosition:
    chosen_id: int
    chosen_logprob: float
    alternatives: tuple[tuple[int, float], ...]  # (id, logprob); unused pairs (id -1) dropped


def decode_packed_position(words, pairs: int) -> PackedPosition:
    """Decode the chosen pair and the first ``pairs`` alternative pairs of one position."""
    w = np.asarray(words, dtype=np.int32)
    ids = w[PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + 2 * pairs:2]
    values = bits_to_float(w[PACKED_CHOSEN_WORDS + 1:PACKED_CHOSEN_WORDS + 2 * pairs:2])
    return PackedPosition(
        chosen_id=int(w[0]),
        chosen_logprob=float(bits_to_float(w[1:2])[0]),
        alternatives=tuple((int(i), float(v)) for i, v in zip(ids, values) if i != INVALID_TOKEN_ID),
    )


@dataclass(slots=True)
class TokenEntry:
    """One generated position as the runtime reports it."""

    id: int
    logprob: float | None  # None for a forced token, or when the request asked for no logprobs
    top: list[tuple[int, float]] = field(default_factory=list)
    forced: bool = False  # emitted by the forced-token binding (the record's forced mask), never sampled


@dataclass(frozen=True, slots=True)
class PromptEntry:
    """One scored prompt position: the actual token, its logprob and rank, and the top alternatives."""

    id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (id, logprob); unused pairs (id -1) dropped

    def as_json(self) -> dict:
        """The shape the server publishes (``prompt_logprobs`` entries)."""
        return {"id": self.id, "logprob": self.logprob, "rank": self.rank,
                "top_logprobs": [{"id": i, "logprob": v} for i, v in self.top]}


def decode_prompt_row(words, alternatives: int) -> PromptEntry:
    """Decode one int32 prompt row with its first ``alternatives`` (id, logprob) pairs."""
    w = np.asarray(words, dtype=np.int32)
    pairs = w[PROMPT_ROW_HEADER_WORDS:PROMPT_ROW_HEADER_WORDS + 2 * alternatives]
    values = bits_to_float(pairs[1::2])
    return PromptEntry(id=int(w[0]), logprob=float(bits_to_float(w[1:2])[0]), rank=int(w[2]),
                       top=tuple((int(i), float(v)) for i, v in zip(pairs[0::2], values) if i != INVALID_TOKEN_ID))


__all__ = ["RecordField", "Record", "decode_record", "has_payload", "PackedPosition", "decode_packed_position",
           "TokenEntry", "PromptEntry", "decode_prompt_row"]
