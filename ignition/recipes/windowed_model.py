"""The forward plumbing the decoders with sliding-window layers share (``gemma3_model``, ``gpt_oss_model``): the
caches' trace-time check and each layer kind's attention plan. Both kinds' caches are pools of blocks (the full
layers' through ``block_tables``, the sliding layers' through ``window_block_tables``), read in lane order."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ignition.catalog.geometry import K_CACHE, K_WINDOW_CACHE, V_CACHE, V_WINDOW_CACHE
from ignition.recipes.attention import plan_attention
from ignition.recipes.layers import Rows

CACHES = {"full": (K_CACHE, V_CACHE), "sliding": (K_WINDOW_CACHE, V_WINDOW_CACHE)}
"""Each layer kind's K and V state buffers."""


def attention_plans(cfg, rows: Rows, caches: Mapping[str, torch.Tensor]) -> dict:
    """Each present kind's ``AttentionPlan`` (None for packed rows, which plan per call)."""
    plans = {}
    for kind in dict.fromkeys(cfg.layer_kinds):
        cache = caches[CACHES[kind][0]]
        plans[kind] = None if rows.segments is not None else plan_attention(
            rows, cache.shape[1], cache.shape[2], cfg.num_heads // cfg.num_kv_heads, cache.dtype,
            sliding=cfg.sliding_window if kind == "sliding" else None, scale=cfg.scale,
            window_cells=cfg.window_cells if kind == "sliding" else None)
    return plans


def check_caches(cfg, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> None:
    """Static (trace-time) check of every cache against ``cfg.cache_shapes`` and the weights' dtype."""
    for name in cfg.cache_names:
        cache = caches[name]
        # a pool: [layers, blocks, block_size, ...], of either group
        expected = cfg.cache_shapes(1, 1, cache.shape[2], cache.shape[1], cache.shape[1])[name]
        if tuple(cache.shape) != expected or cache.dtype != weights["embed"].dtype:
            raise ValueError(f"{name} must have shape {expected} and dtype {weights['embed'].dtype}; "
                             f"found {tuple(cache.shape)} {cache.dtype}")


def planned_rows(cfg, weights: Mapping[str, torch.Tensor], rows: Rows, caches: Mapping[str, torch.Tensor]) -> dict:
    """The caches checked (``check_caches``) and each present kind's plan (``attention_plans``)."""
    check_caches(cfg, weights, caches)
    return attention_plans(cfg, rows, caches)
