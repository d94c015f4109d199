"""Packed prompt chunks' attention: several requests' chunks in one forward, each over its own slot's keys.

``packed_attention`` runs every lane's segment (``Rows.segments``) with the same per-row mask and kernel as
``cached_attention`` (recipes/attention.py): the lane's window is gathered once for all its rows through its block
table, never the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignition.recipes.attention import (attend, brief_keys, causal_mask, gather_pages, key_positions,
                                        position_extent, short_forwards)
from ignition.recipes.layers import Rows, page_cells
from ignition.recipes.window_pages import window_keys, window_mask


@dataclass(frozen=True, slots=True)
class PackedPlan:
    """The layer-independent part of ``packed_attention`` for one forward's packed rows, made once a forward
    (``_packed_plan``): lane b's segment regrouped as rows ``b * E + j`` (E: the segment window's extent)."""

    window: int  # W keys read, [0, W)
    source: torch.Tensor  # int64 [B, E]: the packed row of each lane's row j (clamped: rows past a segment are junk)
    mask: torch.Tensor  # [B, 1, share * E, W]: ``causal_mask`` of each lane's rows
    gather: torch.Tensor  # int64 [R]: each packed row's row in the regrouped rows (then the brief ones, BF16)
    cells: torch.Tensor  # int64 [B * W]: the cell of the pool holding each lane's key j at b * W + j (``page_cells``)
    # BF16: each lane's first ``brief_keys`` rows (``source``'s form) and their mask over the slot's first
    # ``brief_keys`` positions, which a short forward's rows attend over instead (the module's note)
    brief_source: torch.Tensor | None = None
    brief_mask: torch.Tensor | None = None
    brief_keys: int = 0
    short: torch.Tensor | None = None  # FP16 [B, 1, 1, 1]: the lanes whose forward is short (``_softmax_in_order``)
    scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)
    brief_cells: torch.Tensor | None = None  # with brief rows: int64 [B * F], the cells of each lane's first F keys


def _packed_plan(rows: Rows, num_rows: int, kv_blocks, block_size: int, share: int,
                 dtype: torch.dtype, sliding: int | None = None, scale: float | None = None,
                 window_cells: int | None = None) -> PackedPlan:
    """``packed_attention``'s plan for ``rows``, made by the forward's first layer and kept in ``rows.plans``.

    A packed row's regrouped row is ``b * E + j`` (lane b, its row j). With BF16 each lane's regrouped rows are
    followed by its ``brief_keys`` brief rows (``b * (E + F) + E + j``), which a row of a short forward (a lane whose
    segment ends before ``SHORT_ROW`` keys: its rows are at most its first F) takes instead. FP16 lanes softmax
    every row of a short forward in order over the window, as ``cached_attention`` does: FP16 products over 15 keys
    rounded some rows differently from the chunk's over the window (``tests/test_packed_prefill.py``), so the packed
    rows would not be the serial ones. ``sliding``, ``scale``, ``window_cells``: as ``plan_attention``'s (a sliding
    layer's pool: no brief rows, no short-forward order)."""
    key = ("packed", sliding, scale, window_cells)
    if key in rows.plans:
        return rows.plans[key]
    segments = rows.segments
    device = rows.positions.device
    extent = segments.extent.shape[0]
    local = torch.ones_like(segments.extent).cumsum(0) - 1  # [E]: 0..E-1, from the extent alone
    source = (segments.offsets.unsqueeze(1) + local.unsqueeze(0)).clamp(0, num_rows - 1)  # [B, E]: packed rows
    row_positions = segments.starts.unsqueeze(1) + local.unsqueeze(0)  # [B, E]
    if sliding:  # a sliding layer's pool: the window's blocks of each lane (window_pages)
        if window_cells is None:
            raise ValueError(f"packed_attention: a sliding layer (sliding window {sliding}) needs window_cells, the "
                             "positions its step reads (the config's with_steps); found None")
        keys, cells = window_keys(rows, segments.starts.unsqueeze(1), rows.read_slots, sliding, window_cells,
                                  kv_blocks, block_size)
        window, mask = keys[0], window_mask(keys, row_positions, sliding, share, dtype)  # [B, 1, share*E, K]
    else:  # a full layer's pool: each lane's key window [0, W) through its block table
        positions_read = position_extent(rows, block_size)
        window = key_positions(rows, positions_read, device)  # [W]
        mask = causal_mask(window, row_positions, share, dtype)  # [B, 1, share*E, W]
        cells = page_cells(rows, rows.read_slots.unsqueeze(1), window.unsqueeze(0), kv_blocks, block_size).reshape(-1)
    ends = None if dtype == torch.float32 or sliding else segments.starts + segments.lengths  # [B]: forwards' keys
    if dtype != torch.bfloat16 or sliding:
        short = None if ends is None else short_forwards(ends).view(-1, 1, 1, 1)
        plan = PackedPlan(window=window.shape[0], source=source, mask=mask, gather=segments.row_source,
                          short=short, scale=scale, cells=cells)
    else:
        first = brief_keys(positions_read)
        head = torch.arange(first, device=device)  # [F]: 0..F-1
        lane = segments.row_lanes  # [R]
        row = rows.positions - segments.starts.index_select(0, lane)  # [R]: each packed row's index in its segment
        take = short_forwards(ends).index_select(0, lane) & (row < first)
        regrouped = torch.where(take, row + extent, row.clamp(0, extent - 1))  # past a segment: junk, in range
        plan = PackedPlan(window=window.shape[0], source=source, mask=mask,
                          gather=lane * (extent + first) + regrouped,
                          brief_source=(segments.offsets.unsqueeze(1) + head.unsqueeze(0)).clamp(0, num_rows - 1),
                          brief_mask=causal_mask(head, segments.starts.unsqueeze(1) + head.unsqueeze(0), share, dtype),
                          brief_keys=first, scale=scale, cells=cells,
                          brief_cells=page_cells(rows, rows.read_slots.unsqueeze(1), head.unsqueeze(0), kv_blocks,
                                                 block_size).reshape(-1))
    rows.plans[key] = plan
    return plan


def _lane_rows(query: torch.Tensor, source: torch.Tensor, kv_heads: int, share: int) -> torch.Tensor:
    """The packed ``query [R, heads, D]`` rows ``source [B, E]`` as ``[B, kv_heads, share * E, D]``: row
    ``s * E + j`` is head (kv, s) of lane b's row j."""
    lanes, extent = source.shape
    grouped = query.index_select(0, source.reshape(-1)).view(lanes, extent, kv_heads, share, query.shape[-1])
    return grouped.permute(0, 2, 3, 1, 4).reshape(lanes, kv_heads, share * extent, query.shape[-1])


def _lane_outputs(attended: torch.Tensor, share: int, extent: int) -> torch.Tensor:
    """``attended [B, kv_heads, share * E, D]`` (``_lane_rows``' order) as a ``[B, E, kv_heads, share, D]`` view."""
    lanes, kv_heads, _, head_dim = attended.shape
    return attended.view(lanes, kv_heads, share, extent, head_dim).permute(0, 3, 1, 2, 4)


def packed_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     rows: Rows, sliding: int | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None, window_cells: int | None = None) -> torch.Tensor:
    """Causal attention of packed prompt chunks ``query [R, heads, head_dim]`` over one layer's pool
    ``[kv_blocks, block_size, kv_heads, head_dim]``.

    Lane b's segment (``rows.segments``) attends over the positions ``<=`` each row's of slot
    ``rows.read_slots[b]``, exactly as a prefill chunk does: its slot's window is gathered once for all its rows
    through its block table (never the pool), its rows are regrouped as ``[lanes, kv_heads, groups * E,
    head_dim]`` (E: the segment window's extent) and one batched attention call runs every lane with the same
    per-row mask and kernel as ``cached_attention``. With BF16 each lane's first ``brief_keys``
    rows attend over the slot's first ``brief_keys`` positions too, and the rows of short forwards take those
    (``_packed_plan``): only F rows a lane, not every row as ``cached_attention``'s. Rows past a segment's length
    (the next segment's, or padding) are computed and dropped. Returns ``[R, heads * head_dim]`` in packed row
    order. ``sliding``, ``scale``, ``window_cells``: as ``plan_attention``'s (``key_cache`` is then a sliding
    layer's pool); ``sinks [heads]``: learned sink logits (``sink_attention``).
    """
    num_rows, heads, head_dim = query.shape
    kv_blocks, block_size, kv_heads, _ = key_cache.shape
    share = heads // kv_heads
    plan = _packed_plan(rows, num_rows, kv_blocks, block_size, share, query.dtype, sliding, scale, window_cells)
    lanes = plan.source.shape[0]
    # each lane's window gathered through its block table: [B, kv_heads, W, D]
    keys, values = (gather_pages(cache.unsqueeze(0), 0, plan.cells, lanes) for cache in (key_cache, value_cache))
    attended = attend(_lane_rows(query, plan.source, kv_heads, share), keys, values, plan.mask, per_head=True,
                       short=plan.short, scale=plan.scale, sinks=sinks)
    outputs = _lane_outputs(attended, share, plan.source.shape[1])  # [B, E, kv, share, D]
    if plan.brief_source is not None:  # each lane's first F rows over its slot's first F keys: [B, F, kv, share, D]
        first_keys, first_values = (gather_pages(cache.unsqueeze(0), 0, plan.brief_cells, lanes)
                                     for cache in (key_cache, value_cache))  # [B, kv_heads, F, D]
        brief = attend(_lane_rows(query, plan.brief_source, kv_heads, share), first_keys, first_values,
                        plan.brief_mask, per_head=True, scale=plan.scale, sinks=sinks)
        outputs = torch.cat([outputs, _lane_outputs(brief, share, plan.brief_keys)], dim=1)  # [B, E + F, kv, share, D]
    return outputs.reshape(-1, heads * head_dim).index_select(0, plan.gather)  # [R, heads * head_dim]
