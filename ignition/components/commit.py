"""The shared commit: writes ABI6 records for one round, then reduces logprobs from the records.

Runs inside captured graphs (static shapes, tensor-only control flow). Steps, in order:

1. choose each active lane's emitted token: the forced token when one is bound (a
   thinking-budget close; emitted without a logprob entry), else the sampled token;
2. decide finish reasons: EOS, then the token budget;
3. write the whole active frame of ``completion_records`` (``write_round_records``). Lanes
   outside the submission get INVALID records; active lanes that emit nothing get a
   records-only round kind: ADMISSION (a slot's first prompt chunk), PROMPT (a later prompt
   chunk) or MAINTENANCE (a lane whose token budget is exhausted, such as a cancelled one);
4. reduce logprobs from the *raw* logits (``reduce_emitted_logprobs``). The reduction reads
   the active frame after the writer finished and reduces only rows whose record belongs
   to the row's slot and epoch, emits, and did not force, and whose request flag is set.

The reduction reads only ``logits`` and the records and writes only ``completion_logprobs``:
it never touches sampling state, so sampled tokens are identical with or without logprobs.
No record field says where a payload is; readers derive it (``ignition.catalog.abi.has_payload``).
"""

from __future__ import annotations

import torch

from ignition.catalog.abi import RecordField
from ignition.catalog.buffers import LOGPROBS, RECORDS, REQUESTED, TOKEN_ID_COUNTS, TOKEN_IDS
from ignition.catalog.contract import INVALID_TOKEN_ID, RECORD_HEADER_WORDS
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.components import logprobs as _logprobs  # noqa: F401  (registers ignition::reduce_logprobs)
from ignition.components.vocabulary_logprobs import VocabularyShard, reduce_vocabulary_logprobs


def commit_sampling_round(
    buffers: dict[str, torch.Tensor],
    raw_logits: torch.Tensor,  # [capacity, vocab_padded]: the raw values (sampling puts its window's columns back)
    sampled: torch.Tensor,  # int64 [capacity]
    *,
    operation: Operation,
    vocab_size: int,
    k: int,
    sequence_lengths: torch.Tensor,  # int64 [capacity]: KV length after this round
    round_kind: RoundKind = RoundKind.SAMPLING,
    emits: torch.Tensor | None = None,  # bool [capacity]: lanes that may emit (default: active lanes)
    idle_round_kind: RoundKind | torch.Tensor | None = None,  # active lanes that do not emit (None: PROMPT)
    vocabulary: VocabularyShard | None = None,  # raw_logits is this rank's vocabulary shard (tensor parallel)
) -> torch.Tensor:
    """Write records and packed logprobs for the frame in ``buffers['frame_index']``; return emitted tokens."""
    active = buffers["active_lanes"] != 0
    may_emit = active if emits is None else active & emits
    exhausted = may_emit & (buffers["generated_counts"] >= buffers["token_budget"])  # no token left to emit
    emitting = may_emit & ~exhausted
    if not isinstance(idle_round_kind, torch.Tensor):
        idle_round_kind = torch.full_like(buffers["generated_counts"], int(idle_round_kind or RoundKind.PROMPT))
    idle = torch.where(exhausted, int(RoundKind.MAINTENANCE), idle_round_kind)  # int64 [capacity]
    forced_ids = buffers["forced_token_ids"]
    forced = emitting & (forced_ids >= 0)
    tokens = torch.where(forced, forced_ids, sampled)
    eos = buffers["eos_token_ids"]
    hit_eos = emitting & (eos >= 0) & (tokens == eos)
    hit_budget = emitting & (buffers["generated_counts"] + 1 >= buffers["token_budget"])
    finish = torch.where(hit_eos, int(FinishReason.EOS), torch.where(hit_budget, int(FinishReason.LENGTH), 0))
    write_round_records(buffers, tokens, emitting, forced, finish, operation=operation,
                        sequence_lengths=sequence_lengths, round_kind=round_kind, idle_round_kind=idle)
    if LOGPROBS in buffers:  # a records-only core (benchmark builds) has no payload to write
        reduce_emitted_logprobs(buffers, raw_logits, vocab_size=vocab_size, k=k, vocabulary=vocabulary)
    return torch.where(emitting, tokens, -1)


def prompt_round_kind(chunk_start: torch.Tensor) -> torch.Tensor:
    """Round kind of a prompt chunk that emits nothing: ADMISSION for the chunk that admits the
    request into its slot (``chunk_start == 0``, also on readmission), PROMPT for later chunks."""
    return torch.where(chunk_start == 0, int(RoundKind.ADMISSION), int(RoundKind.PROMPT))


def write_round_records(
    buffers: dict[str, torch.Tensor],
    tokens: torch.Tensor,  # int64 [capacity] (position 0) or [capacity, P] (positions 0..P-1)
    emitting: torch.Tensor,  # bool [capacity]
    forced: torch.Tensor,  # bool [capacity]: position 0 is forced (no logprob entry)
    finish: torch.Tensor,  # int [capacity]: FinishReason
    *,
    operation: Operation,
    sequence_lengths: torch.Tensor,  # int64 [capacity]
    round_kind: RoundKind,
    idle_round_kind: RoundKind | torch.Tensor,  # int [capacity] or scalar: active lanes that emit nothing
    emitted_counts: torch.Tensor | None = None,  # int64 [capacity]: emitted prefix (default: 1 per emitting lane)
) -> None:
    """Rewrite the whole active frame of ``completion_records``; the inactive frame is never touched.

    An emitting lane emits ``tokens[lane, :count]``; token words at and beyond its count are zero.
    """
    records = buffers[RECORDS]  # int64 [2, capacity, 16+T]
    capacity, token_capacity = records.shape[1], records.shape[2] - RECORD_HEADER_WORDS
    frame = buffers["frame_index"]  # int64 [1]
    active = buffers["active_lanes"] != 0
    header = torch.zeros(capacity, RECORD_HEADER_WORDS, dtype=torch.int64, device=records.device)
    counts = emitting.to(torch.int64) if emitted_counts is None else torch.where(emitting, emitted_counts, 0)
    tokens = tokens.reshape(capacity, -1)  # [capacity, P]
    fields = {
        RecordField.SLOT: torch.where(active, buffers["slot_ids"], -1),
        RecordField.EPOCH: torch.where(active, buffers["slot_epochs"], 0),
        RecordField.ROUND_KIND: torch.where(active, torch.where(emitting, int(round_kind), idle_round_kind),
                                            int(RoundKind.INVALID)),
        RecordField.EMITTED_COUNT: counts,
        RecordField.FINISH_REASON: finish.to(torch.int64),
        RecordField.FORCED_MASK: forced.to(torch.int64),  # bit 0: ordinary rounds emit position 0 only
        RecordField.GENERATED_BEFORE: torch.where(active, buffers["generated_counts"], 0),
        RecordField.SEQUENCE_LENGTH: torch.where(active, sequence_lengths, 0),
        RecordField.FRAME: frame.expand(capacity),
        RecordField.OPERATION: torch.where(active, int(operation), 0),
    }
    for index, value in fields.items():
        header[:, index] = value
    positions = tokens.shape[1]
    in_prefix = torch.arange(positions, device=records.device).unsqueeze(0) < counts.unsqueeze(1)  # [capacity, P]
    emitted = torch.zeros(capacity, token_capacity, dtype=torch.int64, device=records.device)
    emitted[:, :positions] = torch.where(in_prefix, tokens, 0)
    records.index_put_((frame,), torch.cat([header, emitted], dim=1).unsqueeze(0))


def reduce_emitted_logprobs(buffers: dict[str, torch.Tensor], raw_logits: torch.Tensor, *, vocab_size: int,
                            k: int, vocabulary: VocabularyShard | None = None) -> None:
    """Reduce position 0 of every sampling row whose record in the active frame allows it.

    Row ``r`` (lane ``r``, raw logits ``raw_logits[r]``) is reduced only when its request flag
    is set, the record's SLOT and EPOCH equal the row's ``slot_ids``/``slot_epochs`` inputs,
    the record emits position 0 and did not force it. The chosen token is read from the
    record, so the payload always describes what the record emitted.
    """
    records = buffers[RECORDS]  # int64 [2, capacity, 16+T]
    capacity, token_capacity = records.shape[1], records.shape[2] - RECORD_HEADER_WORDS
    frame = buffers["frame_index"]  # int64 [1]
    written = records.index_select(0, frame).squeeze(0)  # [capacity, 16+T]: the writer's output
    owned = ((written[:, RecordField.SLOT] == buffers["slot_ids"]) & (written[:, RecordField.SLOT] >= 0)
             & (written[:, RecordField.EPOCH] == buffers["slot_epochs"]))
    emits = written[:, RecordField.EMITTED_COUNT] > 0
    forced = (written[:, RecordField.FORCED_MASK] & 1) != 0
    requested = (buffers[REQUESTED] != 0) & owned & emits & ~forced  # [capacity]
    # NOTE: a fresh tensor, not the strided column view: the prepared kernels index chosen[row] contiguously.
    chosen = torch.where(emits, written[:, RECORD_HEADER_WORDS], INVALID_TOKEN_ID)  # int64 [capacity]: position 0
    lanes = torch.arange(capacity, device=records.device)
    out_rows = (frame * capacity + lanes) * token_capacity  # position 0 of each lane's packed row
    explicit = TOKEN_IDS in buffers
    if vocabulary is not None:  # the sharded reduction: two compact all-gathers, same packed output
        reduce_vocabulary_logprobs(vocabulary, raw_logits, chosen, requested.to(torch.int32), buffers[LOGPROBS], out_rows,
                                   buffers[TOKEN_IDS] if explicit else None,
                                   buffers[TOKEN_ID_COUNTS] if explicit else None, k)
        return
    torch.ops.ignition.reduce_logprobs(
        raw_logits, chosen, requested.to(torch.int32), buffers[LOGPROBS], out_rows,
        buffers[TOKEN_IDS] if explicit else None, buffers[TOKEN_ID_COUNTS] if explicit else None,
        vocab_size, k,
    )
