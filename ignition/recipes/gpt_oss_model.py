"""Functional GPT-OSS decoder: a static-shape forward for ``torch.export``, op for op transformers' eager one.

Pre-norm layers (RMSNorm normalized in FP32, ``weight * x`` then cast back), biased q/k/v/o projections, one YaRN
RoPE for every layer, attention with a learned sink logit per head on both layer kinds (``recipes/attention.py``
``sink_attention``): full layers over ``k_cache``/``v_cache``, sliding ones over the window's blocks of their pools
``k_window_cache`` / ``v_window_cache`` as ``gemma3_model`` does (plans from ``windowed_model``). The MLP is routed experts
(``moe.routed_experts`` with the ``topk_softmax`` router) whose expert is a clamped SwiGLU over the checkpoint's
stacked, interleaved ``gate_up`` (``clamped_swiglu``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F

from ignition.catalog.cache_kinds import kind_index
from ignition.recipes.attention import cached_attention
from ignition.recipes.packed_attention import packed_attention
from ignition.recipes.layers import Rows, row_linear, write_rows
from ignition.recipes.moe import routed_experts
from ignition.recipes.rope import rope_cos_sin, rotate_half_rope, signed_sin
from ignition.recipes.windowed_model import CACHES, planned_rows


def gpt_oss_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``GptOssRMSNorm``: ``x`` normalized in FP32, times ``weight``, then cast back."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * hidden).to(x.dtype)


def clamped_swiglu(rows: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """One GPT-OSS expert (transformers' ``GptOssExperts``): ``rows [C, d_model]``, ``gate_up [d_model, 2I]`` (gate
    at even columns, up at odd), ``down [I, d_model]``; the gate clamped above at ``limit``, the up both ways,
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Returns ``[C, d_model]``."""
    projected = rows @ gate_up + gate_up_bias  # [C, 2I]
    gate = projected[..., ::2].clamp(max=limit)
    up = projected[..., 1::2].clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))) @ down + down_bias  # [C, d_model]


def _attention(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor, rope, rows: Rows,
               plans: dict, caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One layer's attention with sinks over its kind's cache; ``rope``: (cos, signed sin)."""
    prefix = f"layers.{layer}."
    kind = cfg.layer_kinds[layer]
    index = kind_index(cfg.layer_kinds, layer)  # the layer's row of its kind's caches
    k_cache, v_cache = (caches[name] for name in CACHES[kind])
    num_rows, heads, kv_heads, head_dim = normed.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query = F.linear(normed, weights[prefix + "q_proj"], weights[prefix + "q_bias"]).view(num_rows, heads, head_dim)
    key = F.linear(normed, weights[prefix + "k_proj"], weights[prefix + "k_bias"]).view(num_rows, kv_heads, head_dim)
    value = F.linear(normed, weights[prefix + "v_proj"], weights[prefix + "v_bias"]).view(num_rows, kv_heads,
                                                                                          head_dim)
    cos, sin_signed = rope
    query, key = rotate_half_rope(query, cos, sin_signed), rotate_half_rope(key, cos, sin_signed)
    windowed = kind == "sliding"
    write_rows(k_cache, index, rows, key, paged=True, window=windowed)  # the sliding layers' pool: their own tables
    write_rows(v_cache, index, rows, value, paged=True, window=windowed)
    sinks = weights[prefix + "sinks"]
    if plans[kind] is None:  # packed prompt chunks (rows.segments)
        attended = packed_attention(query, k_cache[index], v_cache[index], rows,
                                    cfg.sliding_window if windowed else None, cfg.scale, sinks,
                                    cfg.window_cells if windowed else None)
    else:
        attended = cached_attention(query, k_cache, v_cache, index, plans[kind], sinks)  # [R, q_width]
    return row_linear(attended, weights[prefix + "o_proj"], weights[prefix + "o_bias"], cfg.row_blocks,
                      cfg.row_shard)  # [R, d_model]


def _experts(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
    """The layer's routed experts, each reading its own row of the stacked expert tensors; only ``valid`` rows are
    routed (a static-shape graph's padding rows run no expert)."""
    prefix = f"layers.{layer}."

    def expert_weights(expert: int) -> tuple[torch.Tensor, ...]:
        return tuple(weights[f"{prefix}experts.{name}"][expert]
                     for name in ("gate_up", "gate_up_bias", "down", "down_bias"))

    mlp = partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return routed_experts(weights, prefix, cfg.moe, normed, expert_weights, mlp, valid)


def gpt_oss_decoder(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, rows: Rows,
                    caches: Mapping[str, torch.Tensor], parallel=None) -> torch.Tensor:
    """GPT-OSS: final-normed hidden ``[R, d_model]`` (``graphs.Decoder``).

    ``parallel`` (a ``recipes.sharding.TensorParallel``): the weights are one rank's shards (its query and KV heads
    with their sinks and biases, its columns of every expert, its vocabulary rows); the embedding is
    vocabulary-parallel and each attention and expert output is a partial sum that ``parallel.reduce`` adds over
    the ranks before the residual add (the o and down biases are on rank 0 only)."""
    plans = planned_rows(cfg, weights, rows, caches)
    token_ids = input_ids.clamp(0, cfg.vocab_size - 1)  # padding ids may be anything
    embed = weights["embed"]
    hidden = F.embedding(token_ids, embed) if parallel is None else parallel.embed(token_ids, embed)  # [R, d_model]
    reduce = (lambda partial: partial) if parallel is None else parallel.reduce
    cos, sin = rope_cos_sin(cfg.rope, rows.positions, hidden.dtype)  # [R, 1, head_dim] each
    rope = (cos, signed_sin(sin))
    eps = cfg.rms_norm_eps
    for layer in range(cfg.num_layers):
        prefix = f"layers.{layer}."
        normed = gpt_oss_rms_norm(hidden, weights[prefix + "attn_norm"], eps)
        hidden = hidden + reduce(_attention(weights, cfg, layer, normed, rope, rows, plans, caches))
        normed = gpt_oss_rms_norm(hidden, weights[prefix + "mlp_norm"], eps)
        hidden = hidden + reduce(_experts(weights, cfg, layer, normed, rows.valid))
    hidden = gpt_oss_rms_norm(hidden, weights["final_norm"], eps)
    return hidden


__all__ = ["clamped_swiglu", "gpt_oss_decoder", "gpt_oss_rms_norm"]
