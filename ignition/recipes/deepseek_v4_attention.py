"""DeepSeek V4 attention over its per-slot state: a sliding window of one K=V head, plus compressed entries.

One step is ``R`` rows of one slot at positions ``start .. start + R - 1``. Every buffer it keeps is a ring or a
table indexed by position (``catalog/cache_kinds.py``), so a prompt chunk, a decode step and a verify round run
the same code, and nothing depends on how the sequence was cut into steps:

- the window ring: the K=V row of position ``q`` in cell ``q mod window_cells``; a row at ``p`` attends over the
  positions ``(p - W, p]`` (transformers' sliding mask, and its decode cache of the last ``W - 1`` rows);
- a compressor's source ring: the projected ``(kv, gate)`` rows of the last positions, ``q mod source_cells``;
- the entry table: entry ``w`` compresses the window of positions ``[w m, (w + 1) m)`` and is written by the step
  holding its last position ``(w + 1) m - 1``; a row at ``p`` sees the entries ``w < (p + 1) // m``. A CSA entry
  (``m = csa_rate``) mixes window ``w - 1``'s first series (Ca) with window ``w``'s second (Cb), softmax-gated over
  ``2m`` rows; an HCA entry (``m = hca_rate``) its own window's ``m`` rows.

Every ring is read before the step writes it, so a step needs the last ``W - 1`` (window), ``2m - 1`` (CSA) or
``m - 1`` (HCA) positions before it; the rings hold that plus the step's rows, so a rejected verify row only
overwrites positions no later row reads. CSA rows attend over the ``index_topk`` entries the lightning indexer
scores highest among those they see (``∑_h w_h ReLU(q_h · k)``); HCA rows over all they see. Op for op
transformers' eager ``DeepseekV4Attention`` in FP32 (incremental decode, which these rules are).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ignition.recipes.rope import rope_frequencies


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' ``Olmo2RMSNorm`` (``weight`` None: ``DeepseekV4UnweightedRMSNorm``)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * hidden).to(x.dtype)


def rope_cos_sin(rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's half-width ``cos``, ``sin`` ``[R, rope_dim // 2]``: one angle per interleaved pair."""
    inv_freq, multiplier = rope_frequencies(rope, positions.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq
    return (angles.cos() * multiplier).to(dtype), (angles.sin() * multiplier).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' V4 ``apply_rotary_pos_emb`` on the trailing ``2 * cos.shape[-1]`` channels of ``x [R, H, D]``
    (``cos``/``sin`` ``[R, half]``, each repeated twice; GLM's interleaved ``rotate_half``: pair ``(x0, x1)`` turns
    into ``(-x1, x0)``); the leading channels untouched."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    width = cos.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (turned.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class SlotCells:
    """One slot's cells of one layer's state buffer ``[slots, cells, ...]`` (a ring or an entry table), read and
    written in place by cell: a step gathers the cells it reads and copies only the rows it produces into their
    cells, never the slot's whole state (``catalog/cache_kinds.py``; ``recipes/layers.py`` ``write_rows`` does the
    same for the other recipes' caches). ``slot``: an int64 tensor ``[1]`` (a graph's lane) or an int."""

    __slots__ = ("flat", "base", "cells")

    def __init__(self, buffer: torch.Tensor, slot: torch.Tensor | int):
        self.cells = buffer.shape[1]
        self.flat = buffer.view(-1, *buffer.shape[2:])  # [slots * cells, ...]: a view, so writes reach the buffer
        slot = torch.as_tensor(slot, dtype=torch.int64, device=buffer.device).reshape(1)
        self.base = slot * self.cells

    def read(self, cells: torch.Tensor) -> torch.Tensor:
        """The slot's rows at ``cells`` ``[n]``: ``[n, ...]``."""
        return self.flat.index_select(0, self.base + cells)

    def whole(self) -> torch.Tensor:
        """Every cell of the slot (an entry table the attention reads whole): ``[cells, ...]``."""
        return self.read(torch.arange(self.cells, device=self.flat.device))

    def write(self, cells: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """``cell[cells[i]] = rows[i]``; a row whose ``keep`` is False rewrites its cell's old value (one gather of
        the written cells, never of the slot)."""
        index = self.base + cells
        rows = rows.to(self.flat.dtype)
        if keep is not None:
            keep = keep.expand(rows.shape[0]).view(-1, *([1] * (rows.dim() - 1)))
            rows = torch.where(keep, rows, self.flat.index_select(0, index))
        self.flat.index_copy_(0, index, rows)


def _ring_history(ring: SlotCells, start: torch.Tensor, count: int) -> torch.Tensor:
    """The ring's rows of positions ``start - count .. start - 1`` (cells ``q mod cells``; negative positions read
    some cell, and every reader masks them)."""
    positions = start - count + torch.arange(count, device=start.device)
    return ring.read(positions.remainder(ring.cells))


def _write_ring(ring: SlotCells, positions: torch.Tensor, rows: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
    """``ring[q mod cells] = row`` for every row (a step's rows are fewer than the cells: distinct cells); an
    invalid row (``valid`` False: a prompt chunk's padding, an idle lane) rewrites its cell's old value."""
    ring.write(positions.remainder(ring.cells), rows, valid)


def window_keys(ring: SlotCells, kv: torch.Tensor, positions: torch.Tensor, window: int,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The window branch: keys ``[W - 1 + R, D]`` (the ring's last ``W - 1`` positions, then this step's rows) and
    the additive mask ``[R, W - 1 + R]`` of the positions ``(p - W, p]`` each row sees; writes the step's rows."""
    start = positions[:1]
    history = _ring_history(ring, start, window - 1)
    keys = torch.cat([history.to(kv.dtype), kv], dim=0)
    key_positions = start - (window - 1) + torch.arange(keys.shape[0], device=kv.device)
    _write_ring(ring, positions, kv, valid)
    seen = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] > positions[:, None] - window) \
        & (key_positions[None, :] >= 0)
    return keys, additive_mask(seen, kv.dtype)


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``seen``, ``-inf`` elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, float("-inf"))


def compress_step(weights: Mapping[str, torch.Tensor], prefix: str, x: torch.Tensor, positions: torch.Tensor,
                  source: SlotCells, entries: SlotCells, rate: int, overlap: bool, rope, eps: float,
                  valid: torch.Tensor | None = None) -> None:
    """Write every entry whose window closes in this step into ``entries`` (``[extent, d]`` a slot), from the step's
    hidden rows ``x [R, hidden]`` and the ``source`` ring (``[cells, 2, series, d]`` a slot: kv and gate of each
    position, ``series`` 2 with ``overlap``: Ca and Cb; 1 without). A step with no valid row writes no entry.

    transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / the indexer's compressor: the gate
    plus ``ape`` softmaxed in FP32 over the window's rows, the weighted kv summed, RMS-normed, rotated at the
    window's first position ``w m``. Window 0 has no previous window: its Ca rows weigh 0."""
    rows, series, dim = x.shape[0], 2 if overlap else 1, entries.flat.shape[-1]
    start = positions[:1]
    kv = F.linear(x, weights[prefix + "wkv"]).view(rows, series, dim)
    gate = F.linear(x, weights[prefix + "wgate"]).view(rows, series, dim)
    new = torch.stack([kv, gate], dim=1)  # [R, 2, series, d]
    history = series * rate - 1  # positions before the step a closing window may read
    src = torch.cat([_ring_history(source, start, history), new.to(source.flat.dtype)])  # [history + R, 2, series, d]
    _write_ring(source, positions, new, valid)
    candidates = (rows - 1) // rate + 1  # windows that may close in a step of R rows
    window = start // rate + torch.arange(candidates, device=x.device)  # [C]
    offsets = torch.arange(rate, device=x.device)
    first = start - history  # position of src row 0
    ape = weights[prefix + "ape"].view(rate, series, dim)
    current = (window[:, None] * rate + offsets[None, :] - first).clamp(0, src.shape[0] - 1)  # [C, m]
    kv_rows = src[current, 0, series - 1]  # [C, m, d]
    gate_rows = src[current, 1, series - 1] + ape[:, series - 1]
    if overlap:
        previous = (window[:, None] * rate - rate + offsets[None, :] - first).clamp(0, src.shape[0] - 1)
        prior_gate = (src[previous, 1, 0] + ape[:, 0]).masked_fill((window == 0)[:, None, None], float("-inf"))
        prior_kv = src[previous, 0, 0].masked_fill((window == 0)[:, None, None], 0.0)
        kv_rows, gate_rows = torch.cat([prior_kv, kv_rows], dim=1), torch.cat([prior_gate, gate_rows], dim=1)
    mixed = (kv_rows * gate_rows.softmax(dim=1, dtype=torch.float32).to(kv_rows.dtype)).sum(dim=1)  # [C, d]
    compressed = rms_norm(mixed, weights[prefix + "norm"], eps)
    cos, sin = rope_cos_sin(rope, window * rate, compressed.dtype)
    compressed = apply_rope(compressed.unsqueeze(1), cos, sin).squeeze(1)
    # a window that does not close in this step writes a stand-in its closing step overwrites before any row reads it
    entries.write(window.clamp(max=entries.cells - 1), compressed, None if valid is None else valid.any().view(1))


def entries_seen(positions: torch.Tensor, extent: int, rate: int) -> torch.Tensor:
    """``[R, extent]``: entry ``w`` is complete for the row at ``p`` when ``w < (p + 1) // rate``."""
    return torch.arange(extent, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]


def indexer_choice(weights: Mapping[str, torch.Tensor], prefix: str, cfg, x: torch.Tensor, q_residual: torch.Tensor,
                   positions: torch.Tensor, index_keys: torch.Tensor, seen: torch.Tensor, parallel=None) -> torch.Tensor:
    """The lightning indexer: ``[R, extent]`` True where a row attends to an entry, the ``index_topk`` entries it
    sees with the highest ``∑_h w_h ReLU(q_h · k) / sqrt(index_head_dim)`` (transformers' ``DeepseekV4Indexer``
    and ``DeepseekV4IndexerScorer``).

    ``parallel`` (a ``recipes.sharding.TensorParallel``): ``cfg.index_heads`` and the weights are this rank's share of
    the heads (``w_h`` keeps the whole model's ``1 / sqrt(heads)``); the ranks' head sums are added by
    ``parallel.reduce`` (the same FP32 total on every rank), and every rank ranks the entries itself.

    Tie rule (``INDEXER_TIE_RULE``): among entries of equal score the lowest entry index is kept first, a stable
    descending sort over the whole entry table. ReLU makes exact ties (several entries scoring 0) common when a row
    has few positive entries; ``torch.topk`` breaks them in a way that depends on the vector's length (transformers
    ranks the entries its cache holds, so its choice depends on how the sequence was cut into forwards), while a
    graph ranks a fixed-length table: this rule makes the choice a function of the scores alone."""
    rows = x.shape[0]
    cos, sin = rope_cos_sin(cfg.compress_rope, positions, x.dtype)
    query = F.linear(q_residual, weights[prefix + "wq_b"]).view(rows, cfg.index_heads, cfg.index_head_dim)
    query = apply_rope(query, cos, sin)
    scores = torch.matmul(query.float(), index_keys.float().transpose(0, 1))  # [R, heads, extent]
    scores = F.relu(scores) * cfg.index_head_dim ** -0.5
    heads = cfg.index_heads * (1 if parallel is None else parallel.ranks)  # the model's, not this rank's
    head_weights = F.linear(x, weights[prefix + "weights_proj"]).float() * heads ** -0.5  # [R, heads]
    total = (scores * head_weights.unsqueeze(-1)).sum(dim=1)  # [R, extent] in FP32: this rank's heads
    if parallel is not None:
        total = parallel.reduce(total)
    return seen & keep_best(total.masked_fill(~seen, float("-inf")), cfg.index_topk)


def keep_best(total: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, extent]`` True at each row's ``k`` highest scores, equal scores kept lowest entry first (a stable
    descending sort: ``INDEXER_TIE_RULE``)."""
    best = torch.sort(total, dim=-1, descending=True, stable=True).indices[:, :min(k, total.shape[-1])]
    return torch.zeros(total.shape, dtype=torch.bool, device=total.device).scatter(-1, best, True)


INDEXER_TIE_RULE = "lowest entry first"
"""How the lightning indexer orders entries of equal score (``keep_best``); docs/recipes.md states it."""


def attend(weights: Mapping[str, torch.Tensor], prefix: str, cfg, query: torch.Tensor, keys: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention with per-head sinks over one K=V head: ``[R, H, D]`` queries, ``[K, D]`` keys,
    an additive mask ``[R, K]``."""
    scores = torch.einsum("rhd,kd->hrk", query, keys) * cfg.head_dim ** -0.5  # [H, R, K]
    scores = scores + mask.unsqueeze(0)
    sinks = weights[prefix + "attn_sink"].to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)  # [R, H, D]
