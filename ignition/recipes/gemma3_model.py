"""Functional Gemma 3 text decoder: a static-shape forward for ``torch.export``, op for op transformers' eager one.

Scaled embeddings (``sqrt(hidden_size)`` rounded to the model dtype), four Gemma RMSNorms a layer (``(1 + w)``
scales, normalized in FP32 and cast back after the scale), q/k norms before RoPE, each layer kind's own RoPE base,
scores scaled by ``query_pre_attn_scalar ** -0.5``, a GeGLU MLP (``gelu_pytorch_tanh``). Full layers attend over
``k_cache``/``v_cache`` like ``transformer.gqa_decoder``; sliding layers over the window's blocks of their pools
``k_window_cache`` / ``v_window_cache`` (``recipes/window_pages.py``, ``layers.write_rows(window=True)``). Both
kinds' plans are made once a forward.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ignition.catalog.cache_kinds import kind_index
from ignition.recipes.attention import cached_attention
from ignition.recipes.packed_attention import packed_attention
from ignition.recipes.layers import Rows, row_linear, write_rows
from ignition.recipes.rope import rope_cos_sin, rotate_half_rope, signed_sin
from ignition.recipes.windowed_model import CACHES, planned_rows


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Gemma3RMSNorm``: ``x`` normalized in FP32, times ``1 + weight`` in FP32, cast back."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * (1.0 + weight.float())).to(x.dtype)


def _attention(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor, rope, rows: Rows,
               plans: dict, caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One layer's attention over its kind's cache; ``rope``: (cos, signed sin) of the layer's kind."""
    prefix = f"layers.{layer}."
    kind = cfg.layer_kinds[layer]
    index = kind_index(cfg.layer_kinds, layer)  # the layer's row of its kind's caches
    k_cache, v_cache = (caches[name] for name in CACHES[kind])
    num_rows, heads, kv_heads, head_dim = normed.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query = F.linear(normed, weights[prefix + "q_proj"]).view(num_rows, heads, head_dim)
    key = F.linear(normed, weights[prefix + "k_proj"]).view(num_rows, kv_heads, head_dim)
    value = F.linear(normed, weights[prefix + "v_proj"]).view(num_rows, kv_heads, head_dim)
    query = gemma_rms_norm(query, weights[prefix + "q_norm"], cfg.rms_norm_eps)
    key = gemma_rms_norm(key, weights[prefix + "k_norm"], cfg.rms_norm_eps)
    cos, sin_signed = rope
    query, key = rotate_half_rope(query, cos, sin_signed), rotate_half_rope(key, cos, sin_signed)
    windowed = kind == "sliding"
    write_rows(k_cache, index, rows, key, paged=True, window=windowed)  # the sliding layers' pool: their own tables
    write_rows(v_cache, index, rows, value, paged=True, window=windowed)
    sliding = cfg.sliding_window if windowed else None
    if plans[kind] is None:  # packed prompt chunks (rows.segments)
        attended = packed_attention(query, k_cache[index], v_cache[index], rows, sliding, cfg.scale,
                                    window_cells=cfg.window_cells if windowed else None)
    else:
        attended = cached_attention(query, k_cache, v_cache, index, plans[kind])  # [R, q_width]
    return row_linear(attended, weights[prefix + "o_proj"], None, cfg.row_blocks, cfg.row_shard)  # [R, d_model]


def _mlp(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""
    prefix = f"layers.{layer}."
    hidden = F.gelu(F.linear(normed, weights[prefix + "gate_proj"]), approximate="tanh") \
        * F.linear(normed, weights[prefix + "up_proj"])  # [R, intermediate]
    return row_linear(hidden, weights[prefix + "down_proj"], None, cfg.row_blocks, cfg.row_shard)  # [R, d_model]


def gemma3_decoder(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, rows: Rows,
                   caches: Mapping[str, torch.Tensor], parallel=None) -> torch.Tensor:
    """Gemma 3: final-normed hidden ``[R, d_model]`` (``graphs.Decoder``).

    ``parallel`` (a ``recipes.sharding.TensorParallel``): the weights are one rank's shards (its heads, its MLP
    columns, its vocabulary rows); the embedding is vocabulary-parallel and each attention and MLP output is a
    partial sum that ``parallel.reduce`` adds over the ranks before its post-norm."""
    plans = planned_rows(cfg, weights, rows, caches)
    token_ids = input_ids.clamp(0, cfg.vocab_size - 1)  # padding ids may be anything
    embed = weights["embed"]
    # HF's embed_scale: sqrt(hidden_size) as an FP32 scalar, rounded to the model dtype
    normalizer = embed.new_full((), cfg.hidden_size ** 0.5, dtype=torch.float32).to(embed.dtype)
    rows_embedded = F.embedding(token_ids, embed) if parallel is None else parallel.embed(token_ids, embed)
    hidden = rows_embedded * normalizer  # [R, d_model]
    reduce = (lambda partial: partial) if parallel is None else parallel.reduce
    ropes = {}
    for kind, rope in (("full", cfg.global_rope), ("sliding", cfg.local_rope)):
        if kind in plans:
            cos, sin = rope_cos_sin(rope, rows.positions, hidden.dtype)  # [R, 1, head_dim] each
            ropes[kind] = (cos, signed_sin(sin))
    eps = cfg.rms_norm_eps
    for layer in range(cfg.num_layers):
        prefix = f"layers.{layer}."
        normed = gemma_rms_norm(hidden, weights[prefix + "attn_norm"], eps)
        attended = _attention(weights, cfg, layer, normed, ropes[cfg.layer_kinds[layer]], rows, plans, caches)
        hidden = hidden + gemma_rms_norm(reduce(attended), weights[prefix + "post_attn_norm"], eps)
        normed = gemma_rms_norm(hidden, weights[prefix + "mlp_norm"], eps)
        mlp = reduce(_mlp(weights, cfg, layer, normed))
        hidden = hidden + gemma_rms_norm(mlp, weights[prefix + "post_mlp_norm"], eps)
    hidden = gemma_rms_norm(hidden, weights["final_norm"], eps)
    return hidden


__all__ = ["gemma3_decoder", "gemma_rms_norm"]
