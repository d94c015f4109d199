"""Generation logprob reduction on the GPU: four prepared Triton launches.

1. ``tile_stats`` (row, vocabulary tile): FP32 tile maximum and ``sum(exp(x - max))``, plus
   the maxima of the tile's ``SUB`` sub-blocks.
2. ``row_normalization`` (row): combines the tile statistics into ``lse``, and the sub-block
   maxima into a cutoff: with ``tau`` the K-th largest sub-block maximum (counting equal
   values), at least K lanes have ``x >= tau``, so every natural alternative has a reported
   value ``>= fl(tau - lse)`` (subtracting the same ``lse`` is monotone, ties included).
3. ``tile_candidates`` (row, tile): the tile's best sort keys of the reported values
   ``x - lse`` (the same int64 keys as ``logprobs.sort_keys``), looking only at lanes at or
   above the cutoff: one read of the tile, and as many selection steps as lanes pass (a
   handful), not K. A cutoff of -inf or NaN (fewer than K finite maxima, infinite logits)
   selects from every lane, exactly as before.
4. ``merge`` (row): the chosen pair plus either the K best candidates or, for a row with
   selected ids, each id's raw logit minus ``lse``.

Workspaces between launches are explicit tensors, so the vocabulary-parallel variant is a
composition (all-gather the stats after launch 1, the candidates after launch 3):

* ``stats``: fp32 ``[rows, tiles, 2]`` (tile max, exp-sum relative to that max)
* ``maxima``: fp32 ``[rows, tiles, SUB]`` sub-block maxima
* ``lse``, ``cutoff``: fp32 ``[rows]``
* ``keys``: int64 ``[rows, tiles, TILE_KEYS]``, each tile's best ``min(k, 32)`` keys in
  descending order, remaining slots ``NO_KEY``.

No ``[rows, vocabulary]`` FP32 tensor exists. A zero request flag returns before any
vocabulary read or write. The pure-torch reference in ``logprobs.py`` defines the semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ignition.catalog.contract import MAX_SELECTED_IDS, NAN_BITS, NATURAL_K, TILE_SORT_KEYS, packed_width
from ignition.components.logprobs import check_reduction_args
from ignition.components.workspaces import ReductionWorkspace, reduction_arguments

TILE_KEYS = TILE_SORT_KEYS  # keys a tile retains: the width of the sharded candidate exchange
_NO_KEY = tl.constexpr(-(2**63))  # below every real key (NaN ranks as -inf, whose key is larger)
_NAN_BITS = tl.constexpr(NAN_BITS)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _sort_keys(values, token_ids):
    """int64 keys, descending = (value desc, id asc); -0.0 == +0.0, NaN ranks as -inf."""
    values = tl.where(values != values, -_INF, values)
    bits = tl.where(values == 0.0, 0, values.to(tl.int32, bitcast=True))
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving image, minus 2**31
    return ((ordered.to(tl.int64) + 1) << 32) - 1 - token_ids.to(tl.int64)  # low word: 0xFFFFFFFF - id


@triton.jit
def _value_bits(values, valid):
    """FP32 bits of reported values: -0.0 stored as +0.0, NaN or invalid as NAN_BITS."""
    bits = tl.where(values == 0.0, 0, values.to(tl.int32, bitcast=True))
    return tl.where(valid & (values == values), bits, _NAN_BITS)


@triton.jit
def _best_tile_keys(keys_ptr, row, num_tiles, CANDIDATES_BLOCK: tl.constexpr, TILE_KEYS: tl.constexpr,
                    COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """The row's best COUNT of its tiles' sort keys (from tile_candidates), largest first, in slots 0..COUNT-1
    of a [BLOCK] vector; _NO_KEY in every other slot and where fewer keys exist."""
    candidates = tl.arange(0, CANDIDATES_BLOCK)
    keys = tl.load(keys_ptr + row * num_tiles * TILE_KEYS + candidates,
                   mask=candidates < num_tiles * TILE_KEYS, other=_NO_KEY)
    slots = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], _NO_KEY, tl.int64)
    for i in range(COUNT):
        top = tl.max(keys, axis=0)
        best = tl.where(slots == i, top, best)
        keys = tl.where(keys == top, _NO_KEY, keys)
    return best


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_tiles"])
def tile_stats_kernel(
    logits_ptr,  # [rows, vocab_padded] fp32/bf16/fp16, unit stride along the vocabulary
    requested_ptr,  # [rows] int32
    stats_ptr,  # [rows, num_tiles, 2] fp32: tile max, sum(exp(x - tile max))
    maxima_ptr,  # [rows, num_tiles, SUB] fp32: maxima of the tile's SUB sub-blocks
    logits_row_stride,
    vocab_size,
    num_tiles,
    TILE: tl.constexpr,
    SUB: tl.constexpr,
):
    """Launch 1: FP32 maximum and exponential mass of one vocabulary tile of one row, and its sub-block maxima."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    lanes = tile * TILE + tl.arange(0, TILE)
    x = tl.load(logits_ptr + row * logits_row_stride + lanes, mask=lanes < vocab_size, other=-_INF).to(tl.float32)
    tile_max = tl.max(x, axis=0)  # ignores NaN; a NaN lane makes the sum NaN instead
    safe_max = tl.where(tl.abs(tile_max) == _INF, 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(x - safe_max), axis=0)
    stats = stats_ptr + (row * num_tiles + tile) * 2
    tl.store(stats, tile_max)
    tl.store(stats + 1, tile_sum)
    sub_max = tl.max(tl.reshape(x, (SUB, TILE // SUB)), axis=1)  # [SUB]: padded lanes are -inf
    tl.store(maxima_ptr + (row * num_tiles + tile) * SUB + tl.arange(0, SUB), sub_max)


@triton.jit(do_not_specialize=["num_tiles"])
def row_normalization_kernel(
    stats_ptr,  # [rows, num_tiles, 2] fp32
    maxima_ptr,  # [rows, num_tiles, SUB] fp32
    requested_ptr,  # [rows] int32
    lse_ptr,  # [rows] fp32
    cutoff_ptr,  # [rows] fp32: natural alternatives have reported values >= cutoff (-inf: no cutoff)
    num_tiles,
    TILES_BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    MAXIMA_BLOCK: tl.constexpr,
    K: tl.constexpr,
):
    """Launch 2: lse = M + log(sum_t s_t * exp(m_t - M)); +-inf M is lse, any NaN logit is NaN.
    cutoff = fl(tau - lse), tau the K-th largest sub-block maximum counted with multiplicity."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    tiles = tl.arange(0, TILES_BLOCK)
    stats = stats_ptr + (row * num_tiles + tiles) * 2
    tile_max = tl.load(stats, mask=tiles < num_tiles, other=-_INF)
    tile_sum = tl.load(stats + 1, mask=tiles < num_tiles, other=0.0)
    row_max = tl.max(tile_max, axis=0)
    safe_max = tl.where(tl.abs(row_max) == _INF, 0.0, row_max)
    total = tl.sum(tile_sum * tl.exp(tile_max - safe_max), axis=0)
    lse = tl.where(tl.abs(row_max) == _INF, row_max, safe_max + tl.log(total))
    lse = tl.where(total != total, total, lse)
    tl.store(lse_ptr + row, lse)
    tau = tl.full([], -float("inf"), tl.float32)
    if K > 0:
        index = tl.arange(0, MAXIMA_BLOCK)
        maxima = tl.load(maxima_ptr + row * num_tiles * SUB + index, mask=index < num_tiles * SUB, other=-_INF)
        maxima = tl.where(maxima != maxima, -_INF, maxima)  # a NaN maximum bounds nothing
        remaining = tl.full([], K, tl.int32)
        for i in range(K):  # each step retires every copy of the largest value left
            top = tl.max(maxima, axis=0)
            tau = tl.where(remaining > 0, top, tau)
            remaining -= tl.sum((maxima == top).to(tl.int32), axis=0)
            maxima = tl.where(maxima == top, -_INF, maxima)
    cutoff = tau - lse  # NaN (tau or lse infinite) or -inf: no cutoff
    tl.store(cutoff_ptr + row, tl.where((tau > -_INF) & (cutoff == cutoff), cutoff, -_INF))


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_tiles"])
def tile_candidates_kernel(
    logits_ptr,  # [rows, vocab_padded] fp32/bf16/fp16
    requested_ptr,  # [rows] int32
    counts_ptr,  # [rows] int32 selected-id counts (read only when HAS_IDS)
    lse_ptr,  # [rows] fp32
    cutoff_ptr,  # [rows] fp32
    keys_ptr,  # [rows, num_tiles, TILE_KEYS] int64
    logits_row_stride,
    vocab_size,
    num_tiles,
    TILE: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    SELECT: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    """Launch 3: the tile's best SELECT keys of x - lse among lanes at or above the row's cutoff,
    by repeated maximum over the lanes that pass (keys are unique)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    if HAS_IDS:
        if tl.load(counts_ptr + row) != 0:  # selected ids replace the natural alternatives
            return
    slots = tl.arange(0, TILE_KEYS)
    best = tl.full([TILE_KEYS], _NO_KEY, tl.int64)
    if SELECT > 0:
        lanes = tile * TILE + tl.arange(0, TILE)
        in_vocab = lanes < vocab_size
        x = tl.load(logits_ptr + row * logits_row_stride + lanes, mask=in_vocab, other=0.0).to(tl.float32)
        reported = x - tl.load(lse_ptr + row)
        cutoff = tl.load(cutoff_ptr + row)
        ranked = tl.where(reported != reported, -_INF, reported)  # NaN ranks as -inf: it passes only a -inf cutoff
        passes = in_vocab & (ranked >= cutoff)
        keys = tl.where(passes, _sort_keys(reported, lanes), _NO_KEY)
        steps = tl.minimum(tl.sum(passes.to(tl.int32), axis=0), SELECT)
        for i in range(steps):
            top = tl.max(keys, axis=0)
            best = tl.where(slots == i, top, best)
            keys = tl.where(keys == top, _NO_KEY, keys)
    tl.store(keys_ptr + (row * num_tiles + tile) * TILE_KEYS + slots, best)


@triton.jit(do_not_specialize=["logits_row_stride", "vocab_size", "num_tiles"])
def merge_kernel(
    logits_ptr,  # [rows, vocab_padded] fp32/bf16/fp16
    chosen_ptr,  # [rows] int64
    requested_ptr,  # [rows] int32
    token_ids_ptr,  # [rows, MAX_IDS] int32 (read only when HAS_IDS)
    counts_ptr,  # [rows] int32 (read only when HAS_IDS)
    lse_ptr,  # [rows] fp32
    keys_ptr,  # [rows, num_tiles, TILE_KEYS] int64
    out_ptr,  # [out_rows_total, OUT_WIDTH] int32 packed pairs
    out_rows_ptr,  # [rows] int64 row of out written by each row
    logits_row_stride,
    vocab_size,
    num_tiles,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    CANDIDATES_BLOCK: tl.constexpr,
    TILE_KEYS: tl.constexpr,
    MAX_IDS: tl.constexpr,
    OUT_WIDTH: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    """Launch 4: chosen pair, then K natural pairs from the tile keys or the selected ids."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    lse = tl.load(lse_ptr + row)
    row_logits = logits_ptr + row * logits_row_stride
    out_row = out_ptr + tl.load(out_rows_ptr + row) * OUT_WIDTH
    chosen = tl.load(chosen_ptr + row)
    chosen_in_vocab = (chosen >= 0) & (chosen < vocab_size)
    chosen_raw = tl.load(row_logits + chosen, mask=chosen_in_vocab, other=0.0).to(tl.float32)
    tl.store(out_row, chosen.to(tl.int32))
    tl.store(out_row + 1, _value_bits(chosen_raw - lse, chosen_in_vocab))
    count = 0
    if HAS_IDS:
        count = tl.load(counts_ptr + row)
    if count != 0:
        positions = tl.arange(0, MAX_IDS)
        active = positions < count
        selected = tl.load(token_ids_ptr + row * MAX_IDS + positions, mask=active, other=0)
        in_vocab = active & (selected >= 0) & (selected < vocab_size)
        selected_raw = tl.load(row_logits + selected, mask=in_vocab, other=0.0).to(tl.float32)
        tl.store(out_row + 2 + 2 * positions, selected, mask=active)
        tl.store(out_row + 3 + 2 * positions, _value_bits(selected_raw - lse, in_vocab), mask=active)
    elif K > 0:
        best = _best_tile_keys(keys_ptr, row, num_tiles, CANDIDATES_BLOCK, TILE_KEYS, K, K_BLOCK)
        slots = tl.arange(0, K_BLOCK)
        found = best != _NO_KEY
        ids = tl.where(found, -1 - best.to(tl.int32), -1)  # low word 0xFFFFFFFF - id, read as int32
        raw = tl.load(row_logits + ids, mask=found, other=0.0).to(tl.float32)
        tl.store(out_row + 2 + 2 * slots, ids, mask=slots < K)
        tl.store(out_row + 3 + 2 * slots, _value_bits(raw - lse, found), mask=slots < K)


def launch_reduction(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    """Allocate the workspace and run the four launches (JIT-compiled); returns the workspace."""
    device = logits.device
    tensors = {"chosen": chosen, "requested": requested, "out": out, "out_rows": out_rows, "token_ids": token_ids,
               "token_id_counts": token_id_counts}
    misplaced = [name for name, t in tensors.items() if t is not None and t.device != device]
    if misplaced or logits.stride(-1) != 1:
        raise ValueError(f"reduce_logprobs_triton: logits must have unit vocabulary stride (stride {logits.stride()}) "
                         f"and every tensor must be on {device} (not: {misplaced})")
    rows = logits.shape[0]
    plan = launch_plan(rows, logits.shape[1], vocab_size, k, token_ids is not None, logits.dtype) if rows else []
    workspace = ReductionWorkspace.allocate(rows, plan[0].grid[1] if plan else 0,
                                            plan[0].constexprs["SUB"] if plan else 1, device)
    args = reduction_arguments(workspace, logits, chosen, requested, out, out_rows, token_ids, token_id_counts,
                               vocab_size)
    for spec in plan:
        runtime_args = {name: args[name] for name, kind in spec.signature.items() if kind != "constexpr"}
        spec.kernel[spec.grid](**runtime_args, **spec.constexprs, num_warps=spec.num_warps,
                               num_stages=spec.num_stages, enable_fp_fusion=ENABLE_FP_FUSION)
    return workspace


def reduce_logprobs_triton(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    """CUDA implementation of ``ignition::reduce_logprobs`` (same arguments as the reference)."""
    check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)
    launch_reduction(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)


# ---- fixed launch heuristics: the launcher and ahead-of-time preparation share these ----
ENABLE_FP_FUSION = False  # explicit, so JIT and prepared binaries agree (Triton 3.10's default)
_TARGET_PROGRAMS = 1024  # enough (row, tile) programs to cover a large GPU several times
_MIN_TILE, _MAX_TILE, _MAX_TILES = 1024, 8192, 256
SUB_BLOCKS = 32  # sub-block maxima per tile: the cutoff's resolution (K-th of tiles x SUB maxima)
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One launch: what to compile (kernel, signature, constexprs, warps, stages) and its grid."""

    name: str  # stable key, e.g. "logprobs.tile_stats"
    kernel: triton.runtime.JITFunction
    signature: dict[str, str]  # every kernel parameter in order: Triton type or "constexpr"
    constexprs: dict[str, int | bool]
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]


def _tiling(rows: int, vocab_size: int) -> tuple[int, int]:
    """(tile width, tiles per row): about _TARGET_PROGRAMS programs, at most _MAX_TILES tiles."""
    tile = min(max(triton.next_power_of_2(-(-rows * vocab_size // _TARGET_PROGRAMS)), _MIN_TILE), _MAX_TILE)
    tile = max(tile, triton.next_power_of_2(-(-vocab_size // _MAX_TILES)))  # only past 2M lanes
    tile = min(tile, max(16, triton.next_power_of_2(vocab_size)))
    return tile, -(-vocab_size // tile)


def _signature(kernel, logits_type: str) -> dict[str, str]:
    types = {"logits_ptr": logits_type, "chosen_ptr": "*i64", "requested_ptr": "*i32", "counts_ptr": "*i32",
             "token_ids_ptr": "*i32", "stats_ptr": "*fp32", "lse_ptr": "*fp32", "keys_ptr": "*i64",
             "maxima_ptr": "*fp32", "cutoff_ptr": "*fp32",
             "out_ptr": "*i32", "out_rows_ptr": "*i64", "logits_row_stride": "i32", "vocab_size": "i32",
             "num_tiles": "i32"}
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}


def launch_plan(rows: int, vocab_padded: int, vocab_size: int, k: int, explicit_ids: bool,
                logits_dtype: torch.dtype) -> list[LaunchSpec]:
    """The four launches for one shape; no autotuning, so a prepared core is reproducible."""
    if rows < 1 or not 1 <= vocab_size <= vocab_padded or not 0 <= k <= NATURAL_K or logits_dtype not in _POINTER_TYPES:
        raise ValueError(f"launch_plan: need rows >= 1, 1 <= vocab_size <= vocab_padded, 0 <= k <= {NATURAL_K} and a "
                         f"dtype in {list(_POINTER_TYPES)}; got rows={rows}, vocab_size={vocab_size}, "
                         f"vocab_padded={vocab_padded}, k={k}, dtype={logits_dtype}")
    logits_type = _POINTER_TYPES[logits_dtype]
    tile, tiles = _tiling(rows, vocab_size)
    tile_warps = max(1, min(8, tile // 256))
    candidates_block = triton.next_power_of_2(tiles * TILE_KEYS)
    sub = min(SUB_BLOCKS, tile)
    maxima_block = triton.next_power_of_2(tiles * sub)

    def spec(name, kernel, constexprs, num_warps, grid):
        return LaunchSpec(f"logprobs.{name}", kernel, _signature(kernel, logits_type), constexprs, num_warps, 1, grid)

    return [
        spec("tile_stats", tile_stats_kernel, {"TILE": tile, "SUB": sub}, tile_warps, (rows, tiles)),
        spec("row_normalization", row_normalization_kernel,
             {"TILES_BLOCK": triton.next_power_of_2(tiles), "SUB": sub, "MAXIMA_BLOCK": maxima_block,
              "K": min(k, TILE_KEYS)}, max(1, min(8, maxima_block // 1024)), (rows,)),
        spec("tile_candidates", tile_candidates_kernel,
             {"TILE": tile, "TILE_KEYS": TILE_KEYS, "SELECT": min(k, TILE_KEYS), "HAS_IDS": explicit_ids},
             tile_warps, (rows, tiles)),
        spec("merge", merge_kernel,
             {"K": k, "K_BLOCK": triton.next_power_of_2(max(k, 1)), "CANDIDATES_BLOCK": candidates_block,
              "TILE_KEYS": TILE_KEYS, "MAX_IDS": MAX_SELECTED_IDS, "OUT_WIDTH": packed_width(k, explicit_ids),
              "HAS_IDS": explicit_ids},
             max(1, min(8, candidates_block // 1024)), (rows,)),
    ]

