"""Grouped-query attention over the KV caches' pools of blocks, with no copy of a whole cache.

- **Pools of blocks.** ``k_cache``/``v_cache`` are pools ``[layers, kv_blocks, block_size, kv_heads, head_dim]``
  (catalog/geometry.py ``PAGED_STATE``): each group's key window ``[0, W)`` is the cells its slot's block table names
  (``layers.page_cells``), planned once a forward, and one gather a layer reads them for every group (``[G, kv_heads,
  W, head_dim]``): the live blocks of the lanes, never the pool (``tests/test_decode_copies``). A sliding layer's pool
  is read the same way through its own tables, over the window's live blocks (``recipes/window_pages.py``).
- **FP32 through the fused kernel, BF16/FP16 as transformers' eager path** (scores rounded to the
  model dtype, softmax in FP32): one batched product over the groups and KV heads of the gathered windows, one per
  KV head in packed prefill.
- **Grouped heads without repetition.** Query head ``h`` belongs to KV head ``h // groups`` (HF
  ``repeat_kv``), so the ``groups`` query heads of one KV head become extra query rows of that KV
  head: ``[batch, kv_heads, groups * rows, head_dim]`` against ``[batch, kv_heads, window, head_dim]``.
- **Transformers' softmax order for short forwards (BF16/FP16).** ATen's CPU softmax sums a row shorter than its
  vector (``SHORT_ROW`` FP32 lanes) one element after another, and a longer row lane by lane. Transformers' eager
  attention softmaxes rows as long as its forward's keys (a decode step's context, a prompt's length), while ours
  are as long as the key window (32-position granules), so a forward over fewer than ``SHORT_ROW`` keys would sum
  its probabilities in another order: 1 in 20,000 BF16 probabilities rounded differently, which flipped a greedy
  token of the Qwen3-0.6B-shaped BF16 checkpoint at its 14th step. Such a group's rows take the softmax of their
  first ``SHORT_ROW - 1`` keys (``AttentionPlan.short``), the order transformers' rows take; the choice is each
  group's own (its valid rows' last position), so a lane's bits never depend on the other lanes' contexts, and a
  verify row's its own (``Rows.row_forwards``: the decode step at its position, whose bits speculation must keep).
  Packed BF16 prompt chunks do it by rows instead (``PackedPlan``): a lane whose forward is that short has at most
  ``brief_keys`` rows, so each lane's first ``brief_keys`` rows also attend over the slot's first ``brief_keys``
  positions, and its packed rows take those; its other rows never pad, copy or select a window-wide score row
  (a BF16 prefill of 8 x 512 tokens at Qwen3-0.6B's width spent about 0.5 s of 13.5 s doing that for every row).
  A prompt cut into chunks shorter than ``SHORT_ROW`` rows (``--chunk-limit`` below it) is the exception: its first
  chunk ends before 16 keys and sums the short way, while transformers' rows span the whole prompt.
- **Live context only.** The extent ``W`` of ``Rows.key_window`` (a prefix of the ``KEY_WINDOW``
  input, a dynamic extent of the graph) bounds the keys read to ``[0, W)``; the runtime passes a
  window past every row's position, so no key beyond it could be visible.
- **Planned once per forward.** What depends only on the rows (the window, the mask, the cells each
  group reads) is an ``AttentionPlan`` built once and shared by every layer: a layer adds only
  its own products, so a 2-layer graph and a 28-layer one pay for the mask once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ignition.catalog.softmax_order import short_row
from ignition.recipes.layers import Rows, page_cells
from ignition.recipes.window_pages import window_keys, window_mask


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The layer-independent part of ``cached_attention`` for one forward's rows (``plan_attention``)."""

    groups: int  # G attention groups
    per_group: int  # R // G rows per group
    window: int  # W keys read a group (a symbolic size in a windowed graph)
    mask: torch.Tensor  # [G, 1, share * R/G, W]: FP32 additive (0 or the FP32 minimum); BF16/FP16 True where hidden
    # int64 [G * W]: the cell of one layer's pool holding each group's key j at g * W + j (``page_cells``)
    cells: torch.Tensor
    # BF16/FP16 [G, 1, share * R/G, 1]: True where the row's forward (its group's, or with ``Rows.row_forwards`` its
    # own) covers fewer than SHORT_ROW keys
    short: torch.Tensor | None = None
    scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)


def key_positions(rows: Rows, max_seq_len: int, device: torch.device) -> torch.Tensor:
    """The key positions ``[0, W)`` the rows attend over: the key window's extent, or every cached position.

    Built from the window's extent alone (a cumulative sum of ones on its device), so whatever the
    window buffer holds, the result is the same."""
    if rows.key_window is not None:
        torch._check(rows.key_window.shape[0] <= max_seq_len)
        return torch.ones_like(rows.key_window).cumsum(0) - 1
    return torch.arange(max_seq_len, device=device)


SHORT_ROW = short_row()
"""ATen's CPU softmax sums rows shorter than this (its FP32 vector: 16 under AVX-512, 8 under AVX2) one element after
another: measured on the exporting machine (``catalog/softmax_order.py``, recorded in the manifest); see the module's
note on transformers' softmax order."""


def short_forwards(extent: torch.Tensor) -> torch.Tensor:
    """True where a forward covers fewer than ``SHORT_ROW`` keys (``extent``: its valid rows' last position + 1),
    whose rows transformers' eager attention softmaxes one element after another."""
    return extent < SHORT_ROW


def brief_keys(max_seq_len: int) -> int:
    """The cached positions a packed lane's short forward attends over (``PackedPlan``): the first ``SHORT_ROW - 1``
    (every key such a forward has, and a softmax row ATen sums one element after another), or the whole cache when
    shorter."""
    return min(SHORT_ROW - 1, max_seq_len)


def position_extent(rows: Rows, block_size: int) -> int:
    """The positions a slot's block table spans (``max_blocks * block_size``); without tables (the slot layout) a
    slot's one block, ``block_size`` positions."""
    return block_size if rows.block_tables is None else rows.block_tables.shape[1] * block_size


def _paged_plan(rows: Rows, kv_blocks, block_size: int, share: int, dtype: torch.dtype,
                scale: float | None) -> AttentionPlan:
    """``plan_attention`` over a pool of ``kv_blocks`` blocks of ``block_size`` positions (``PAGED_STATE``): each group
    reads the cells of its slot's key window ``[0, W)`` through the block tables (``page_cells``), one gather a layer
    for every group (``[G, kv_heads, W, head_dim]``), never the pool."""
    groups = rows.read_slots.shape[0]
    per_group = rows.positions.shape[0] // groups
    window = key_positions(rows, position_extent(rows, block_size), rows.positions.device)  # [W]
    positions = rows.positions.view(groups, per_group)
    mask = causal_mask(window, positions, share, dtype)
    cells = page_cells(rows, rows.read_slots.unsqueeze(1), window.unsqueeze(0), kv_blocks, block_size)  # [G, W]
    short = None
    if dtype != torch.float32:  # transformers' softmax order for short forwards (the module's note)
        extent = positions + 1 if rows.row_forwards else \
            rows.positions.masked_fill(~rows.valid, -1).view(groups, per_group).amax(1, keepdim=True) + 1
        short = short_forwards(extent.expand(groups, per_group)).repeat(1, share).view(groups, 1, share * per_group, 1)
    return AttentionPlan(groups=groups, per_group=per_group, window=window.shape[0], mask=mask, cells=cells.reshape(-1),
                         short=short, scale=scale)


def gather_pages(cache: torch.Tensor, layer: int, cells: torch.Tensor, groups: int) -> torch.Tensor:
    """Layer ``layer`` of the pool ``cache [layers, kv_blocks, block_size, kv_heads, head_dim]`` at ``cells [G * W]``:
    ``[G, kv_heads, W, head_dim]`` (one gather, a strided view of it)."""
    pool = cache[layer].flatten(0, 1)  # [kv_blocks * block_size, kv_heads, head_dim], a view
    return pool.index_select(0, cells).view(groups, -1, *pool.shape[1:]).transpose(1, 2)


def _window_plan(rows: Rows, kv_blocks, block_size: int, share: int, dtype: torch.dtype, sliding: int,
                 window_cells: int, scale: float | None) -> AttentionPlan:
    """``plan_attention`` over a sliding layer's pool (``catalog.geometry.WINDOW_PAGED_STATE``): each group reads the
    window's live blocks through ``rows.window_tables`` (``recipes/window_pages.py``), one gather a layer for every
    group, and each row sees the last ``sliding`` positions up to its own."""
    groups = rows.read_slots.shape[0]
    per_group = rows.positions.shape[0] // groups
    positions = rows.positions.view(groups, per_group)
    keys, cells = window_keys(rows, positions[:, :1], rows.read_slots, sliding, window_cells, kv_blocks, block_size)
    return AttentionPlan(groups=groups, per_group=per_group, window=keys.shape[1],
                         mask=window_mask(keys, positions, sliding, share, dtype), cells=cells, scale=scale)


def plan_attention(rows: Rows, kv_blocks, block_size: int, share: int, dtype: torch.dtype,
                   sliding: int | None = None, scale: float | None = None,
                   window_cells: int | None = None) -> AttentionPlan:
    """Build the plan ``cached_attention`` reads for ``rows`` over a pool of ``kv_blocks`` blocks of ``block_size``
    positions (the cache's first two extents), with ``share`` query heads per KV head and the model ``dtype``.

    A full layer's pool (``catalog.geometry.PAGED_STATE``) is read through ``rows.block_tables`` (``_paged_plan``).
    ``sliding`` with ``window_cells``: the pool is a sliding layer's (``catalog.geometry.WINDOW_PAGED_STATE``), read
    through ``rows.window_tables`` over the positions a step of the export's widest rows reads
    (``catalog.cache_kinds.window_cells``; ``_window_plan``). ``scale``: the scores' scale (None: ``head_dim **
    -0.5``)."""
    if not sliding:
        return _paged_plan(rows, kv_blocks, block_size, share, dtype, scale)
    if window_cells is None:
        raise ValueError(f"plan_attention: a sliding layer's plan (sliding window {sliding}) needs window_cells, the "
                         "positions its step reads (the config's with_steps); found None")
    return _window_plan(rows, kv_blocks, block_size, share, dtype, sliding, window_cells, scale)


def cached_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int,
                     plan: AttentionPlan, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``query [R, heads, head_dim]`` over layer ``layer`` of the pools
    ``[layers, kv_blocks, block_size, kv_heads, head_dim]``.

    Row ``i`` of group ``g`` (``R // G`` rows per group, ``G = len(rows.read_slots)``) attends over the
    positions ``<= rows.positions[i]`` of slot ``rows.read_slots[g]`` (``plan`` holds the rows' part: the cells each
    group reads, gathered once a layer). ``sinks [heads]``: each head's learned sink logit (``attend``). Returns
    ``[R, heads * head_dim]``.
    """
    num_rows, heads, head_dim = query.shape
    kv_heads = key_cache.shape[3]
    groups, per_group, share = plan.groups, plan.per_group, heads // kv_heads
    # query: [G, R/G, kv_heads, share, D] -> [G, kv_heads, share * R/G, D]; row s * R/G + j is head (kv, s), row j
    if per_group == 1:  # a decode lane a group: the same order, one view
        grouped = query.view(groups, kv_heads, share, head_dim)
    else:
        grouped = query.view(groups, per_group, kv_heads, share, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(groups, kv_heads, share * per_group, head_dim)
    attended = attend(grouped, gather_pages(key_cache, layer, plan.cells, groups),
                      gather_pages(value_cache, layer, plan.cells, groups), plan.mask, short=plan.short,
                      scale=plan.scale, sinks=sinks)  # [G, kv_heads, share * R/G, D]
    if per_group > 1:
        attended = attended.view(groups, kv_heads, share, per_group, head_dim).permute(0, 3, 1, 2, 4)
    return attended.reshape(num_rows, heads * head_dim)  # [R, heads * head_dim]


def causal_mask(window: torch.Tensor, positions: torch.Tensor, share: int, dtype: torch.dtype) -> torch.Tensor:
    """``[batch, 1, share * rows, W]`` for keys ``window [W]`` and rows at ``positions [batch, rows]`` (each repeated
    for the ``share`` query heads of a KV head): FP32 additive (0, or the FP32 minimum past the row's position) for
    the fused kernel; True where hidden for BF16/FP16 (``_eager_low_precision``)."""
    hidden = window.view(1, 1, 1, -1) > positions.repeat(1, share).unsqueeze(1).unsqueeze(-1)
    if dtype != torch.float32:
        return hidden
    return torch.zeros(hidden.shape, dtype=dtype, device=window.device).masked_fill(hidden, torch.finfo(dtype).min)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            per_head: bool = False, short: torch.Tensor | None = None, scale: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel for FP32, transformers' eager path for BF16/FP16 (``per_head``, ``short``: see
    ``_eager_low_precision``); ``mask`` from ``causal_mask`` or ``window_pages.window_mask``; ``scale``: the scores' scale
    (None: ``head_dim ** -0.5``); ``sinks [heads]``: learned sink logits (``sink_attention``)."""
    if sinks is not None:
        return sink_attention(query, keys, values, mask, sinks, scale)
    if query.dtype == torch.float32:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return _eager_low_precision(query, keys, values, mask, per_head, short, scale)


def sink_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    sinks: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Attention with a learned sink logit per head (GPT-OSS; transformers' ``eager_attention_forward`` there): each
    row's scores get one more column, its head's sink, the row is softmaxed in the scores' dtype after subtracting
    its maximum, and the sink's probability is dropped, so the keys' weights sum to less than one.

    One product per KV head: ``keys[:, kv]`` of a strided window view (``gather_pages``') is a strided batch of matrices that ``bmm``
    reads in place, where a product over the merged batch and KV-head dims would copy the window. ``query [B, kv, M,
    D]`` (row ``s * M / share + j``: head ``(kv, s)``), ``keys``/``values [B, kv, W, D]``, ``mask [B, 1, M, W]``
    (FP32 additive, or True where hidden), ``sinks [heads]`` -> ``[B, kv, M, D]``."""
    batch, kv_heads, rows, head_dim = query.shape
    share = sinks.shape[0] // kv_heads
    # [kv, M, 1]: row s * M / share + j of KV head kv takes head (kv, s)'s sink
    row_sinks = sinks.view(kv_heads, share, 1).expand(kv_heads, share, rows // share).reshape(kv_heads, rows, 1)
    scale = head_dim ** -0.5 if scale is None else scale
    outputs = []
    for head in range(kv_heads):
        scores = torch.matmul(query[:, head], keys[:, head].transpose(1, 2)) * scale  # [B, M, W]
        mask_rows = mask[:, 0]
        scores = scores.masked_fill(mask_rows, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask_rows
        sink = row_sinks[head].to(scores.dtype).unsqueeze(0).expand(batch, rows, 1)
        combined = torch.cat([scores, sink], dim=-1)  # [B, M, W + 1]
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype).narrow(-1, 0, scores.shape[-1])
        outputs.append(torch.matmul(probs.to(values.dtype), values[:, head]))  # [B, M, D]
    return torch.stack(outputs, dim=1)


def _eager_low_precision(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         hidden: torch.Tensor, per_head: bool = False,
                         short: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Transformers' eager attention for BF16/FP16: scores rounded to the model dtype, softmax in FP32.

    A fused kernel keeps the scores in FP32, which moves BF16 logits by more than routing tolerates
    (a MoE router flips experts). One batched product over the batch and KV-head dims of ``keys`` and
    ``values`` (``cached_attention``'s gathered windows), a dozen graph nodes a layer; ``per_head`` (packed prefill):
    one batched product per KV head, the shape transformers' own products take there (a merged product of 64
    against eight of 8 rounded a few prefill logits differently, which moved greedy tokens).
    ``short`` (broadcast against ``[B, 1, M, 1]``): the rows that softmax as transformers' short forwards do
    (``_softmax_in_order``). ``query [B, kv, M, D]``, ``keys``/``values [B, kv, W, D]``, ``hidden [B, 1, M, W]``
    (True: masked) -> ``[B, kv, M, D]``.
    """
    if not per_head:
        return _eager_product(query, keys, values, hidden, short, scale)
    return torch.cat([_eager_product(query[:, head:head + 1], keys[:, head:head + 1], values[:, head:head + 1],
                                     hidden, short, scale) for head in range(query.shape[1])], dim=1)


def _eager_product(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                   short: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Transformers' ``eager_attention_forward`` in one batched product each way over the batch and KV-head dims:
    the scores in the model dtype scaled, masked at the dtype's minimum (transformers adds its mask, whose zeros
    leave every visible score's bits and whose minimum softmaxes to zero as ours does), softmaxed in FP32
    (``_softmax_in_order``) and rounded back. ``query [B, kv, M, D]``, ``keys``/``values [B, kv, W, D]``,
    ``hidden [B, 1, M, W]``."""
    batch, kv_heads, rows, head_dim = query.shape
    window = keys.shape[2]
    scores = torch.bmm(query.reshape(batch * kv_heads, rows, head_dim),
                       keys.reshape(batch * kv_heads, window, head_dim).transpose(1, 2)) * \
        (head_dim ** -0.5 if scale is None else scale)
    scores = scores.view(batch, kv_heads, rows, window).masked_fill(hidden, torch.finfo(query.dtype).min)
    probs = _softmax_in_order(scores, short).to(query.dtype)  # [B, kv, M, W]
    attended = torch.bmm(probs.view(batch * kv_heads, rows, window),
                         values.reshape(batch * kv_heads, window, head_dim))  # [B * kv, M, D]
    return attended.view(batch, kv_heads, rows, head_dim)


def _softmax_in_order(scores: torch.Tensor, short: torch.Tensor | None) -> torch.Tensor:
    """FP32 softmax over the last dim of ``scores [..., W]`` (masked keys at their dtype's minimum); where ``short``
    (broadcast against the leading dims), the softmax of the first ``SHORT_ROW - 1`` keys, zeros after them: a
    row that short sums one element after another, as transformers' row over its short forward's keys does (the
    keys past the forward are masked, so nothing is dropped). Padded to ``W + SHORT_ROW`` keys first, so any
    window of at least one key has them."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if short is None:
        return probs
    window = scores.shape[-1]
    brief = F.pad(scores, (0, SHORT_ROW), value=torch.finfo(scores.dtype).min).narrow(-1, 0, SHORT_ROW - 1)
    brief = F.pad(torch.softmax(brief, dim=-1, dtype=torch.float32), (0, window + 1)).narrow(-1, 0, window)
    return torch.where(short, brief, probs)
