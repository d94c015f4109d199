"""The vocabulary-sharded logprob reduction on the GPU: six prepared Triton launches per rank.

Each rank holds the raw logits of its shard ``[rows, vocab_shard]`` (global ids ``vocab_start + j``;
``shard_lanes`` of them lie below ``vocab_size``, 0 for a shard wholly in the padding). The launches
implement the three torch reference stages of ``vocabulary_logprobs.py`` word for word, split around
the two all-gathers (``catalog.parallel.VOCABULARY_LAUNCHES`` lists them as data):

stage ``vocab_shard_statistics``
  1. ``tile_stats`` (row, tile): the single-rank launch 1 over the shard's lanes;
  2. ``shard_statistics`` (row): the shard's FP32 maximum and exponential mass (exchange 1's words),
     and ``tau``, the 32nd largest sub-block maximum, kept in the rank's workspace;
     -> exchange 1 (all-gather)
stage ``vocab_shard_candidates``
  3. ``global_normalization`` (row): lse from every rank's (maximum, mass) in rank order, the same
     bits on every rank, and the cutoff ``fl(tau - lse)``;
  4. ``tile_candidates`` (row, tile): the single-rank launch 3 with SELECT = 32;
  5. ``shard_candidates`` (row): exchange 2's words: the chosen raw logit where this rank owns it,
     then either the shard's best 32 global sort keys and their reported values or the raw logits
     of the 128 selected ids this rank owns;
     -> exchange 2 (all-gather)
stage ``merge_vocabulary_logprobs``
  6. ``merge`` (row): lse again from the gathered statistics (launch 3's helper: the same bits),
     the chosen pair from its owner, then the best K gathered keys or each selected id's raw logit
     from its owner: the single-rank packed layout.

Launches 2 and 5 write every word of every row (unused words and unrequested rows: zero), so an
exchange is a pure function of the logits. Words are int32 bit patterns; NaN is stored as
``NAN_BITS`` and -0.0 as +0.0 wherever the reference does the same (vocabulary_logprobs.py).
The workspaces live across the three stage ops of one reduction (``VocabularyWorkspace``); the
ops run in stream order with the gathers between them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, TILE_SORT_KEYS, packed_width
from ignition.catalog.parallel import CANDIDATE_VALUES_WORD, EXCHANGE_WORDS, VOCABULARY_LAUNCHES
from ignition.components.triton_logprobs import (_INF, _NAN_BITS, _NO_KEY, _POINTER_TYPES, ENABLE_FP_FUSION,
                                                 SUB_BLOCKS, LaunchSpec, _best_tile_keys, _tiling, _value_bits,
                                                 tile_candidates_kernel, tile_stats_kernel)
from ignition.components.workspaces import VocabularyWorkspace, stage_arguments, stage_launches

_SHARD_KEYS = TILE_SORT_KEYS  # keys (and values) one shard contributes to exchange 2
_VALUES_WORD = tl.constexpr(CANDIDATE_VALUES_WORD)
# NOTE: the global lse uses CUDA's libdevice expf/logf, the functions torch's CUDA exp/log call, so the lse bits
# (and every exchange-2 value and merged value derived from them) match the reference stages on the GPU too;
# tl.exp/tl.log are approximations. Triton's interpreter has no libdevice: there numpy's exp/log stand in.
_LIBDEVICE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _exp(x):
    return libdevice.exp(x) if _LIBDEVICE else tl.exp(x)  # a constexpr condition: one branch is compiled


@triton.jit
def _log(x):
    return libdevice.log(x) if _LIBDEVICE else tl.log(x)


@triton.jit
def _raw_bits(raw):
    """FP32 bits of a raw logit as the exchange carries it: NaN as NAN_BITS, everything else unchanged."""
    return tl.where(raw != raw, _NAN_BITS, raw.to(tl.int32, bitcast=True))


@triton.jit
def _global_lse(statistics_ptr, row, rows, RANKS: tl.constexpr, WORDS: tl.constexpr):
    """lse of one row from every rank's (maximum, mass) words, summed in rank order (the reference's order).

    ``lse = M + log(sum_r mass_r * exp(max_r - M))``; an infinite M is the result, NaN propagates."""
    top = tl.full([], -float("inf"), tl.float32)
    any_nan = tl.full([], 0, tl.int1)
    for r in tl.static_range(RANKS):
        shard_max = tl.load(statistics_ptr + (r * rows + row) * WORDS).to(tl.float32, bitcast=True)
        any_nan = any_nan | (shard_max != shard_max)
        top = tl.maximum(top, shard_max)
    shift = tl.where(tl.abs(top) == _INF, 0.0, top)
    total = tl.full([], 0.0, tl.float32)
    for r in tl.static_range(RANKS):
        words = statistics_ptr + (r * rows + row) * WORDS
        shard_max = tl.load(words).to(tl.float32, bitcast=True)
        mass = tl.load(words + 1).to(tl.float32, bitcast=True)
        total = total + mass * _exp(shard_max - shift)
    lse = tl.where(tl.abs(top) == _INF, top, shift + _log(total))
    return tl.where(any_nan, float("nan"), lse)


@triton.jit
def _shard_summary(stats_ptr, maxima_ptr, row, num_tiles, TILES_BLOCK: tl.constexpr, SUB: tl.constexpr,
                   MAXIMA_BLOCK: tl.constexpr, SELECT: tl.constexpr):
    """One row's shard maximum and mass as exchange bits, and tau, the SELECT-th largest sub-block maximum.

    mass = ``sum_t s_t * exp(m_t - M)`` (reference: ``sum(exp(x - M))``); the maximum is NaN if any
    lane is NaN and travels -0.0 as +0.0; tau is -inf with fewer than SELECT finite maxima."""
    tiles = tl.arange(0, TILES_BLOCK)
    stats = stats_ptr + (row * num_tiles + tiles) * 2
    tile_max = tl.load(stats, mask=tiles < num_tiles, other=-_INF)
    tile_sum = tl.load(stats + 1, mask=tiles < num_tiles, other=0.0)
    shard_max = tl.max(tile_max, axis=0)
    safe_max = tl.where(tl.abs(shard_max) == _INF, 0.0, shard_max)
    mass = tl.sum(tile_sum * tl.exp(tile_max - safe_max), axis=0)  # NaN iff a lane is NaN
    shard_max = tl.where(mass != mass, float("nan"), shard_max + 0.0)  # + 0.0: -0.0 travels as +0.0
    max_bits = tl.where(shard_max != shard_max, _NAN_BITS, shard_max.to(tl.int32, bitcast=True))
    mass_bits = tl.where(mass != mass, _NAN_BITS, mass.to(tl.int32, bitcast=True))
    index = tl.arange(0, MAXIMA_BLOCK)
    maxima = tl.load(maxima_ptr + row * num_tiles * SUB + index, mask=index < num_tiles * SUB, other=-_INF)
    maxima = tl.where(maxima != maxima, -_INF, maxima)  # a NaN maximum bounds nothing
    tau = tl.full([], -float("inf"), tl.float32)
    remaining = tl.full([], SELECT, tl.int32)
    for i in range(SELECT):  # each step retires every copy of the largest value left
        top = tl.max(maxima, axis=0)
        tau = tl.where(remaining > 0, top, tau)
        remaining -= tl.sum((maxima == top).to(tl.int32), axis=0)
        maxima = tl.where(maxima == top, -_INF, maxima)
    return max_bits, mass_bits, tau


@triton.jit(do_not_specialize=["num_tiles"])
def shard_statistics_kernel(
    stats_ptr,  # [rows, num_tiles, 2] fp32 from tile_stats
    maxima_ptr,  # [rows, num_tiles, SUB] fp32 sub-block maxima from tile_stats
    requested_ptr,  # [rows] int32
    exchange_ptr,  # [rows, WORDS] int32: exchange 1 of this rank
    tau_ptr,  # [rows] fp32: the SELECT-th largest sub-block maximum (-inf: fewer finite maxima)
    num_tiles,
    TILES_BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    MAXIMA_BLOCK: tl.constexpr,
    SELECT: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 2: exchange 1's row: word 0 the shard maximum (NaN if any lane is NaN), word 1 the mass
    ``sum_t s_t * exp(m_t - M)`` (reference: ``sum(exp(x - M))``), every other word 0."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.arange(0, WORDS)
    out = exchange_ptr + row * WORDS
    if tl.load(requested_ptr + row) == 0:
        tl.store(out + words, tl.zeros([WORDS], tl.int32))
        return
    max_bits, mass_bits, tau = _shard_summary(stats_ptr, maxima_ptr, row, num_tiles, TILES_BLOCK, SUB, MAXIMA_BLOCK,
                                              SELECT)
    row_words = tl.where(words == 0, max_bits, tl.where(words == 1, mass_bits, 0))
    tl.store(out + words, row_words)
    tl.store(tau_ptr + row, tau)


@triton.jit
def _normalize(statistics_ptr, tau_ptr, lse_ptr, cutoff_ptr, row, rows, RANKS: tl.constexpr, WORDS: tl.constexpr):
    """Stores (and returns) the row's global lse and this shard's cutoff ``fl(tau - lse)`` (-inf: no cutoff)."""
    lse = _global_lse(statistics_ptr, row, rows, RANKS, WORDS)
    tl.store(lse_ptr + row, lse)
    tau = tl.load(tau_ptr + row)
    cutoff = tau - lse  # NaN (tau or lse infinite) or -inf: no cutoff
    tl.store(cutoff_ptr + row, tl.where((tau > -_INF) & (cutoff == cutoff), cutoff, -_INF))
    return lse


@triton.jit(do_not_specialize=["rows"])
def global_normalization_kernel(
    statistics_ptr,  # [RANKS * rows, WORDS] int32: exchange 1, gathered in rank order
    requested_ptr,  # [rows] int32
    tau_ptr,  # [rows] fp32 from shard_statistics
    lse_ptr,  # [rows] fp32
    cutoff_ptr,  # [rows] fp32: the shard's best keys have reported values >= cutoff (-inf: no cutoff)
    rows,
    RANKS: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 3: the global lse (identical bits on every rank) and this shard's cutoff ``fl(tau - lse)``."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    _normalize(statistics_ptr, tau_ptr, lse_ptr, cutoff_ptr, row, rows, RANKS, WORDS)


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_start", "shard_lanes", "num_tiles"])
def shard_candidates_kernel(
    logits_ptr,  # [rows, vocab_shard] fp32/bf16/fp16: this rank's shard
    chosen_ptr,  # [rows] int64 global ids
    requested_ptr,  # [rows] int32
    token_ids_ptr,  # [rows, MAX_IDS] int32 global ids (read only when HAS_IDS)
    counts_ptr,  # [rows] int32 (read only when HAS_IDS)
    lse_ptr,  # [rows] fp32
    keys_ptr,  # [rows, num_tiles, TILE_KEYS] int64 local keys from tile_candidates
    exchange_ptr,  # [rows, WORDS] int32: exchange 2 of this rank
    logits_row_stride,
    vocab_start,
    shard_lanes,
    num_tiles,
    CANDIDATES_BLOCK: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    SHARD_KEYS: tl.constexpr,
    MAX_IDS: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    """Launch 5: exchange 2's row. Word 0: the chosen raw logit if this rank owns it (else 0). A row
    without selected ids: words 1.. the shard's best SHARD_KEYS global keys (int64, low word first),
    then their reported values (NAN_BITS past the shard's lanes); a row with selected ids: words
    1..MAX_IDS the raw logit of each selected id this rank owns (else 0). Every other word 0."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.arange(0, WORDS)
    out = exchange_ptr + row * WORDS
    if tl.load(requested_ptr + row) == 0:
        tl.store(out + words, tl.zeros([WORDS], tl.int32))
        return
    row_logits = logits_ptr + row * logits_row_stride
    lse = tl.load(lse_ptr + row)
    chosen = tl.load(chosen_ptr + row) - vocab_start
    chosen_owned = (chosen >= 0) & (chosen < shard_lanes)
    chosen_raw = tl.load(row_logits + chosen, mask=chosen_owned, other=0.0).to(tl.float32)
    tl.store(out, tl.where(chosen_owned, _raw_bits(chosen_raw), 0))
    count = 0
    if HAS_IDS:
        count = tl.load(counts_ptr + row)
    if count != 0:
        positions = tl.arange(0, MAX_IDS)
        selected = tl.load(token_ids_ptr + row * MAX_IDS + positions) - vocab_start  # all MAX_IDS, as the reference
        owned = (selected >= 0) & (selected < shard_lanes)
        selected_raw = tl.load(row_logits + selected, mask=owned, other=0.0).to(tl.float32)
        tl.store(out + 1 + positions, tl.where(owned, _raw_bits(selected_raw), 0))
        tl.store(out + words, tl.zeros([WORDS], tl.int32), mask=words >= 1 + MAX_IDS)
    else:
        best = _best_tile_keys(keys_ptr, row, num_tiles, CANDIDATES_BLOCK, TILE_KEYS, SHARD_KEYS, SHARD_KEYS)
        slots = tl.arange(0, SHARD_KEYS)
        found = best != _NO_KEY
        local = tl.where(found, -1 - best.to(tl.int32), 0)  # low word 0xFFFFFFFF - id, read as int32
        best_raw = tl.load(row_logits + local, mask=found, other=0.0).to(tl.float32)
        global_keys = tl.where(found, best - vocab_start, _NO_KEY)  # the id lives in the low word
        tl.store(out + 1 + 2 * slots, (global_keys & 0xFFFFFFFF).to(tl.int32))
        tl.store(out + 2 + 2 * slots, (global_keys >> 32).to(tl.int32))
        tl.store(out + _VALUES_WORD + slots, _value_bits(best_raw - lse, found))
        tl.store(out + words, tl.zeros([WORDS], tl.int32), mask=words >= _VALUES_WORD + SHARD_KEYS)


@triton.jit
def _best_gathered(keys, value_bits, COUNT: tl.constexpr, BLOCK: tl.constexpr, REENCODE: tl.constexpr):
    """The best COUNT of the gathered keys (unique: they hold the global id, so one per step), largest first, in
    [BLOCK] vectors: their ids (``-1 - low word``) and value bits (REENCODE: through _value_bits), -1 and NAN_BITS
    in every other slot."""
    slots = tl.arange(0, BLOCK)
    best_ids = tl.full([BLOCK], -1, tl.int32)
    best_bits = tl.full([BLOCK], _NAN_BITS, tl.int32)
    for i in range(COUNT):
        top = tl.max(keys, axis=0)
        hit = keys == top
        bits = tl.sum(tl.where(hit, value_bits, 0), axis=0)
        found = top != _NO_KEY
        if REENCODE:
            bits = _value_bits(bits.to(tl.float32, bitcast=True), found)
        best_ids = tl.where((slots == i) & found, -1 - top.to(tl.int32), best_ids)
        best_bits = tl.where((slots == i) & found, bits, best_bits)
        keys = tl.where(hit, _NO_KEY, keys)
    return best_ids, best_bits


@triton.jit(do_not_specialize=["rows", "vocab_size", "vocab_shard"])
def merge_shards_kernel(
    statistics_ptr,  # [RANKS * rows, WORDS] int32: exchange 1, gathered
    candidates_ptr,  # [RANKS * rows, WORDS] int32: exchange 2, gathered
    chosen_ptr,  # [rows] int64
    requested_ptr,  # [rows] int32
    token_ids_ptr,  # [rows, MAX_IDS] int32 (read only when HAS_IDS)
    counts_ptr,  # [rows] int32 (read only when HAS_IDS)
    out_ptr,  # [out_rows_total, OUT_WIDTH] int32 packed pairs
    out_rows_ptr,  # [rows] int64
    rows,
    vocab_size,
    vocab_shard,
    RANKS: tl.constexpr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    CANDIDATES_BLOCK: tl.constexpr,
    SHARD_KEYS: tl.constexpr,
    MAX_IDS: tl.constexpr,
    OUT_WIDTH: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    """Launch 6: the chosen pair from its owner's raw logit, then the best K of the RANKS * SHARD_KEYS
    gathered keys (values as gathered) or each selected id's raw logit from its owner, minus lse."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    lse = _global_lse(statistics_ptr, row, rows, RANKS, WORDS)
    out_row = out_ptr + tl.load(out_rows_ptr + row) * OUT_WIDTH
    chosen = tl.load(chosen_ptr + row)
    chosen_valid = (chosen >= 0) & (chosen < vocab_size)
    owner = tl.where(chosen_valid, chosen // vocab_shard, 0)
    chosen_raw = tl.load(candidates_ptr + (owner * rows + row) * WORDS).to(tl.float32, bitcast=True)
    tl.store(out_row, chosen.to(tl.int32))
    tl.store(out_row + 1, _value_bits(chosen_raw - lse, chosen_valid))
    count = 0
    if HAS_IDS:
        count = tl.minimum(tl.maximum(tl.load(counts_ptr + row), 0), MAX_IDS)
    if count != 0:
        positions = tl.arange(0, MAX_IDS)
        active = positions < count
        selected = tl.load(token_ids_ptr + row * MAX_IDS + positions, mask=active, other=0)
        valid = active & (selected >= 0) & (selected < vocab_size)
        owners = tl.where(valid, selected // vocab_shard, 0).to(tl.int64)
        raw = tl.load(candidates_ptr + (owners * rows + row) * WORDS + 1 + positions, mask=valid,
                      other=0).to(tl.float32, bitcast=True)
        tl.store(out_row + 2 + 2 * positions, selected, mask=active)
        tl.store(out_row + 3 + 2 * positions, _value_bits(raw - lse, valid), mask=active)
    elif K > 0:
        candidates = tl.arange(0, CANDIDATES_BLOCK)
        live = candidates < RANKS * SHARD_KEYS
        rank = (candidates // SHARD_KEYS).to(tl.int64)
        slot = candidates % SHARD_KEYS
        words = candidates_ptr + (rank * rows + row) * WORDS
        low = tl.load(words + 1 + 2 * slot, mask=live, other=0)
        high = tl.load(words + 2 + 2 * slot, mask=live, other=0)
        value_bits = tl.load(words + _VALUES_WORD + slot, mask=live, other=0)
        keys = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
        keys = tl.where(live, keys, _NO_KEY)
        slots = tl.arange(0, K_BLOCK)
        best_ids, best_bits = _best_gathered(keys, value_bits, K, K_BLOCK, False)
        tl.store(out_row + 2 + 2 * slots, best_ids, mask=slots < K)
        tl.store(out_row + 3 + 2 * slots, best_bits, mask=slots < K)


# ---- the launch plan: fixed heuristics shared by the JIT path and ahead-of-time preparation ----
_TYPES = {"logits_ptr": None, "chosen_ptr": "*i64", "requested_ptr": "*i32", "counts_ptr": "*i32",
          "token_ids_ptr": "*i32", "stats_ptr": "*fp32", "maxima_ptr": "*fp32", "tau_ptr": "*fp32",
          "lse_ptr": "*fp32", "cutoff_ptr": "*fp32", "keys_ptr": "*i64", "exchange_ptr": "*i32",
          "statistics_ptr": "*i32", "candidates_ptr": "*i32", "out_ptr": "*i32", "out_rows_ptr": "*i64",
          "logits_row_stride": "i32", "vocab_size": "i32", "num_tiles": "i32", "rows": "i32", "vocab_start": "i32",
          "shard_lanes": "i32", "vocab_shard": "i32"}


def _shard_tiling(rows: int, vocab_shard: int) -> tuple[int, int, int, int, int, int]:
    """Both sharded plans' tiling of a shard: tile, tiles, the tile launches' warps, SUB, MAXIMA_BLOCK and the
    block of every tile's sort keys (the generation plan's for the same rows and vocab_shard)."""
    tile, tiles = _tiling(rows, vocab_shard)
    sub = min(SUB_BLOCKS, tile)
    return (tile, tiles, max(1, min(8, tile // 256)), sub, triton.next_power_of_2(tiles * sub),
            triton.next_power_of_2(tiles * TILE_SORT_KEYS))


def _plan(prefix: str, launches, kernels: dict, types: dict, constexprs: dict) -> list[LaunchSpec]:
    """One LaunchSpec per catalog launch, in catalog order: ``constexprs[name]`` is (values, warps, grid); every
    kernel parameter is typed from ``types`` or else a constexpr."""
    plan = []
    for launch in launches:
        kernel = kernels[launch.name]
        values, warps, grid = constexprs[launch.name]
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        plan.append(LaunchSpec(f"{prefix}.{launch.name}", kernel, signature, values, warps, 1, grid))
    return plan


_KERNELS = {"tile_stats": tile_stats_kernel, "shard_statistics": shard_statistics_kernel,
            "global_normalization": global_normalization_kernel, "tile_candidates": tile_candidates_kernel,
            "shard_candidates": shard_candidates_kernel, "merge": merge_shards_kernel}


def vocabulary_launch_plan(rows: int, vocab_shard: int, ranks: int, k: int, explicit_ids: bool,
                           logits_dtype: torch.dtype) -> list[LaunchSpec]:
    """The six launches of one rank for one shape, in order (``catalog.parallel.VOCABULARY_LAUNCHES``).

    Nothing depends on the rank: tiles cover ``vocab_shard`` lanes and the shard's position
    (``vocab_start``, ``shard_lanes``) is a runtime argument, so every rank shares one binary."""
    if rows < 1 or vocab_shard < 1 or ranks < 1 or not 0 <= k <= NATURAL_K or logits_dtype not in _POINTER_TYPES:
        raise ValueError(f"vocabulary_launch_plan: need rows >= 1, vocab_shard >= 1, ranks >= 1, 0 <= k <= "
                         f"{NATURAL_K} and a dtype in {list(_POINTER_TYPES)}; got rows={rows}, "
                         f"vocab_shard={vocab_shard}, ranks={ranks}, k={k}, dtype={logits_dtype}")
    tile, tiles, tile_warps, sub, maxima_block, tile_keys_block = _shard_tiling(rows, vocab_shard)
    gathered_block = triton.next_power_of_2(ranks * _SHARD_KEYS)
    constexprs = {
        "tile_stats": ({"TILE": tile, "SUB": sub}, tile_warps, (rows, tiles)),
        "shard_statistics": ({"TILES_BLOCK": triton.next_power_of_2(tiles), "SUB": sub, "MAXIMA_BLOCK": maxima_block,
                              "SELECT": _SHARD_KEYS, "WORDS": EXCHANGE_WORDS},
                             max(1, min(8, maxima_block // 1024)), (rows,)),
        "global_normalization": ({"RANKS": ranks, "WORDS": EXCHANGE_WORDS}, 1, (rows,)),
        "tile_candidates": ({"TILE": tile, "TILE_KEYS": TILE_SORT_KEYS, "SELECT": _SHARD_KEYS,
                             "HAS_IDS": explicit_ids}, tile_warps, (rows, tiles)),
        "shard_candidates": ({"CANDIDATES_BLOCK": tile_keys_block, "TILE_KEYS": TILE_SORT_KEYS,
                              "SHARD_KEYS": _SHARD_KEYS, "MAX_IDS": MAX_SELECTED_IDS, "WORDS": EXCHANGE_WORDS,
                              "HAS_IDS": explicit_ids}, max(1, min(8, tile_keys_block // 1024)), (rows,)),
        "merge": ({"RANKS": ranks, "K": k, "K_BLOCK": triton.next_power_of_2(max(k, 1)),
                   "CANDIDATES_BLOCK": gathered_block, "SHARD_KEYS": _SHARD_KEYS, "MAX_IDS": MAX_SELECTED_IDS,
                   "OUT_WIDTH": packed_width(k, explicit_ids), "WORDS": EXCHANGE_WORDS, "HAS_IDS": explicit_ids},
                  max(1, min(8, gathered_block // 1024)), (rows,)),
    }
    return _plan("vocab", VOCABULARY_LAUNCHES, _KERNELS, dict(_TYPES, logits_ptr=_POINTER_TYPES[logits_dtype]),
                 constexprs)


# ---- the JIT path (development and tests): the same launches, compiled by Triton on first use ----
class _JitStages:
    """What both JIT stage-op classes (this one's and triton_scoring.py's) share: one workspace per (rows, vocab_shard, device), sized by the tiling
    (``_first_launch``: the plan's tile_stats), and the launch loop."""

    _workspace_class: type

    def __init__(self):
        self.workspaces: dict[tuple, object] = {}

    @staticmethod
    def _first_launch(rows: int, vocab_shard: int) -> LaunchSpec:
        raise NotImplementedError

    def workspace(self, rows: int, vocab_shard: int, device):
        key = (rows, vocab_shard, torch.device(device))
        if key not in self.workspaces:
            first = self._first_launch(rows, vocab_shard)
            self.workspaces[key] = self._workspace_class.allocate(rows, first.grid[1], first.constexprs["SUB"], device)
        return self.workspaces[key]

    @staticmethod
    def _run(specs, args):
        for spec in specs:
            runtime_args = {name: args[name] for name, kind in spec.signature.items() if kind != "constexpr"}
            spec.kernel[spec.grid](**runtime_args, **spec.constexprs, num_warps=spec.num_warps,
                                   num_stages=spec.num_stages, enable_fp_fusion=ENABLE_FP_FUSION)


class TritonVocabulary(_JitStages):
    """The three stage ops of one device through JIT-compiled launches (``IGNITION_TRITON_JIT=1``, tests).

    Stage 1 fills a workspace per (rows, vocab_shard, device) that stage 2 of the same reduction reads."""

    _workspace_class = VocabularyWorkspace

    @staticmethod
    def _first_launch(rows: int, vocab_shard: int) -> LaunchSpec:
        return vocabulary_launch_plan(rows, vocab_shard, 1, 0, False, torch.float32)[0]

    def statistics(self, logits, requested, vocab_start, vocab_size):
        rows, shard = logits.shape
        plan = vocabulary_launch_plan(rows, shard, 1, 0, False, logits.dtype)
        exchange = torch.empty(rows, EXCHANGE_WORDS, dtype=torch.float32, device=logits.device)
        args = stage_arguments("statistics", self.workspace(rows, shard, logits.device), logits=logits,
                               requested=requested, exchange=exchange, vocab_start=vocab_start, vocab_size=vocab_size,
                               vocab_shard=shard)
        self._run(stage_launches(plan, "statistics"), args)
        return exchange

    def candidates(self, logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size):
        rows, shard = logits.shape
        plan = vocabulary_launch_plan(rows, shard, statistics.shape[0] // rows, 0, token_ids is not None, logits.dtype)
        exchange = torch.empty(rows, EXCHANGE_WORDS, dtype=torch.float32, device=logits.device)
        args = stage_arguments("candidates", self.workspace(rows, shard, logits.device), logits=logits, chosen=chosen,
                               requested=requested, token_ids=token_ids, token_id_counts=token_id_counts,
                               exchange=exchange, statistics=statistics, vocab_start=vocab_start,
                               vocab_size=vocab_size, vocab_shard=shard)
        self._run(stage_launches(plan, "candidates"), args)
        return exchange

    def merge(self, statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size,
              vocab_shard, k):
        rows = chosen.shape[0]
        plan = vocabulary_launch_plan(rows, vocab_shard, statistics.shape[0] // rows, k, token_ids is not None,
                                      torch.float32)  # the merge reads no logits: its binary is dtype-free
        args = stage_arguments("merge", self.workspace(rows, vocab_shard, chosen.device), chosen=chosen,
                               requested=requested, token_ids=token_ids, token_id_counts=token_id_counts,
                               statistics=statistics, candidates=candidates, out=out, out_rows=out_rows,
                               vocab_size=vocab_size, vocab_shard=vocab_shard)
        self._run(stage_launches(plan, "merge"), args)
