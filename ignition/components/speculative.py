"""Speculative verification: the rows a target scores, acceptance, the commit of the accepted prefix,
and the speculative logprob writer.

A ``verify.s{S}.c{capacity}`` round scores P = S+1 positions per lane with the *target*. Row
``lane * P + j`` consumes the lane's input token (j = 0) or its draft token ``d[j-1]`` at position
``positions[lane] + j``; rows after the lane's proposal (``draft_token_ids`` holds -1 from there on)
are invalid and write no cache. In order:

1. ``verify_rows``: the rows' tokens, positions and validity;
2. the recipe runs its model over the rows; the raw target logits ``[capacity * P, vocab_padded]``
   are never modified afterwards;
3. ``accept_draft``: greedy rows accept ``d[j]`` while it equals the target's greedy token at j;
   sampling rows apply the standard speculative rejection rule for a deterministic proposal
   (Leviathan et al. 2023 with q = the point mass on ``d[j]``): accept with probability p_j(d[j]),
   else draw the correction from p_j without d[j]. Position j uses the Philox counter of the
   request's generated-token index ``offset + j``: column 1 decides acceptance, column 0 draws the
   correction (or, after a fully accepted proposal, the bonus token), exactly as an ordinary round
   at that index draws. A lane without a proposal therefore emits what a decode round emits;
4. ``commit_speculative_round``: the shared commit's rules (forced token, token budget, EOS
   clipping) cut the accepted prefix; it writes the physical-slot records (round kind SPECULATIVE,
   EMITTED_COUNT = the committed prefix), then
5. ``reduce_speculative_logprobs`` (the speculative writer) reads those records back and reduces
   only positions the records emit, from the target's raw logits. Draft probabilities never exist
   in the graph, so they cannot enter reporting.
"""

from __future__ import annotations

import torch

from ignition.catalog.abi import RecordField
from ignition.catalog.buffers import DRAFT_TOKENS, LOGPROBS, RECORDS, REQUESTED, TOKEN_ID_COUNTS, TOKEN_IDS
from ignition.catalog.contract import INVALID_TOKEN_ID, RECORD_HEADER_WORDS
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.components import logprobs as _logprobs  # noqa: F401  (registers ignition::reduce_logprobs)
from ignition.components.commit import write_round_records
from ignition.components.sampling import GREEDY_TEMPERATURE, SamplingTensors, draw_sorted, philox_uniform


def verify_rows(buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [capacity, P], positions [capacity, P], valid bool [capacity, P], draft_lengths int64 [capacity])``.

    A lane's proposal is the leading run of ids >= 0 in its ``draft_token_ids`` row; row j of a lane
    is valid when the lane is active and ``j <= draft_length``.
    """
    drafts = buffers[DRAFT_TOKENS]  # int64 [capacity, S]
    draft_lengths = (drafts >= 0).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [capacity]
    tokens = torch.cat([buffers["input_ids"].unsqueeze(1), drafts.clamp(min=0)], dim=1)  # [capacity, P]
    offsets = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, P]
    positions = buffers["positions"].unsqueeze(1) + offsets  # [capacity, P]
    valid = (buffers["active_lanes"] != 0).unsqueeze(1) & (offsets <= draft_lengths.unsqueeze(1))
    return tokens, positions, valid, draft_lengths


def row_sampling(params: SamplingTensors, positions: int) -> SamplingTensors:
    """Per-row parameters ``[capacity * P]``: each lane's, with the Philox offset advanced by the position."""
    rows = {name: getattr(params, name).repeat_interleave(positions) for name, _ in SamplingTensors.FIELDS}
    step = torch.arange(positions, device=params.offset.device).repeat(params.offset.shape[0])  # [capacity * P]
    rows["offset"] = rows["offset"] + step
    return SamplingTensors(**rows)


def draft_output_counts(output_counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Penalty counts each row sees: ``output_counts [capacity, V]`` plus the drafts before it -> ``[capacity * P, V]``.

    Row j scores the token after ``d[0..j-1]``; had they been emitted one round at a time, the
    output counts would include them, so the row's penalties do too.
    """
    capacity, positions = tokens.shape
    width = output_counts.shape[-1]
    drafted = torch.zeros(capacity, positions, width, dtype=output_counts.dtype, device=output_counts.device)
    drafted.scatter_(2, tokens.clamp(0, width - 1).unsqueeze(2), 1)
    drafted[:, 0] = 0  # row 0's token is the input token, already counted when it was emitted
    return (output_counts.unsqueeze(1) + drafted.cumsum(dim=1)).reshape(capacity * positions, width)


def accept_draft(
    greedy_tokens: torch.Tensor,  # int64 [capacity * P]: the target's greedy token per row
    drafts: torch.Tensor,  # int64 [capacity, S]
    draft_lengths: torch.Tensor,  # int64 [capacity]
    params: SamplingTensors | None = None,  # per row ([capacity * P]); None: every row is greedy
    sorted_ids: torch.Tensor | None = None,  # int64 [capacity * P, V]: the filtered distribution's order
    probs: torch.Tensor | None = None,  # float32 [capacity * P, V]: the filtered (unnormalized) distribution
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int64 [capacity, P], counts int64 [capacity])``: the accepted drafts, then one target token.

    ``tokens[lane, :count]`` is what the lane emits before the commit's clipping: ``d[0..a-1]`` and
    the target's token at position a (a correction after a rejection, or the bonus token).
    """
    capacity, draft_tokens = drafts.shape
    positions = draft_tokens + 1
    greedy = greedy_tokens.reshape(capacity, positions)
    proposed = torch.arange(draft_tokens, device=drafts.device).unsqueeze(0) < draft_lengths.unsqueeze(1)  # [c, S]
    row_drafts = torch.nn.functional.pad(drafts.clamp(min=0), (0, 1), value=0)  # [capacity, P]: d[j] at row j
    matches = greedy[:, :draft_tokens] == drafts  # [capacity, S]
    final = greedy
    if params is not None:
        uniform = philox_uniform(params.seed, params.offset, 2)  # [capacity * P, 2]: same counters as sampling
        draft_ids = row_drafts.reshape(-1, 1)  # [capacity * P, 1]
        is_draft = sorted_ids == draft_ids  # [capacity * P, V]
        draft_prob = torch.where(is_draft, probs, 0.0).sum(dim=-1) / probs.sum(dim=-1)  # p_j(d[j])
        sampled_accept = (uniform[:, 1] < draft_prob).reshape(capacity, positions)[:, :draft_tokens]
        row_proposed = torch.nn.functional.pad(proposed, (0, 1), value=False).reshape(-1, 1)
        residual = torch.where(is_draft & row_proposed, 0.0, probs)  # a rejected draft cannot be drawn again
        drawn = draw_sorted(sorted_ids, residual, uniform[:, :1]).reshape(capacity, positions)
        greedy_lanes = (params.temperature < GREEDY_TEMPERATURE).reshape(capacity, positions)
        matches = torch.where(greedy_lanes[:, :draft_tokens], matches, sampled_accept)
        final = torch.where(greedy_lanes, greedy, drawn)
    accepted = (matches & proposed).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [capacity]: leading accepted drafts
    index = torch.arange(positions, device=drafts.device).unsqueeze(0)  # [1, P]
    correction = final.gather(1, accepted.unsqueeze(1))  # [capacity, 1]
    tokens = torch.where(index < accepted.unsqueeze(1), row_drafts, correction)
    counts = accepted + 1
    return torch.where(index < counts.unsqueeze(1), tokens, INVALID_TOKEN_ID), counts


def commit_speculative_round(
    buffers: dict[str, torch.Tensor],
    raw_logits: torch.Tensor,  # [capacity * P, vocab_padded]: the target's, untouched by sampling
    tokens: torch.Tensor,  # int64 [capacity, P] from accept_draft
    counts: torch.Tensor,  # int64 [capacity]
    *,
    vocab_size: int,
    k: int,
) -> torch.Tensor:
    """Clip, write the records, run the speculative writer; return ``int64 [capacity, P]`` (-1 past each prefix).

    A forced position-0 token emits alone (no logprob entry). The token budget cuts the prefix at
    ``token_budget - generated_counts``; the first EOS inside it ends it. A lane with no budget left
    gets a MAINTENANCE record.
    """
    capacity, positions = tokens.shape
    active = buffers["active_lanes"] != 0
    generated, budget = buffers["generated_counts"], buffers["token_budget"]
    exhausted = active & (generated >= budget)
    emitting = active & ~exhausted
    forced_ids = buffers["forced_token_ids"]
    forced = emitting & (forced_ids >= 0)
    tokens = torch.cat([torch.where(forced, forced_ids, tokens[:, 0]).unsqueeze(1), tokens[:, 1:]], dim=1)
    counts = torch.where(forced, 1, counts)
    counts = torch.minimum(counts, (budget - generated).clamp(min=0))
    index = torch.arange(positions, device=tokens.device).unsqueeze(0)  # [1, P]
    eos = buffers["eos_token_ids"].unsqueeze(1)
    eos_at = torch.where((eos >= 0) & (tokens == eos) & (index < counts.unsqueeze(1)), index, positions).amin(dim=1)
    hit_eos = emitting & (eos_at < counts)
    counts = torch.where(hit_eos, eos_at + 1, counts)
    hit_budget = emitting & (generated + counts >= budget)
    finish = torch.where(hit_eos, int(FinishReason.EOS), torch.where(hit_budget, int(FinishReason.LENGTH), 0))
    counts = torch.where(emitting, counts, 0)
    write_round_records(buffers, tokens, emitting, forced, finish, operation=Operation.SPECULATIVE_VERIFY,
                        sequence_lengths=buffers["positions"] + counts, round_kind=RoundKind.SPECULATIVE,
                        idle_round_kind=RoundKind.MAINTENANCE, emitted_counts=counts)
    if LOGPROBS in buffers:
        reduce_speculative_logprobs(buffers, raw_logits, positions, vocab_size=vocab_size, k=k)
    return torch.where(index < counts.unsqueeze(1), tokens, INVALID_TOKEN_ID)


def reduce_speculative_logprobs(buffers: dict[str, torch.Tensor], raw_logits: torch.Tensor, positions: int, *,
                                vocab_size: int, k: int) -> None:
    """The speculative writer: reduce the emitted prefix of every owned, requesting lane.

    Runs after the records are written and reads them back, so it consumes the commit's own emitted
    count and ownership decision. Row ``lane * P + j`` is reduced only when the lane's flag is set,
    its record belongs to the row's slot and epoch, ``j < EMITTED_COUNT`` and position j is not forced;
    rejected, stale, exhausted and unoffered positions are never reduced. The chosen token is read
    from the record's column ``min(j, count - 1)``, so no column beyond the committed prefix is read.
    """
    records = buffers[RECORDS]  # int64 [2, capacity, 16+T]
    capacity, token_capacity = records.shape[1], records.shape[2] - RECORD_HEADER_WORDS
    frame = buffers["frame_index"]  # int64 [1]
    written = records.index_select(0, frame).squeeze(0)  # [capacity, 16+T]
    owned = ((written[:, RecordField.SLOT] == buffers["slot_ids"]) & (written[:, RecordField.SLOT] >= 0)
             & (written[:, RecordField.EPOCH] == buffers["slot_epochs"]))
    counts = written[:, RecordField.EMITTED_COUNT]  # [capacity]
    index = torch.arange(positions, device=records.device).unsqueeze(0)  # [1, P]
    emitted = index < counts.unsqueeze(1)  # [capacity, P]
    forced = ((written[:, RecordField.FORCED_MASK].unsqueeze(1) >> index) & 1) != 0
    requested = ((buffers[REQUESTED] != 0) & owned).unsqueeze(1) & emitted & ~forced  # [capacity, P]
    column = RECORD_HEADER_WORDS + torch.minimum(index, (counts - 1).clamp(min=0).unsqueeze(1))  # within the prefix
    chosen = torch.where(emitted, written.gather(1, column), INVALID_TOKEN_ID).reshape(-1)  # [capacity * P]
    lanes = torch.arange(capacity, device=records.device).unsqueeze(1)
    out_rows = ((frame * capacity + lanes) * token_capacity + index).reshape(-1)  # [capacity * P]
    explicit = TOKEN_IDS in buffers
    torch.ops.ignition.reduce_logprobs(
        raw_logits, chosen, requested.reshape(-1).to(torch.int32), buffers[LOGPROBS], out_rows,
        buffers[TOKEN_IDS].repeat_interleave(positions, dim=0) if explicit else None,
        buffers[TOKEN_ID_COUNTS].repeat_interleave(positions, dim=0) if explicit else None,
        vocab_size, k,
    )
