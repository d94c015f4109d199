"""Prompt scoring on the GPU, vocabulary-sharded: seven prepared Triton launches per rank and row block.

Each rank holds the raw logits of its shard ``[rows, vocab_shard]`` for a block of at most
``SCORING_ROW_BLOCK`` prompt positions, and each row's target token. The launches implement the torch
reference stages of ``prompt_scoring.py`` word for word, split around the two all-gathers
(``catalog.parallel.SCORING_LAUNCHES`` lists them as data):

stage ``score_shard_statistics``
  1. ``tile_stats`` (row, tile): the generation plan's launch over the shard's lanes;
  2. ``statistics`` (row): exchange 1's words (shard maximum, mass, the target's raw logit where this rank
     owns it), each row's validity and tau, the 20th largest sub-block maximum;
     -> exchange 1 (all-gather)
stage ``score_shard_candidates``
  3. ``normalization`` (row): lse from every rank's words in rank order, the cutoff and the target's value;
  4. ``tile_candidates`` (row, tile): each tile's best NATURAL_K keys at or above the cutoff;
  5. ``tile_greater`` (row, tile): how many of the tile's lanes report a value strictly above the target's;
  6. ``candidates`` (row): exchange 2's words (the strictly-greater count, the best NATURAL_K pairs);
     -> exchange 2 (all-gather)
stage ``merge_prompt_scores``
  7. ``merge`` (row): the packed prompt row (``PROMPT_ROW_WIDTH`` words).

The helpers shared with generation's reduction (lse over the gathered words, the shard summary, the
best gathered keys, the tiling and the JIT launch loop) live in ``triton_vocabulary.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ignition.catalog.contract import NATURAL_K, PROMPT_ROW_WIDTH, SCORING_ROW_BLOCK, TILE_SORT_KEYS
from ignition.catalog.parallel import SCORING_EXCHANGE_WORDS, SCORING_LAUNCHES
from ignition.components.triton_logprobs import (_NAN_BITS, _NO_KEY, _POINTER_TYPES, LaunchSpec, _best_tile_keys,
                                                 _sort_keys, _value_bits, tile_candidates_kernel, tile_stats_kernel)
from ignition.components.triton_vocabulary import (_TYPES, _JitStages, _best_gathered, _global_lse, _normalize, _plan,
                                                   _raw_bits, _shard_summary, _shard_tiling)
from ignition.components.workspaces import ScoringWorkspace, scoring_arguments, stage_launches


# ---- prompt scoring: seven launches per rank and row block (catalog.parallel.SCORING_LAUNCHES) ----
# A row is scored when its target is a vocabulary id (0 <= target < vocab_size); every other row gets
# zero exchange words and the invalid pattern. tile_stats runs over every row (requested: the
# workspace's ones); launch 2 records each row's validity, which launches 3-7 read as their request flag.
@triton.jit(do_not_specialize=["logits_row_stride", "vocab_start", "shard_lanes", "global_vocab_size", "num_tiles"])
def score_statistics_kernel(
    stats_ptr,  # [rows, num_tiles, 2] fp32 from tile_stats
    maxima_ptr,  # [rows, num_tiles, SUB] fp32 from tile_stats
    logits_ptr,  # [rows, vocab_shard] fp32/bf16/fp16: this rank's shard
    targets_ptr,  # [rows] int32 global target ids
    valid_ptr,  # [rows] int32 (out): 1 where the target is a vocabulary id
    exchange_ptr,  # [rows, WORDS] int32: exchange 1 of this rank
    tau_ptr,  # [rows] fp32
    logits_row_stride,
    vocab_start,
    shard_lanes,
    global_vocab_size,
    num_tiles,
    TILES_BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    MAXIMA_BLOCK: tl.constexpr,
    SELECT: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 2: exchange 1's row: word 0 the shard maximum, word 1 the mass, word 2 the target's raw
    logit if this rank owns it (else 0), every other word 0; zero words for an invalid target."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.arange(0, WORDS)
    out = exchange_ptr + row * WORDS
    target = tl.load(targets_ptr + row)
    valid = (target >= 0) & (target < global_vocab_size)
    tl.store(valid_ptr + row, valid.to(tl.int32))
    if (target < 0) | (target >= global_vocab_size):
        tl.store(out + words, tl.zeros([WORDS], tl.int32))
        return
    max_bits, mass_bits, tau = _shard_summary(stats_ptr, maxima_ptr, row, num_tiles, TILES_BLOCK, SUB, MAXIMA_BLOCK,
                                              SELECT)
    local = target - vocab_start
    owned = (local >= 0) & (local < shard_lanes)
    raw = tl.load(logits_ptr + row * logits_row_stride + local, mask=owned, other=0.0).to(tl.float32)
    raw_bits = tl.where(owned, _raw_bits(raw), 0)
    tl.store(out + words, tl.where(words == 0, max_bits, tl.where(words == 1, mass_bits,
                                                                   tl.where(words == 2, raw_bits, 0))))
    tl.store(tau_ptr + row, tau)


@triton.jit(do_not_specialize=["rows", "vocab_shard"])
def score_normalization_kernel(
    statistics_ptr,  # [RANKS * rows, WORDS] int32: exchange 1, gathered in rank order
    targets_ptr,  # [rows] int32
    valid_ptr,  # [rows] int32
    tau_ptr,  # [rows] fp32
    lse_ptr,  # [rows] fp32
    cutoff_ptr,  # [rows] fp32
    value_ptr,  # [rows] fp32: the target's reported value, raw (from its owner's word 2) - lse
    rows,
    vocab_shard,
    RANKS: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 3: the generation path's normalization (same lse bits on every rank, the cutoff), plus the
    target's reported value."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(valid_ptr + row) == 0:
        return
    lse = _normalize(statistics_ptr, tau_ptr, lse_ptr, cutoff_ptr, row, rows, RANKS, WORDS)
    owner = (tl.load(targets_ptr + row) // vocab_shard).to(tl.int64)
    raw = tl.load(statistics_ptr + (owner * rows + row) * WORDS + 2).to(tl.float32, bitcast=True)
    tl.store(value_ptr + row, raw - lse)


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_tiles"])
def tile_greater_kernel(
    logits_ptr,  # [rows, vocab_shard] fp32/bf16/fp16
    valid_ptr,  # [rows] int32
    lse_ptr,  # [rows] fp32
    value_ptr,  # [rows] fp32
    greater_ptr,  # [rows, num_tiles] int32
    logits_row_stride,
    vocab_size,  # the shard's lanes below the vocabulary
    num_tiles,
    TILE: tl.constexpr,
):
    """Launch 5: how many of the tile's lanes report a value strictly above the target's (NaN: never)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    if tl.load(valid_ptr + row) == 0:
        return
    lanes = tile * TILE + tl.arange(0, TILE)
    in_vocab = lanes < vocab_size
    x = tl.load(logits_ptr + row * logits_row_stride + lanes, mask=in_vocab, other=0.0).to(tl.float32)
    above = in_vocab & ((x - tl.load(lse_ptr + row)) > tl.load(value_ptr + row))
    tl.store(greater_ptr + row * num_tiles + tile, tl.sum(above.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_start", "num_tiles"])
def score_candidates_kernel(
    logits_ptr,  # [rows, vocab_shard] fp32/bf16/fp16
    valid_ptr,  # [rows] int32
    lse_ptr,  # [rows] fp32
    keys_ptr,  # [rows, num_tiles, TILE_KEYS] int64 local keys from tile_candidates
    greater_ptr,  # [rows, num_tiles] int32 from tile_greater
    exchange_ptr,  # [rows, WORDS] int32: exchange 2 of this rank
    logits_row_stride,
    vocab_start,
    num_tiles,
    TILES_BLOCK: tl.constexpr,
    CANDIDATES_BLOCK: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIRS_BLOCK: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 6: exchange 2's row: word 0 the shard's strictly-greater count, words 1..2 * PAIRS the shard's
    best PAIRS (global id, value bits) by (value desc, id asc), (-1, NAN_BITS) past its lanes; other words 0."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.arange(0, WORDS)
    out = exchange_ptr + row * WORDS
    if tl.load(valid_ptr + row) == 0:
        tl.store(out + words, tl.zeros([WORDS], tl.int32))
        return
    tiles = tl.arange(0, TILES_BLOCK)
    greater = tl.sum(tl.load(greater_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=0), axis=0)
    best = _best_tile_keys(keys_ptr, row, num_tiles, CANDIDATES_BLOCK, TILE_KEYS, PAIRS, PAIRS_BLOCK)
    slots = tl.arange(0, PAIRS_BLOCK)
    found = best != _NO_KEY
    local = tl.where(found, -1 - best.to(tl.int32), 0)  # low word 0xFFFFFFFF - id, read as int32
    raw = tl.load(logits_ptr + row * logits_row_stride + local, mask=found, other=0.0).to(tl.float32)
    pairs = slots < PAIRS
    tl.store(out, greater)
    tl.store(out + 1 + 2 * slots, tl.where(found, local + vocab_start, -1), mask=pairs)
    tl.store(out + 2 + 2 * slots, _value_bits(raw - tl.load(lse_ptr + row), found), mask=pairs)
    tl.store(out + words, tl.zeros([WORDS], tl.int32), mask=words >= 1 + 2 * PAIRS)


@triton.jit(do_not_specialize=["rows", "vocab_size", "vocab_shard"])
def score_merge_kernel(
    statistics_ptr,  # [RANKS * rows, WORDS] int32: exchange 1, gathered
    candidates_ptr,  # [RANKS * rows, WORDS] int32: exchange 2, gathered
    targets_ptr,  # [rows] int32
    out_ptr,  # [out_rows_total, OUT_WIDTH] int32 prompt rows
    out_rows_ptr,  # [rows] int64
    rows,
    vocab_size,
    vocab_shard,
    RANKS: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIRS_BLOCK: tl.constexpr,
    CANDIDATES_BLOCK: tl.constexpr,
    OUT_WIDTH: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Launch 7: the prompt row: target, its value (raw from its owner - lse), rank (1 + the ranks' counts),
    then the best PAIRS of the RANKS * PAIRS gathered pairs by sort key; an invalid target: the invalid pattern."""
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + tl.load(out_rows_ptr + row) * OUT_WIDTH
    target = tl.load(targets_ptr + row)
    slots = tl.arange(0, PAIRS_BLOCK)
    pairs = slots < PAIRS
    if (target < 0) | (target >= vocab_size):
        tl.store(out_row, -1)
        tl.store(out_row + 1, _NAN_BITS)
        tl.store(out_row + 2, 0)
        tl.store(out_row + 3 + 2 * slots, tl.full([PAIRS_BLOCK], -1, tl.int32), mask=pairs)
        tl.store(out_row + 4 + 2 * slots, tl.full([PAIRS_BLOCK], _NAN_BITS, tl.int32), mask=pairs)
        return
    lse = _global_lse(statistics_ptr, row, rows, RANKS, WORDS)
    owner = (target // vocab_shard).to(tl.int64)
    raw = tl.load(statistics_ptr + (owner * rows + row) * WORDS + 2).to(tl.float32, bitcast=True)
    greater = tl.full([], 0, tl.int32)
    for r in tl.static_range(RANKS):
        greater += tl.load(candidates_ptr + (r * rows + row) * WORDS)
    candidates = tl.arange(0, CANDIDATES_BLOCK)
    live = candidates < RANKS * PAIRS
    words = candidates_ptr + ((candidates // PAIRS).to(tl.int64) * rows + row) * WORDS + 1 + 2 * (candidates % PAIRS)
    ids = tl.load(words, mask=live, other=-1)
    value_bits = tl.load(words + 1, mask=live, other=0)
    keys = tl.where(ids >= 0, _sort_keys(value_bits.to(tl.float32, bitcast=True), ids), _NO_KEY)
    best_ids, best_bits = _best_gathered(keys, value_bits, PAIRS, PAIRS_BLOCK, True)
    tl.store(out_row, target)
    tl.store(out_row + 1, _value_bits(raw - lse, target >= 0))
    tl.store(out_row + 2, greater + 1)
    tl.store(out_row + 3 + 2 * slots, best_ids, mask=pairs)
    tl.store(out_row + 4 + 2 * slots, best_bits, mask=pairs)


# ---- prompt scoring: the plan and the JIT path ----
_SCORING_KERNELS = {"tile_stats": tile_stats_kernel, "statistics": score_statistics_kernel,
                    "normalization": score_normalization_kernel, "tile_candidates": tile_candidates_kernel,
                    "tile_greater": tile_greater_kernel, "candidates": score_candidates_kernel,
                    "merge": score_merge_kernel}
_SCORING_TYPES = {"targets_ptr": "*i32", "valid_ptr": "*i32", "value_ptr": "*fp32", "greater_ptr": "*i32",
                  "global_vocab_size": "i32"}


def scoring_launch_plan(rows: int, vocab_shard: int, ranks: int, logits_dtype: torch.dtype) -> list[LaunchSpec]:
    """The seven scoring launches of one rank for one row block of ``rows`` (``catalog.parallel.SCORING_LAUNCHES``).

    As for generation, nothing depends on the rank, and the tiling is the generation plan's for the same
    (rows, vocab_shard); the cutoff and each tile keep NATURAL_K (20) candidates."""
    if not 1 <= rows <= SCORING_ROW_BLOCK or vocab_shard < 1 or ranks < 1 or logits_dtype not in _POINTER_TYPES:
        raise ValueError(f"scoring_launch_plan: need 1 <= rows <= {SCORING_ROW_BLOCK}, vocab_shard >= 1, ranks >= 1 "
                         f"and a dtype in {list(_POINTER_TYPES)}; got rows={rows}, vocab_shard={vocab_shard}, "
                         f"ranks={ranks}, dtype={logits_dtype}")
    types = dict(_TYPES, **_SCORING_TYPES, logits_ptr=_POINTER_TYPES[logits_dtype])
    tile, tiles, tile_warps, sub, maxima_block, keys_block = _shard_tiling(rows, vocab_shard)
    pairs_block = triton.next_power_of_2(NATURAL_K)
    gathered_block = triton.next_power_of_2(ranks * NATURAL_K)
    tiles_block = triton.next_power_of_2(tiles)
    constexprs = {
        "tile_stats": ({"TILE": tile, "SUB": sub}, tile_warps, (rows, tiles)),
        "statistics": ({"TILES_BLOCK": tiles_block, "SUB": sub, "MAXIMA_BLOCK": maxima_block, "SELECT": NATURAL_K,
                        "WORDS": SCORING_EXCHANGE_WORDS}, max(1, min(8, maxima_block // 1024)), (rows,)),
        "normalization": ({"RANKS": ranks, "WORDS": SCORING_EXCHANGE_WORDS}, 1, (rows,)),
        "tile_candidates": ({"TILE": tile, "TILE_KEYS": TILE_SORT_KEYS, "SELECT": NATURAL_K, "HAS_IDS": False},
                            tile_warps, (rows, tiles)),
        "tile_greater": ({"TILE": tile}, tile_warps, (rows, tiles)),
        "candidates": ({"TILES_BLOCK": tiles_block, "CANDIDATES_BLOCK": keys_block, "TILE_KEYS": TILE_SORT_KEYS,
                        "PAIRS": NATURAL_K, "PAIRS_BLOCK": pairs_block, "WORDS": SCORING_EXCHANGE_WORDS},
                       max(1, min(8, keys_block // 1024)), (rows,)),
        "merge": ({"RANKS": ranks, "PAIRS": NATURAL_K, "PAIRS_BLOCK": pairs_block, "CANDIDATES_BLOCK": gathered_block,
                   "OUT_WIDTH": PROMPT_ROW_WIDTH, "WORDS": SCORING_EXCHANGE_WORDS},
                  max(1, min(8, gathered_block // 1024)), (rows,)),
    }
    return _plan("score", SCORING_LAUNCHES, _SCORING_KERNELS, types, constexprs)


class TritonScoring(_JitStages):
    """The three scoring stage ops of one device through JIT-compiled launches (``IGNITION_TRITON_JIT=1``, tests)."""

    _workspace_class = ScoringWorkspace

    @staticmethod
    def _first_launch(rows: int, vocab_shard: int) -> LaunchSpec:
        return scoring_launch_plan(rows, vocab_shard, 1, torch.float32)[0]

    def statistics(self, logits, targets, vocab_start, vocab_size):
        rows, shard = logits.shape
        plan = scoring_launch_plan(rows, shard, 1, logits.dtype)
        exchange = torch.empty(rows, SCORING_EXCHANGE_WORDS, dtype=torch.int32, device=logits.device)
        args = scoring_arguments("statistics", self.workspace(rows, shard, logits.device), logits=logits,
                                 targets=targets, exchange=exchange, vocab_start=vocab_start, vocab_size=vocab_size,
                                 vocab_shard=shard)
        self._run(stage_launches(plan, "statistics", SCORING_LAUNCHES), args)
        return exchange

    def candidates(self, logits, statistics, targets, vocab_start, vocab_size):
        rows, shard = logits.shape
        plan = scoring_launch_plan(rows, shard, statistics.shape[0] // rows, logits.dtype)
        exchange = torch.empty(rows, SCORING_EXCHANGE_WORDS, dtype=torch.int32, device=logits.device)
        args = scoring_arguments("candidates", self.workspace(rows, shard, logits.device), logits=logits,
                                 targets=targets, exchange=exchange, statistics=statistics, vocab_start=vocab_start,
                                 vocab_size=vocab_size, vocab_shard=shard)
        self._run(stage_launches(plan, "candidates", SCORING_LAUNCHES), args)
        return exchange

    def merge(self, statistics, candidates, targets, out, out_rows, vocab_size, vocab_shard):
        rows = targets.shape[0]
        plan = scoring_launch_plan(rows, vocab_shard, statistics.shape[0] // rows, torch.float32)  # reads no logits
        args = scoring_arguments("merge", self.workspace(rows, vocab_shard, targets.device), targets=targets,
                                 statistics=statistics, candidates=candidates, out=out, out_rows=out_rows,
                                 vocab_size=vocab_size, vocab_shard=vocab_shard)
        self._run(stage_launches(plan, "merge", SCORING_LAUNCHES), args)
