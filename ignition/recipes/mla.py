"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed KV cache.

Per layer and cached token the cache holds what transformers caches: the normalised KV latent
(``kv_lora_rank`` values) and the shared rope key after RoPE (``qk_rope_head_dim`` values), not
per-head keys and values. Two state buffers, both pools of blocks ``[num_layers, kv_blocks, block_size, width]``
in the model dtype (catalog/geometry.py ``PAGED_STATE``, addressed through the rows' block tables like GQA's K and
V): ``latent_cache`` (width ``kv_lora_rank``) and ``rope_key_cache`` (width ``qk_rope_head_dim``). Without block
tables (a recipe-level forward) each slot is one block of ``max_seq_len`` positions (``layers.page_cells``).

Attention gathers each group's cells of its slot's key window ``[0, W)`` (``Rows.key_window``: the live context, the
``key_window`` input of every deepseek_v3 graph) through the block table (planned once a forward, ``_cells``; one
gather a layer and pool: the lanes' live positions, never the pool), expands the latents into
per-head keys and values with ``kv_b_proj`` (once per call and layer), then attends as usual: exactly what
transformers computes, bit-identical to it in bf16 on CPU. The cache stays compressed; the
compute does not: per call and layer the expansion costs ``2 * W * kv_lora_rank *
heads * (qk_nope_head_dim + v_head_dim)`` FLOPs per slot. The absorbed form (``kv_b_proj``
folded into the query and the output) costs ~120x less per decode row at DeepSeek-V3 size, but
rounds differently: measured on the tiny bf16 example over 22 decode steps, up to 1.05 on a
logit (bf16 roundings amplified through the routing), 6e-6 in fp32. It is the next optimisation, for
decode only, once its contract tolerance is agreed; see docs/recipes.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ignition.catalog.geometry import LATENT_CACHE, ROPE_KEY_CACHE, state_shape
from ignition.recipes.attention import key_positions, position_extent
from ignition.recipes.config import paged_geometry
from ignition.recipes.layers import Rows, causal_softmax, page_cells, rms_norm, row_linear, write_rows
from ignition.recipes.rope import apply_rotary
from ignition.recipes.transformer import decoder_stack



def mla_cache_shapes(cfg, num_slots: int, max_seq_len: int, block_size: int | None = None,
                     kv_blocks=None) -> dict[str, tuple[int, ...]]:
    """``latent_cache`` ``[layers, kv_blocks, block_size, kv_lora_rank]``, ``rope_key_cache`` ``[layers, kv_blocks,
    block_size, rope_dim]`` (``config.paged_geometry``: without a ``block_size``, the slot layout ``[layers, slots,
    max_seq_len, ...]``)."""
    geometry = dict(full_layers=cfg.num_layers, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                    **paged_geometry(num_slots, max_seq_len, block_size, kv_blocks))
    return {name: tuple(state_shape(name, **geometry)) for name in (LATENT_CACHE, ROPE_KEY_CACHE)}


def _cells(rows: Rows, pool: torch.Tensor) -> torch.Tensor:
    """``[G * W]``: the cell of one layer of the pools (``[layers, kv_blocks, block_size, ...]``, the first two
    extents flattened) holding each group's key position ``j`` at ``g * W + j``, through its slot's block table;
    planned once a forward (``rows.plans``), shared by both pools and every layer."""
    if "mla_cells" not in rows.plans:
        block_size = pool.shape[2]
        window = key_positions(rows, position_extent(rows, block_size), rows.positions.device)  # [W]
        rows.plans["mla_cells"] = page_cells(rows, rows.read_slots.unsqueeze(1), window.unsqueeze(0), pool.shape[1],
                                             block_size).reshape(-1)
    return rows.plans["mla_cells"]


def _gather(pool: torch.Tensor, layer: int, cells: torch.Tensor, groups: int) -> torch.Tensor:
    """Layer ``layer`` of ``pool`` at ``cells [G * W]``: ``[G, W, width]`` (one gather)."""
    flat = pool[layer].flatten(0, 1)  # [kv_blocks * block_size, width], a view
    return flat.index_select(0, cells).view(groups, -1, flat.shape[-1])


def _query(weights: Mapping[str, torch.Tensor], cfg, prefix: str, normed: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``[R, heads, qk_head_dim]``: low-rank (q_a -> norm -> q_b) when ``q_lora_rank`` is set, else ``q_proj``."""
    if cfg.has_q_lora:
        compressed = rms_norm(F.linear(normed, weights[prefix + "q_a_proj"]), weights[prefix + "q_a_norm"],
                              cfg.rms_norm_eps, rows)
        query = F.linear(compressed, weights[prefix + "q_b_proj"])
    else:
        query = F.linear(normed, weights[prefix + "q_proj"])
    return query.view(normed.shape[0], cfg.num_heads, cfg.qk_head_dim)


def mla_attention(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, rows: Rows, latent_cache: torch.Tensor, rope_key_cache: torch.Tensor) -> torch.Tensor:
    prefix = f"layers.{layer}."
    num_rows, heads, nope, rope_dim = normed.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    rank, v_dim = cfg.kv_lora_rank, cfg.v_head_dim
    q_nope, q_rope = _query(weights, cfg, prefix, normed, rows).split([nope, rope_dim], dim=-1)
    latent, k_rope = F.linear(normed, weights[prefix + "kv_a_proj"]).split([rank, rope_dim], dim=-1)
    latent = rms_norm(latent, weights[prefix + "kv_a_norm"], cfg.rms_norm_eps, rows)  # [R, rank]
    q_rope = apply_rotary(q_rope, cos, sin, cfg.rope_interleave)  # [R, heads, rope_dim]
    k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin, cfg.rope_interleave).squeeze(1)  # [R, rope_dim]
    write_rows(latent_cache, layer, rows, latent, paged=True)
    write_rows(rope_key_cache, layer, rows, k_rope, paged=True)

    groups = rows.read_slots.shape[0]
    per_group, cells = num_rows // groups, _cells(rows, latent_cache)
    latents = _gather(latent_cache, layer, cells, groups)  # [G, S, rank]: S key positions
    rope_keys = _gather(rope_key_cache, layer, cells, groups).unsqueeze(1)  # [G, 1, S, rope_dim]
    expanded = F.linear(latents, weights[prefix + "kv_b_proj"])  # [G, S, heads * (nope + v)]
    k_nope, values = expanded.view(groups, latents.shape[1], heads, nope + v_dim).transpose(1, 2).split(
        [nope, v_dim], dim=-1)  # [G, heads, S, nope], [G, heads, S, v]
    keys = torch.cat([k_nope, rope_keys.expand(-1, heads, -1, -1)], dim=-1)  # [G, heads, S, qk_head_dim]
    query = torch.cat([q_nope, q_rope], dim=-1).view(groups, per_group, heads, nope + rope_dim).transpose(1, 2)
    scores = torch.matmul(query, keys.transpose(2, 3)) * cfg.attention_scale  # [G, heads, R/G, S]
    probs = causal_softmax(scores, rows, normed.dtype)
    attended = torch.matmul(probs, values).transpose(1, 2).reshape(num_rows, heads * v_dim)  # [R, heads * v]
    return row_linear(attended, weights[prefix + "o_proj"], None, cfg.row_blocks, cfg.row_shard)  # [R, d_model]


def _check_caches(cfg, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> None:
    """Static (trace-time) check that both caches match ``mla_cache_shapes`` and the weights' dtype."""
    for name, cache in caches.items():
        expected = mla_cache_shapes(cfg, 1, 1, cache.shape[2], cache.shape[1])[name] if cache.dim() == 4 else "4-D"
        if tuple(cache.shape) != expected or cache.dtype != weights["embed"].dtype:
            raise ValueError(f"{name} must have shape {expected} and dtype {weights['embed'].dtype}; "
                             f"found {tuple(cache.shape)} {cache.dtype}")


def mla_decoder(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, rows: Rows,
                caches: Mapping[str, torch.Tensor], parallel=None) -> torch.Tensor:
    """DeepSeek-V3: MLA attention over ``latent_cache`` / ``rope_key_cache``; final-normed hidden ``[R, d_model]``.

    ``parallel`` (a ``recipes.sharding.TensorParallel``): ``cfg`` and ``weights`` are one rank's, i.e.
    ``cfg.num_heads`` of the heads; the pools are whole (the latent and rope key are per token, not per head).
    """
    latent_cache, rope_key_cache = caches[LATENT_CACHE], caches[ROPE_KEY_CACHE]
    _check_caches(cfg, weights, {LATENT_CACHE: latent_cache, ROPE_KEY_CACHE: rope_key_cache})
    return decoder_stack(weights, cfg, input_ids, rows, lambda layer, normed, cos, sin: mla_attention(
        weights, cfg, layer, normed, cos, sin, rows, latent_cache, rope_key_cache), parallel)
