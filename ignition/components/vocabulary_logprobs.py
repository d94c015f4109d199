"""The vocabulary-sharded logprob reduction and prompt scoring: per-rank stages and two compact exchanges.

Each rank holds the raw logits of its vocabulary shard ``[rows, vocab_shard]`` (token ids
``vocab_start + j``; lanes at or past ``vocab_size`` are padding and never enter). The
reduction is the single-rank one (ignition/components/logprobs.py) split at its two global
dependencies:

1. ``shard_statistics``: the shard's FP32 maximum and exponential mass ``sum(exp(x - max))``
   (exchange 1, ``catalog.parallel.STATS``: 256 FP32 words per position per rank);
2. ``shard_candidates``: the global normalization from the gathered statistics (every rank
   combines them in rank order, so every rank holds the same bits), then the chosen token's raw
   logit from its owning rank and either the shard's best 32 sort keys (value desc, id asc) with
   their values, or the raw logits of the selected ids the shard owns (exchange 2,
   ``catalog.parallel.CANDIDATES``);
3. ``merge_vocabulary_logprobs``: the best K of the gathered keys (keys are unique: they hold
   the token id), or each selected id's value from its owner, packed exactly like the single-rank
   output.

Prompt scoring follows the same pattern with 64 int32 words per row per rank. Vocabulary
matrices never travel. The exchanges are traceable functional all-gathers
(``torch.distributed._functional_collectives``) between three opaque ops, so an exported
``.pt2`` holds them. The stage ops here are the torch reference (the CPU path); on CUDA the
generation stages run six prepared Triton launches per rank (triton_vocabulary.py,
registered in device_reduction.py) that write the same words: every exchange word and the
packed output are bit-identical given the same inputs, except the mass (exchange 1, word 1),
which the launches sum per tile (within a few FP32 ulp). Prompt scoring's stages run seven
prepared launches per rank and row block on CUDA (``catalog.parallel.SCORING_LAUNCHES``), with
the same guarantee and the same exception (its exchange 1, word 1). Exchange words carry NaN as ``NAN_BITS`` and a -0.0 maximum as +0.0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ignition.catalog.contract import (INVALID_TOKEN_ID, MAX_SELECTED_IDS, NAN_BITS, NATURAL_K, PACKED_CHOSEN_WORDS,
                                       PROMPT_ROW_WIDTH, SCORING_ROW_BLOCK, TILE_SORT_KEYS)
from ignition.catalog.parallel import (CANDIDATE_KEYS_WORD, CANDIDATE_VALUES_WORD, CANDIDATES, PROMPT_CANDIDATES,
                                       PROMPT_STATS, SELECTED_WORD, STATS)
from ignition.components import logprobs as L

_NAN = torch.tensor(NAN_BITS, dtype=torch.int32).view(torch.float32)  # the contract's NaN as an FP32 scalar

Gather = Callable[[torch.Tensor], torch.Tensor]
"""An all-gather along dim 0: ``[rows, words]`` on every rank -> ``[ranks * rows, words]`` in rank order."""


# ---- shared pieces ----------------------------------------------------------------------------
def _valid_lanes(vocab_start: int, vocab_shard: int, vocab_size: int) -> int:
    """Lanes of this shard below vocab_size (0 for a shard wholly in the padding)."""
    return max(0, min(vocab_shard, vocab_size - vocab_start))


def _max_and_mass(logits: torch.Tensor, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 maximum and ``sum(exp(x - max))`` over the first ``valid`` lanes (``L.exp_masses``)."""
    rows = logits.shape[0]
    if valid == 0:
        return torch.full((rows,), float("-inf"), device=logits.device), torch.zeros(rows, device=logits.device)
    row_max = L._group_maxima(logits, valid).float().amax(dim=1) + 0.0  # NaN propagates; -0.0 becomes +0.0
    shift = L.finite_shift(row_max)
    mass = L.exp_masses(logits, valid, shift)  # the single-device normalization's mass, bit for bit
    return _canonical(row_max), _canonical(mass)


def _canonical(values: torch.Tensor) -> torch.Tensor:
    """Exchange words carry one NaN pattern (NAN_BITS), whatever NaN the arithmetic produced."""
    return torch.where(torch.isnan(values), _NAN, values)


def global_normalization(maxima: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """lse per row from every shard's (maximum, mass), ``[ranks, rows]`` each, combined in rank order.

    ``lse = M + log(sum_r mass_r * exp(max_r - M))`` with M the largest maximum; an infinite M is
    the result itself and NaN propagates, as in the single-rank normalization.
    """
    top = maxima.amax(dim=0)
    shift = L.finite_shift(top)
    total = torch.zeros_like(top)
    for rank in range(maxima.shape[0]):
        total = total + masses[rank] * torch.exp(maxima[rank] - shift)
    return torch.where(torch.isinf(top), top, shift + torch.log(total))


def _owned(ids: torch.Tensor, vocab_start: int, valid: int) -> torch.Tensor:
    return (ids >= vocab_start) & (ids < vocab_start + valid)


def _raw_of(logits: torch.Tensor, ids: torch.Tensor, vocab_start: int, valid: int) -> torch.Tensor:
    """FP32 raw logits of the ids this shard owns, 0 elsewhere: ``[rows, n]``."""
    owned = _owned(ids, vocab_start, valid)
    local = torch.where(owned, ids - vocab_start, torch.zeros_like(ids)).to(torch.int64)
    return torch.where(owned, _canonical(logits.gather(1, local).float()), torch.zeros((), device=logits.device))


def _from_owner(gathered: torch.Tensor, ids: torch.Tensor, vocab_shard: int, vocab_size: int) -> torch.Tensor:
    """Each id's word from its owning rank: gathered ``[ranks, rows, n]`` FP32; NaN outside the vocabulary."""
    valid = (ids >= 0) & (ids < vocab_size)
    owner = torch.where(valid, ids // vocab_shard, torch.zeros_like(ids)).to(torch.int64)
    picked = gathered.gather(0, owner.unsqueeze(0)).squeeze(0)
    return torch.where(valid, picked, torch.full_like(picked, float("nan")))


def _shard_best(logits, lse, vocab_start, valid, count, wanted):
    """The shard's best ``count`` (global ids, FP32 values) by (value desc, id asc); id -1 past the shard."""
    rows = logits.shape[0]
    if valid == 0:
        return (torch.full((rows, count), INVALID_TOKEN_ID, dtype=torch.int64, device=logits.device),
                torch.full((rows, count), float("nan"), device=logits.device))
    ids, values = L._natural_alternatives(logits, lse, valid, count, wanted=wanted)
    return torch.where(ids >= 0, ids + vocab_start, ids), values


def _keys(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sort keys of (id, value) candidates; a missing candidate (id -1) ranks below every real one."""
    return torch.where(ids >= 0, L.sort_keys(values, ids.clamp(min=0)), torch.full_like(ids, L._NO_KEY))


def _best_of(keys: torch.Tensor, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best k gathered candidates (keys are unique, so the order is total): ids, values."""
    best = keys.topk(k, dim=1).indices
    top_keys = keys.gather(1, best)
    present = top_keys != L._NO_KEY
    ids = torch.where(present, L.key_token_ids(top_keys), INVALID_TOKEN_ID)
    return ids, torch.where(present, values.gather(1, best), float("nan"))


def _stack(gathered: torch.Tensor, rows: int) -> torch.Tensor:
    """``[ranks * rows, words]`` -> ``[ranks, rows, words]``."""
    return gathered.view(-1, rows, gathered.shape[-1])


# ---- generation logprobs: the three stages ----------------------------------------------------
def shard_statistics(logits, requested, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Exchange 1 of this rank: ``[rows, 256]`` FP32, word 0 the shard maximum, word 1 its mass."""
    rows = logits.shape[0]
    words = torch.zeros(rows, STATS.words, device=logits.device)
    index = torch.nonzero(requested != 0).flatten()
    if index.numel():
        row_max, mass = _max_and_mass(logits[index], _valid_lanes(vocab_start, logits.shape[1], vocab_size))
        words[index, 0], words[index, 1] = row_max, mass
    return words


def shard_candidates(logits, statistics, chosen, requested, token_ids, token_id_counts,
                     vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Exchange 2 of this rank: ``[rows, 256]`` FP32 (catalog.parallel.CANDIDATES)."""
    rows, shard = logits.shape
    valid = _valid_lanes(vocab_start, shard, vocab_size)
    stats = _stack(statistics, rows)
    lse = global_normalization(stats[:, :, 0], stats[:, :, 1])
    words = torch.zeros(rows, CANDIDATES.words, device=logits.device)
    requested = requested != 0
    index = torch.nonzero(requested).flatten()
    if index.numel() == 0:
        return words
    block, block_lse = logits[index], lse[index]
    words[index, 0] = _raw_of(block, chosen[index].to(torch.int64)[:, None], vocab_start, valid)[:, 0]
    counts = token_id_counts[index] if token_id_counts is not None else torch.zeros_like(index, dtype=torch.int32)
    natural = counts == 0
    if natural.any():
        ids, values = _shard_best(block, block_lse, vocab_start, valid, TILE_SORT_KEYS, natural)
        keys = _keys(ids, values).contiguous().view(torch.float32)  # [n, 64]: bit-preserving words
        value_words = L._pack(ids, values)[:, 1::2].contiguous().view(torch.float32)  # NAN_BITS, -0.0 as +0.0
        packed = torch.cat([keys, value_words], dim=1)[natural]
        words[index[natural], CANDIDATE_KEYS_WORD:CANDIDATE_VALUES_WORD + TILE_SORT_KEYS] = packed
    if (~natural).any():
        selected = token_ids[index[~natural]].to(torch.int64)  # [n, 128]
        words[index[~natural], SELECTED_WORD:SELECTED_WORD + MAX_SELECTED_IDS] = _raw_of(
            block[~natural], selected, vocab_start, valid)
    return words


def merge_vocabulary_logprobs(statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts,
                              vocab_size: int, vocab_shard: int, k: int) -> None:
    """The final merge: writes ``out.view(-1, W)[out_rows[r]]`` for requested rows, like the single-rank op."""
    rows = chosen.shape[0]
    flat_out = out.view(-1, out.shape[-1])
    index = torch.nonzero(requested != 0).flatten()
    if index.numel() == 0:
        return
    stats, cands = _stack(statistics, rows)[:, index], _stack(candidates, rows)[:, index]  # [ranks, n, words]
    lse = global_normalization(stats[:, :, 0], stats[:, :, 1])
    chosen_ids = chosen[index].to(torch.int64)[:, None]
    chosen_raw = _from_owner(cands[:, :, :1], chosen_ids, vocab_shard, vocab_size)
    chosen_pair = L._pack(chosen_ids, chosen_raw - lse[:, None])
    counts = token_id_counts[index] if token_id_counts is not None else torch.zeros_like(index, dtype=torch.int32)
    counts = counts.clamp(0, MAX_SELECTED_IDS)
    natural = counts == 0
    target = out_rows[index]
    if natural.any() and k > 0:
        keys = cands[:, :, CANDIDATE_KEYS_WORD:CANDIDATE_VALUES_WORD].contiguous().view(torch.int64)  # [ranks, n, 32]
        values = cands[:, :, CANDIDATE_VALUES_WORD:CANDIDATE_VALUES_WORD + TILE_SORT_KEYS]
        keys, values = keys.permute(1, 0, 2).flatten(1), values.permute(1, 0, 2).flatten(1)  # [n, ranks * 32]
        ids, best = _best_of(keys[natural], values[natural], k)
        flat_out[target[natural], PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + 2 * k] = L._pack(ids, best)
    if (~natural).any():
        selected = token_ids[index[~natural]].to(torch.int64)  # [n, 128]
        raw = _from_owner(cands[:, ~natural, SELECTED_WORD:SELECTED_WORD + MAX_SELECTED_IDS], selected,
                          vocab_shard, vocab_size)
        width = 2 * int(counts.max())
        sel_packed = L._pack(selected, raw - lse[~natural, None])[:, :width]
        keep = torch.arange(width, device=out.device)[None, :] < 2 * counts[~natural][:, None]
        rows_out = target[~natural]
        existing = flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width]
        flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width] = torch.where(keep, sel_packed, existing)
    flat_out[target, :PACKED_CHOSEN_WORDS] = chosen_pair


# ---- prompt scoring: the three stages ---------------------------------------------------------
def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.float().contiguous().view(torch.int32)


def score_shard_statistics(logits, targets, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Exchange 1 of a prompt row block: ``[rows, 64]`` int32 (max, mass, target raw logit from its owner)."""
    rows, shard = logits.shape
    words = torch.zeros(rows, PROMPT_STATS.words, dtype=torch.int32, device=logits.device)
    index = torch.nonzero((targets >= 0) & (targets < vocab_size)).flatten()
    if index.numel():
        valid = _valid_lanes(vocab_start, shard, vocab_size)
        block = logits[index]
        row_max, mass = _max_and_mass(block, valid)
        raw = _raw_of(block, targets[index].to(torch.int64)[:, None], vocab_start, valid)[:, 0]
        words[index, 0], words[index, 1], words[index, 2] = _bits(row_max), _bits(mass), _bits(raw)
    return words


def score_shard_candidates(logits, statistics, targets, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Exchange 2 of a prompt row block: ``[rows, 64]`` int32 (strictly greater count, best 20 pairs)."""
    rows, shard = logits.shape
    words = torch.zeros(rows, PROMPT_CANDIDATES.words, dtype=torch.int32, device=logits.device)
    index = torch.nonzero((targets >= 0) & (targets < vocab_size)).flatten()
    if index.numel() == 0:
        return words
    valid = _valid_lanes(vocab_start, shard, vocab_size)
    stats = _stack(statistics, rows)[:, index].view(torch.float32)  # [ranks, n, 64]
    lse = global_normalization(stats[:, :, 0], stats[:, :, 1])
    owner = (targets[index].to(torch.int64) // shard)
    value = stats[:, :, 2].gather(0, owner[None]).squeeze(0) - lse  # FP32 reported value of the target
    block = logits[index]
    greater = torch.zeros(index.numel(), dtype=torch.int64, device=logits.device)
    for start in range(0, valid, L.VOCAB_CHUNK):
        chunk = block[:, start:min(start + L.VOCAB_CHUNK, valid)].float() - lse[:, None]
        greater += (chunk > value[:, None]).sum(dim=1)
    ids, values = _shard_best(block, lse, vocab_start, valid, NATURAL_K, None)
    words[index, 0] = greater.to(torch.int32)
    words[index, 1:1 + 2 * NATURAL_K] = L._pack(ids, values)
    return words


def merge_prompt_scores(statistics, candidates, targets, out, out_rows, vocab_size: int, vocab_shard: int) -> None:
    """Writes every row of the block into ``out.view(-1, 43)[out_rows]`` (invalid rows: the invalid pattern)."""
    rows = targets.shape[0]
    flat = out.view(-1, PROMPT_ROW_WIDTH)
    result = torch.zeros(rows, PROMPT_ROW_WIDTH, dtype=torch.int32, device=out.device)
    result[:, 0] = INVALID_TOKEN_ID
    result[:, 1] = NAN_BITS
    result[:, 3::2] = INVALID_TOKEN_ID
    result[:, 4::2] = NAN_BITS
    index = torch.nonzero((targets >= 0) & (targets < vocab_size)).flatten()
    if index.numel():
        stats = _stack(statistics, rows)[:, index]
        floats = stats.view(torch.float32)
        lse = global_normalization(floats[:, :, 0], floats[:, :, 1])
        target = targets[index].to(torch.int64)
        cands = _stack(candidates, rows)[:, index]  # [ranks, n, 64] int32
        value = _from_owner(floats[:, :, 2:3], target[:, None], vocab_shard, vocab_size)[:, 0] - lse
        pairs = cands[:, :, 1:1 + 2 * NATURAL_K].permute(1, 0, 2).reshape(index.numel(), -1, 2)  # [n, ranks*20, 2]
        ids, values = pairs[:, :, 0].to(torch.int64), pairs[:, :, 1].contiguous().view(torch.float32)
        best_ids, best_values = _best_of(_keys(ids, values), values, NATURAL_K)
        result[index, 0] = target.to(torch.int32)
        result[index, 1] = L._pack(target[:, None], value[:, None])[:, 1]
        result[index, 2] = (cands[:, :, 0].to(torch.int64).sum(dim=0) + 1).to(torch.int32)
        result[index, 3:] = L._pack(best_ids, best_values)
    flat[out_rows] = result


# ---- opaque ops and the in-graph sequence ---------------------------------------------------------
def _rows_words(rows: int, words: int, dtype, device) -> torch.Tensor:
    return torch.empty(rows, words, dtype=dtype, device=device)


@torch.library.custom_op("ignition::vocab_shard_statistics", mutates_args=())
def _statistics_op(logits: torch.Tensor, requested: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    return shard_statistics(logits, requested, vocab_start, vocab_size)


@_statistics_op.register_fake
def _(logits, requested, vocab_start, vocab_size):
    return _rows_words(logits.shape[0], STATS.words, torch.float32, logits.device)


@torch.library.custom_op("ignition::vocab_shard_candidates", mutates_args=())
def _candidates_op(logits: torch.Tensor, statistics: torch.Tensor, chosen: torch.Tensor, requested: torch.Tensor,
                   token_ids: torch.Tensor | None, token_id_counts: torch.Tensor | None, vocab_start: int,
                   vocab_size: int) -> torch.Tensor:
    return shard_candidates(logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size)


@_candidates_op.register_fake
def _(logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size):
    return _rows_words(logits.shape[0], CANDIDATES.words, torch.float32, logits.device)


@torch.library.custom_op("ignition::merge_vocabulary_logprobs", mutates_args=("out",))
def _merge_op(statistics: torch.Tensor, candidates: torch.Tensor, chosen: torch.Tensor, requested: torch.Tensor,
              out: torch.Tensor, out_rows: torch.Tensor, token_ids: torch.Tensor | None,
              token_id_counts: torch.Tensor | None, vocab_size: int, vocab_shard: int, k: int) -> None:
    merge_vocabulary_logprobs(statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts,
                              vocab_size, vocab_shard, k)


@_merge_op.register_fake
def _(statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, vocab_shard, k):
    return None


@torch.library.custom_op("ignition::score_shard_statistics", mutates_args=())
def _score_statistics_op(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    return score_shard_statistics(logits, targets, vocab_start, vocab_size)


@_score_statistics_op.register_fake
def _(logits, targets, vocab_start, vocab_size):
    return _rows_words(logits.shape[0], PROMPT_STATS.words, torch.int32, logits.device)


@torch.library.custom_op("ignition::score_shard_candidates", mutates_args=())
def _score_candidates_op(logits: torch.Tensor, statistics: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                         vocab_size: int) -> torch.Tensor:
    return score_shard_candidates(logits, statistics, targets, vocab_start, vocab_size)


@_score_candidates_op.register_fake
def _(logits, statistics, targets, vocab_start, vocab_size):
    return _rows_words(logits.shape[0], PROMPT_CANDIDATES.words, torch.int32, logits.device)


@torch.library.custom_op("ignition::merge_prompt_scores", mutates_args=("out",))
def _merge_scores_op(statistics: torch.Tensor, candidates: torch.Tensor, targets: torch.Tensor, out: torch.Tensor,
                     out_rows: torch.Tensor, vocab_size: int, vocab_shard: int) -> None:
    merge_prompt_scores(statistics, candidates, targets, out, out_rows, vocab_size, vocab_shard)


@_merge_scores_op.register_fake
def _(statistics, candidates, targets, out, out_rows, vocab_size, vocab_shard):
    return None


STAGE_OPS = {"statistics": _statistics_op, "candidates": _candidates_op, "merge": _merge_op}
"""The generation stage ops by stage name (catalog.parallel.VOCABULARY_LAUNCHES); CUDA registers its launches
on them in device_reduction.py."""

SCORING_STAGE_OPS = {"statistics": _score_statistics_op, "candidates": _score_candidates_op,
                     "merge": _merge_scores_op}
"""The prompt-scoring stage ops by stage name (catalog.parallel.SCORING_LAUNCHES); CUDA registers its launches
on them in device_reduction.py."""


@dataclass(frozen=True, slots=True)
class VocabularyShard:
    """This rank's slice of the padded vocabulary and the all-gather that joins the ranks."""

    rank: int
    ranks: int
    vocab_shard: int  # lanes per rank: vocab_padded / ranks
    vocab_size: int
    gather: Gather

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard


def reduce_vocabulary_logprobs(shard: VocabularyShard, logits, chosen, requested, out, out_rows, token_ids,
                               token_id_counts, k: int) -> None:
    """The sharded ``ignition::reduce_logprobs``: three opaque stages around two all-gathers."""
    ops = torch.ops.ignition
    statistics = shard.gather(ops.vocab_shard_statistics(logits, requested, shard.vocab_start, shard.vocab_size))
    candidates = shard.gather(ops.vocab_shard_candidates(logits, statistics, chosen, requested, token_ids,
                                                         token_id_counts, shard.vocab_start, shard.vocab_size))
    ops.merge_vocabulary_logprobs(statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts,
                                  shard.vocab_size, shard.vocab_shard, k)


def score_hidden_rows_sharded(shard: VocabularyShard, hidden, targets, out, frame,
                              head: Callable[[torch.Tensor], torch.Tensor], row_block: int = SCORING_ROW_BLOCK) -> None:
    """``score_hidden_rows`` over a vocabulary shard: ``head`` gives ``[<=64, vocab_shard]`` local logits."""
    ops = torch.ops.ignition
    rows = hidden.shape[0]
    for start in range(0, rows, row_block):
        stop = min(start + row_block, rows)
        logits = head(hidden[start:stop])  # the only logit matrix: [<=64, vocab_shard]
        block_targets = targets[start:stop]
        statistics = shard.gather(ops.score_shard_statistics(logits, block_targets, shard.vocab_start, shard.vocab_size))
        candidates = shard.gather(ops.score_shard_candidates(logits, statistics, block_targets, shard.vocab_start,
                                                             shard.vocab_size))
        out_rows = frame * rows + torch.arange(start, stop, device=hidden.device)
        ops.merge_prompt_scores(statistics, candidates, block_targets, out, out_rows, shard.vocab_size,
                                shard.vocab_shard)
