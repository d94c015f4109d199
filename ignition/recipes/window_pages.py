"""The keys a sliding layer's row reads from its pool of blocks: the window's live blocks, never the whole context.

A sliding layer's K and V are pools ``[sliding_layers, window_kv_blocks, block_size, kv_heads, head_dim]``
(catalog/geometry.py ``WINDOW_PAGED_STATE``) addressed through ``Rows.window_tables``. A row at position ``p``
attends over the positions ``p - W < k <= p`` (transformers' sliding window, ``W = sliding_window``). A group of rows
(a decode lane, a verify lane's ``S + 1`` rows, a prompt chunk, a packed segment) whose first row is at ``s`` reads
the positions from ``s - W + 1`` (rounded down to its block) on, ``catalog.geometry.window_read_blocks`` whole
blocks: every key any of its at most ``R`` rows sees, since ``window_cells = W + R - 1`` (catalog/cache_kinds.py
``window_cells``) bounds what they span. The table entries of blocks below ``s - W + 1`` may be the null block (the runtime released them); they
are never read. Positions past the row are masked as the causal mask does; the cells of positions past the table
are clamped into range and masked too.
"""

from __future__ import annotations

import torch

from ignition.catalog.geometry import window_read_blocks
from ignition.recipes.layers import Rows, page_cells


def window_keys(rows: Rows, first: torch.Tensor, slots: torch.Tensor, sliding: int, window_cells: int,
                kv_blocks, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key positions ``[G, K]``, their cells ``[G * K]`` in one layer of the pool) of the groups whose first rows are
    at ``first [G, 1]`` on ``slots [G]``: ``K = window_read_blocks * block_size`` positions from the block holding
    ``first - sliding + 1`` (0 at most)."""
    span = window_read_blocks(window_cells, block_size) * block_size
    base = (first - sliding + 1).clamp(min=0) // block_size * block_size  # [G, 1]: the first block read
    keys = base + torch.arange(span, device=first.device).unsqueeze(0)  # [G, K]
    cells = page_cells(rows, slots.unsqueeze(1), keys, kv_blocks, block_size, window=True)  # [G, K]
    return keys, cells.reshape(-1)


def window_mask(keys: torch.Tensor, positions: torch.Tensor, sliding: int, share: int,
                dtype: torch.dtype) -> torch.Tensor:
    """``[G, 1, share * rows, K]`` for each group's keys ``keys [G, K]`` and rows at ``positions [G, rows]`` (each
    repeated for the ``share`` query heads of a KV head): a row at ``p`` sees key ``k`` when ``p - sliding < k <=
    p``. FP32 additive (0, or the FP32 minimum where hidden); True where hidden for BF16/FP16."""
    rows = positions.repeat(1, share).unsqueeze(-1)  # [G, share * rows, 1]
    key = keys.unsqueeze(1)  # [G, 1, K]
    hidden = ((key > rows) | (key <= rows - sliding)).unsqueeze(1)
    if dtype != torch.float32:
        return hidden
    return torch.zeros(hidden.shape, dtype=dtype, device=keys.device).masked_fill(hidden, torch.finfo(dtype).min)


__all__ = ["window_keys", "window_mask"]
