"""The shared commit: writes ABI6 records for one sampling round, then reduces logprobs.

Runs inside captured graphs (static shapes, tensor-only control flow). Steps, in order:

1. choose each active lane's emitted token: the forced token when one is bound (a
   thinking-budget close; emitted without a logprob entry), else the sampled token;
2. decide finish reasons: EOS, then the token budget;
3. write the whole active frame of ``completion_records`` (inactive lanes get INVALID
   records with nothing emitted, so stale payload is never meaningful);
4. reduce logprobs from the *raw* logits for lanes that requested them and emitted a
   non-forced token, into position 0 of their packed row in the same frame.

The reduction reads only ``logits`` and writes only ``completion_logprobs``: it never
touches sampling state, so sampled tokens are identical with or without logprobs.
"""

from __future__ import annotations

import torch

from ignition.catalog.abi import RecordField
from ignition.catalog.buffers import LOGPROBS, RECORDS, REQUESTED, TOKEN_ID_COUNTS, TOKEN_IDS
from ignition.catalog.contract import RECORD_HEADER_WORDS
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.components import logprobs as _logprobs  # noqa: F401  (registers ignition::reduce_logprobs)


def commit_sampling_round(
    buffers: dict[str, torch.Tensor],
    raw_logits: torch.Tensor,  # [capacity, vocab_padded], untouched by sampling
    sampled: torch.Tensor,  # int64 [capacity]
    *,
    operation: Operation,
    vocab_size: int,
    k: int,
    sequence_lengths: torch.Tensor,  # int64 [capacity]: KV length after this round
    round_kind: RoundKind = RoundKind.SAMPLING,
    emits: torch.Tensor | None = None,  # bool [capacity]: lanes that emit (default: active lanes)
    idle_round_kind: RoundKind = RoundKind.PROMPT,  # active lanes that do not emit (non-final prompt chunks)
) -> torch.Tensor:
    """Write records and packed logprobs for the frame in ``buffers['frame_index']``; return emitted tokens."""
    records = buffers[RECORDS]  # int64 [2, capacity, 16+T]
    capacity, token_capacity = records.shape[1], records.shape[2] - RECORD_HEADER_WORDS
    frame = buffers["frame_index"]  # int64 [1]
    active = buffers["active_lanes"] != 0
    emitting = active if emits is None else active & emits
    forced_ids = buffers["forced_token_ids"]
    forced = emitting & (forced_ids >= 0)
    tokens = torch.where(forced, forced_ids, sampled)
    eos = buffers["eos_token_ids"]
    hit_eos = emitting & (eos >= 0) & (tokens == eos)
    hit_budget = emitting & (buffers["generated_counts"] + 1 >= buffers["token_budget"])
    finish = torch.where(hit_eos, int(FinishReason.EOS), torch.where(hit_budget, int(FinishReason.LENGTH), 0))
    flags = buffers.get(REQUESTED)
    requested = (flags != 0) & emitting & ~forced if flags is not None else torch.zeros_like(emitting)

    header = torch.zeros(capacity, RECORD_HEADER_WORDS, dtype=torch.int64, device=records.device)
    fields = {
        RecordField.SLOT: torch.where(active, buffers["slot_ids"], -1),
        RecordField.EPOCH: torch.where(active, buffers["slot_epochs"], 0),
        RecordField.ROUND_KIND: torch.where(active, torch.where(emitting, int(round_kind), int(idle_round_kind)),
                                            int(RoundKind.INVALID)),
        RecordField.EMITTED_COUNT: emitting.to(torch.int64),
        RecordField.FINISH_REASON: finish.to(torch.int64),
        RecordField.FORCED_MASK: forced.to(torch.int64),
        RecordField.PAYLOAD_MASK: requested.to(torch.int64),
        RecordField.GENERATED_BEFORE: torch.where(active, buffers["generated_counts"], 0),
        RecordField.SEQUENCE_LENGTH: torch.where(active, sequence_lengths, 0),
        RecordField.FRAME: frame.expand(capacity),
        RecordField.OPERATION: torch.where(active, int(operation), 0),
    }
    for index, value in fields.items():
        header[:, index] = value
    emitted = torch.zeros(capacity, token_capacity, dtype=torch.int64, device=records.device)
    emitted[:, 0] = torch.where(emitting, tokens, 0)
    records.index_put_((frame,), torch.cat([header, emitted], dim=1).unsqueeze(0))

    if LOGPROBS not in buffers:  # a core exported without logprob outputs: records only
        return torch.where(emitting, tokens, -1)
    lanes = torch.arange(capacity, device=records.device)
    out_rows = (frame * capacity + lanes) * token_capacity  # position 0 of each lane's packed row
    explicit = TOKEN_IDS in buffers
    torch.ops.ignition.reduce_logprobs(
        raw_logits, tokens, requested.to(torch.int32), buffers[LOGPROBS], out_rows,
        buffers[TOKEN_IDS] if explicit else None, buffers[TOKEN_ID_COUNTS] if explicit else None,
        vocab_size, k,
    )
    return torch.where(emitting, tokens, -1)
