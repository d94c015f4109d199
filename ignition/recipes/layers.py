"""Functional building blocks every decoder recipe shares: norms, row indexing, cache writes, masked softmax.

All ops mirror transformers' eager implementation (fp32 RMSNorm cast back like HF, fp32 softmax)
and are static-shape: slots and positions are tensors, nothing branches on tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ignition.catalog.parallel import ROW_BLOCK_ALIGN


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: Rows | None = None) -> torch.Tensor:
    """HF RMSNorm: normalise in fp32, cast back to the input dtype, then scale.

    Transformers' own ops, written out: the mean of squares as a sum divided by the width, ``rsqrt`` of it plus
    ``eps``, then the scale (HF's values bit for bit at every dtype; tests/test_row_reduction.py
    ``test_rms_norm_is_hfs``). ``rows``: the forward's scalars (``Rows.scalar``), 0-dim FP32 tensors made once, so
    the division and the addition dispatch no scalar conversion: on the CPU a Python number costs four more
    operator calls each (a cast of the wrapped scalar), and torch's own ``rms_norm`` makes 24 operator calls
    against these 6 in FP32 (the division by the width and the addition of ``eps`` one ``addcdiv``, the same
    roundings). A decode step of Qwen3-0.6B's width replays 85 norms (113 with the q/k norms unfused), and between
    the step's GEMMs each call costs a few microseconds; without ``rows`` the scalars are Python numbers (the same
    values, a division and an addition)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    squares = (h * h).sum(-1, keepdim=True)
    if rows is None:
        normed = h * torch.rsqrt(squares / h.shape[-1] + eps)
    else:  # eps + squares / width in one call, rounded as the division and the addition are (no FMA follows a division)
        normed = h * torch.rsqrt(torch.addcdiv(rows.scalar(eps), squares, rows.scalar(h.shape[-1])))
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` added as a balanced pairwise tree (neighbours first): one fixed order, independent of who adds."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def reduction_blocks(width: int, most: int) -> int:
    """Blocks of a ``width``-wide reduction: the largest power of two <= ``most`` whose blocks are whole multiples
    of ``ROW_BLOCK_ALIGN`` lanes (1 when none is)."""
    blocks = 1
    while blocks * 2 <= most and width % (blocks * 2 * ROW_BLOCK_ALIGN) == 0:
        blocks *= 2
    return blocks


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               blocks: int = 1, shard: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the input dimension summed as equal blocks, pairwise.

    The row-parallel layers' fixed reduction order (``catalog.parallel.ROW_REDUCTION_BLOCKS``): at
    most ``blocks`` leaves (``reduction_blocks``, a power of two), each the product of ``x``'s slice
    with the weight's slice, added as a balanced pairwise tree of neighbours, the bias in the first
    leaf; a rank that holds a run of the leaves computes exactly that subtree of the single-rank sum.
    The leaves are one batched product over strided views of ``x`` and the weight (no copy of
    either; as fast as one GEMM at Qwen3-0.6B's width, where B separate GEMMs cost 1.2-1.5x, and
    a dozen graph nodes instead of 3B + 4), and each tree level adds the even leaves to the odd ones.
    FP32 weights only: a BF16 or FP16 GEMM rounds its output, so leaves would add rounding a single
    GEMM's FP32 accumulator avoids.

    ``shard``: this graph is one rank's share of a larger tree. A rank left with one block computes it
    in a batch of two (itself twice): a batch of one takes the plain GEMM's path, whose FP32 rounding
    differs from a batched leaf's at some shapes (rows 5, K 16).
    """
    width, out = weight.shape[1], weight.shape[0]
    blocks = reduction_blocks(width, blocks)
    if weight.dtype != torch.float32 or (blocks == 1 and not shard):  # BF16/FP16 leaves would round each sum
        return F.linear(x, weight, bias)
    step = width // blocks
    leaves = x.reshape(-1, blocks, step).transpose(0, 1)  # [blocks, rows, step], a view
    slices = weight.view(out, blocks, step).permute(1, 2, 0)  # [blocks, step, out], a view
    if blocks == 1:  # a batch of two, itself twice; the first product kept
        parts = torch.bmm(leaves.expand(2, -1, -1), slices.expand(2, -1, -1))[:1]
    else:
        parts = torch.bmm(leaves, slices)  # [blocks, rows, out]
    if bias is not None:
        parts = torch.cat((parts[:1] + bias, parts[1:]))
    while parts.shape[0] > 1:  # one level of the tree: leaf 2i + leaf 2i+1, one addition of two strided views
        parts = parts[0::2] + parts[1::2]  # (a size-2 ``sum`` took twice as long)
    return parts.view(*x.shape[:-1], out)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              gate_bias=None, up_bias=None, down_bias=None, blocks: int = 1, shard: bool = False) -> torch.Tensor:
    """SiLU-gated MLP ``down(silu(gate(x)) * up(x))``: the dense MLP, every expert and the shared experts.

    ``blocks``, ``shard``: the down projection's reduction blocks (``row_linear``)."""
    hidden = F.silu(F.linear(x, gate, gate_bias)) * F.linear(x, up, up_bias)  # [R, intermediate]
    return row_linear(hidden, down, down_bias, blocks, shard)  # [R, d_model]


@dataclass(frozen=True, slots=True)
class Segments:
    """Packed prompt chunks: lane b's chunk (its *segment*) is the packed rows ``[offsets[b], offsets[b] + lengths[b])``.

    Attention regroups the rows as ``[lanes, E]`` (lane b's row j at ``b * E + j``; E is the extent of
    ``extent``, at least the longest segment) and ``row_source`` maps each packed row back to it."""

    offsets: torch.Tensor  # int64 [B]: first packed row of each lane's segment (exclusive prefix sums of the lengths)
    starts: torch.Tensor  # int64 [B]: absolute position of each segment's first row
    lengths: torch.Tensor  # int64 [B]: each segment's rows (0: an idle lane)
    row_lanes: torch.Tensor  # int64 [R]: the lane each packed row belongs to (the last lane for rows past every segment)
    row_source: torch.Tensor  # int64 [R]: each packed row's index in the [lanes * E] regrouped rows
    extent: torch.Tensor  # [E]: the segment window; only its extent is read


@dataclass(frozen=True, slots=True)
class Rows:
    """Per-row indexing of one forward call. R rows split into G attention groups of R // G rows each
    (or, with ``segments``, into one variable-length segment per lane)."""

    positions: torch.Tensor  # int64 [R]: absolute position of each row
    write_slots: torch.Tensor  # int64 [R]: cache slot each row writes
    valid: torch.Tensor  # bool [R]: rows that may write the cache
    read_slots: torch.Tensor  # int64 [G]: cache slot each group attends over
    key_window: torch.Tensor | None = None  # [W]: keys [0, W) are read, W its extent (None: every cached position)
    segments: Segments | None = None  # packed prompt chunks (recipes/packed_attention.py)
    row_forwards: bool = False  # each row stands for its own forward (a verify row: the decode step at its position)
    # int32 [num_slots, max_blocks]: each slot's blocks of the paged caches (``page_cells``); None: the slot layout
    block_tables: torch.Tensor | None = None
    # int32 [num_slots, max_blocks]: each slot's blocks of the sliding layers' pools (``page_cells(window=True)``)
    window_tables: torch.Tensor | None = None
    writes: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # write_rows' cell plans
    scalars: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # ``scalar``'s tensors
    plans: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # attention's, once a forward

    def scalar(self, value: float) -> torch.Tensor:
        """``value`` as a 0-dim FP32 tensor on the rows' device, made once per forward (``rms_norm``)."""
        if value not in self.scalars:
            self.scalars[value] = self.positions.new_full((), value, dtype=torch.float32)
        return self.scalars[value]

    @classmethod
    def prefill(cls, chunk_rows: int, chunk_start: torch.Tensor, chunk_len: torch.Tensor, slot: torch.Tensor,
                key_window: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                window_tables: torch.Tensor | None = None) -> Rows:
        """One request's chunk: row j is position ``chunk_start + j`` of ``slot``, valid below ``chunk_len``."""
        row = torch.arange(chunk_rows, device=chunk_start.device)
        return cls(positions=chunk_start + row, write_slots=slot.expand(chunk_rows), valid=row < chunk_len,
                   read_slots=slot, key_window=key_window, block_tables=block_tables, window_tables=window_tables)

    @classmethod
    def packed(cls, packed_rows: int, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
               segment_window: torch.Tensor, key_window: torch.Tensor | None = None,
               block_tables: torch.Tensor | None = None, window_tables: torch.Tensor | None = None) -> Rows:
        """Lane b's chunk of ``lengths[b]`` rows (0: an idle lane), concatenated in lane order: its row j is packed row
        ``offsets[b] + j``, position ``starts[b] + j`` of ``slots[b]``. Rows past the last segment are padding."""
        lanes = lengths.shape[0]
        ends = lengths.cumsum(0)  # [B]
        offsets = ends - lengths
        row = torch.arange(packed_rows, device=lengths.device)
        lane = (row.unsqueeze(1) >= ends.unsqueeze(0)).sum(1)  # [R]: segments ending at or before the row
        valid = lane < lanes
        lane = lane.clamp(max=lanes - 1)
        local = row - offsets.index_select(0, lane)  # [R]: the row's index inside its segment
        extent = segment_window.shape[0]
        source = (lane * extent + local).clamp(0, lanes * extent - 1)
        segments = Segments(offsets=offsets, starts=starts, lengths=lengths, row_lanes=lane, row_source=source,
                            extent=segment_window)
        return cls(positions=starts.index_select(0, lane) + local, write_slots=slots.index_select(0, lane),
                   valid=valid, read_slots=slots, key_window=key_window, segments=segments, block_tables=block_tables,
                   window_tables=window_tables)

    @classmethod
    def decode(cls, positions: torch.Tensor, slots: torch.Tensor, active: torch.Tensor,
               key_window: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
               window_tables: torch.Tensor | None = None) -> Rows:
        """One row per lane, each its own group; active lanes must use distinct slots."""
        return cls(positions=positions, write_slots=slots, valid=active, read_slots=slots, key_window=key_window,
                   block_tables=block_tables, window_tables=window_tables)


def write_rows(cache: torch.Tensor, layer: int, rows: Rows, values: torch.Tensor, paged: bool = False,
               window: bool = False) -> None:
    """``cache[layer, slot_i, position_i] = values[i]`` for valid rows; invalid rows leave it bit-identical.

    Without ``paged`` ``cache`` is in the slot layout ``[layers, num_slots, max_seq_len, ...]``. ``paged``: ``cache``
    is a pool of blocks ``[layers, kv_blocks, block_size, ...]`` (``catalog.geometry.PAGED_STATE``): position ``p`` of
    slot ``s`` goes to the cell ``page_cells`` names; ``window``: through the sliding layers' tables
    (``Rows.window_tables``).

    One ``index_copy_`` into the cache's cells (its first three dims flattened, a view) writes every row. An
    invalid row repeats the first valid row's write (same cell, same value); if no row is valid, every row
    rewrites row 0's cell with its old value. Duplicate targets thus
    always carry identical values and the result never depends on write order. Slots and positions are clamped
    into range. Valid rows must target distinct cells. Which cell each row writes depends on the rows alone: it is
    planned once per forward (``_write_plan``), each layer's cells once for its caches, and a decode batch reads
    every layer's old cell values in one gather at the cache's first write (``_cache_cells``); each write then adds
    its gather of the rows, a ``where`` and the copy.
    """
    source, cells, keep_new = _write_plan(rows, cache.shape[:3], layer, values.dim(), paged, window)
    flat, old = _cache_cells(rows, cache, paged, window)
    old_values = old[layer] if old is not None else flat.index_select(0, cells)
    flat.index_copy_(0, cells, torch.where(keep_new, values.index_select(0, source), old_values))


OLD_CELLS_AHEAD = 4096
"""``write_rows`` reads the old values of every layer's target cells at a cache's first write of a forward (one gather
instead of one a layer) when they number at most this many (layers x rows: a decode batch); a prompt chunk's rows
(a symbolic count, or past the limit) read theirs layer by layer, so its forward holds one layer's copy at a time."""


def _plan_key(extents: torch.Size, paged: bool = False, window: bool = False) -> tuple:
    """``rows.writes``' key of the cell plan for caches of ``extents`` (layers, slots, positions; or layers, blocks,
    block positions, and which tables address them)."""
    if paged:  # the block count is symbolic in an exported graph (unhashable); a group's pools share it
        return extents[0], extents[2], "window" if window else "paged"
    return (*tuple(extents), "slots")


def page_cells(rows: Rows, slots: torch.Tensor, positions: torch.Tensor, kv_blocks, block_size: int,
               window: bool = False) -> torch.Tensor:
    """The cell of one layer of a pool of ``kv_blocks`` blocks of ``block_size`` positions (the pool's first two
    extents flattened) that holds each ``positions`` entry of the matching ``slots`` entry (broadcast together):
    ``block_tables[slot, position // block_size] * block_size + position % block_size``. Without block tables
    (``rows.block_tables`` None: the slot layout, each slot one block of every position) it is
    ``slot * block_size + position``. Slots, positions and block ids are clamped into range, so whatever a table
    holds past a slot's live blocks, every cell exists. ``window``: the sliding layers' pool, through
    ``rows.window_tables``."""
    tables = rows.window_tables if window else rows.block_tables
    if tables is None:
        return slots.clamp(0, kv_blocks - 1) * block_size + positions.clamp(0, block_size - 1)
    max_blocks = tables.shape[1]
    positions = positions.clamp(0, max_blocks * block_size - 1)
    blocks = tables[slots.clamp(0, tables.shape[0] - 1), positions // block_size].to(torch.int64)
    return blocks.clamp(0, kv_blocks - 1) * block_size + positions.remainder(block_size)


def _cache_cells(rows: Rows, cache: torch.Tensor, paged: bool = False, window: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``cache`` with its first three dims flattened, a view; the values before this forward's writes of every
    layer's target cells ``[layers, R, ...]``, or None past OLD_CELLS_AHEAD), made at the cache's first write of the
    forward. Only a forward without a valid row writes those old values back (``write_rows``), so reading them
    before any layer's write is the same as reading each layer's before its own."""
    key = ("cells", id(cache))
    if key not in rows.writes:
        flat = cache.view(-1, *cache.shape[3:])  # [layers * slots * positions, ...]: every cell, a view
        cells = rows.writes[_plan_key(cache.shape[:3], paged, window)].cells  # [layers, R]
        old = None
        numel = cells.numel()  # a symbolic count (a prompt chunk's rows) never reads ahead: no guard on it
        if isinstance(numel, int) and numel <= OLD_CELLS_AHEAD:
            old = flat.index_select(0, cells.flatten()).view(*cells.shape, *cache.shape[3:])
        rows.writes[key] = (flat, old)
    return rows.writes[key]


class _RowWrites(NamedTuple):
    """The rows' part of every write into caches of one extent (``_write_plan``)."""

    source: torch.Tensor  # [R]: the row whose value each row writes (the first valid one for an invalid row)
    cells: torch.Tensor  # [layers, R]: each layer's flattened cell of each row
    keep_new: torch.Tensor  # [R]: False where a row rewrites its cell's old value (no row valid)


def _write_plan(rows: Rows, extents: torch.Size, layer: int, dims: int, paged: bool = False,
                window: bool = False) -> tuple[torch.Tensor, ...]:
    """(source row ``[R]``, the layer's cell of each row ``[R]``, keep-new shaped for ``dims``-D values) of each
    row's write into a cache of ``extents`` (layers, slots, positions). The rows' part is built on the first call
    for these extents, a layer's cells on its first write; every later layer and cache reuses them
    (``rows.writes``)."""
    key = _plan_key(extents, paged, window)
    if key not in rows.writes:
        layers, num_slots, max_seq_len = tuple(extents)
        first_valid = torch.argmax(rows.valid.to(torch.int32))  # 0 when no row is valid
        row = torch.arange(rows.valid.shape[0], device=rows.valid.device)
        source = torch.where(rows.valid, row, first_valid)  # [R]
        slots, positions, keep_new = rows.write_slots[source], rows.positions[source], rows.valid[source]
        if paged:  # extents: layers, kv_blocks, block_size
            cell = page_cells(rows, slots, positions, num_slots, max_seq_len, window)  # [R]: in one layer
        else:
            cell = slots.clamp(0, num_slots - 1) * max_seq_len + positions.clamp(0, max_seq_len - 1)  # [R]: one layer
        layer_start = torch.arange(layers, device=cell.device) * (num_slots * max_seq_len)  # [layers]
        rows.writes[key] = _RowWrites(source, layer_start.unsqueeze(1) + cell.unsqueeze(0), keep_new)
    source, cells, keep_new = rows.writes[key]
    if (key, "layer", layer) not in rows.writes:
        rows.writes[key, "layer", layer] = cells.select(0, layer)
    if (key, "dims", dims) not in rows.writes:
        rows.writes[key, "dims", dims] = keep_new.view(-1, *([1] * (dims - 1)))
    return source, rows.writes[key, "layer", layer], rows.writes[key, "dims", dims]


def causal_softmax(scores: torch.Tensor, rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over cached positions ``<=`` each row's position, in fp32, cast to ``dtype`` (HF eager).

    ``scores``: ``[G, heads, R/G, S]``; the query of group g, row i is ``rows.positions[g * R/G + i]``.
    """
    groups, _, per_group, max_seq_len = scores.shape
    key_positions = torch.arange(max_seq_len, device=scores.device)
    visible = key_positions.view(1, 1, 1, -1) <= rows.positions.view(groups, 1, per_group, 1)
    scores = scores.to(torch.float32).masked_fill(~visible, torch.finfo(torch.float32).min)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
