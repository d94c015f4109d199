"""The forward plumbing the decoders with sliding-window layers share (``gemma3_model``, ``gpt_oss_model``): the
caches' trace-time check, each layer kind's attention plan, and the decode lanes put in slot order (a decoder of
sliding layers alone: the full layers' pools are read through the block tables in lane order)."""

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
            sliding=cfg.sliding_window if kind == "sliding" else None, scale=cfg.scale)
    return plans


def check_caches(cfg, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> None:
    """Static (trace-time) check of every cache against ``cfg.cache_shapes`` and the weights' dtype."""
    for name in cfg.cache_names:
        cache = caches[name]
        paged = name in (K_CACHE, V_CACHE)  # a pool: [layers, kv_blocks, block_size, ...]; a ring: [layers, slots, ...]
        expected = cfg.cache_shapes(1, 1, cache.shape[2], cache.shape[1])[name] if paged else \
            cfg.cache_shapes(cache.shape[1], 1)[name]
        if tuple(cache.shape) != expected or cache.dtype != weights["embed"].dtype:
            raise ValueError(f"{name} must have shape {expected} and dtype {weights['embed'].dtype}; "
                             f"found {tuple(cache.shape)} {cache.dtype}")


def planned_rows(cfg, weights: Mapping[str, torch.Tensor], input_ids: torch.Tensor, rows: Rows,
                 caches: Mapping[str, torch.Tensor]):
    """The caches checked and planned; decode lanes attending in place put in slot order, the whole forward then
    running in it. Returns ``(rows, input_ids, plans, lane_slots)``: ``lane_slots`` (``[R]``, each lane's slot,
    where its row ends up) takes the final hidden back to lane order, None when nothing was rearranged."""
    check_caches(cfg, weights, caches)
    plans = attention_plans(cfg, rows, caches)
    first = next(iter(plans.values()))
    # NOTE: never with a full layer's pool: rows in slot order write a stand-in cell for every slot, and the table row
    # of a slot no lane owns may name any block, another lane's included (one cell, two values)
    paged = any(plan is not None and plan.cells is not None for plan in plans.values())
    order = None if first is None or paged else first.slot_order(rows)
    if order is None:
        return rows, input_ids, plans, None
    lane_slots = first.slots
    rows, input_ids = rows.in_slot_order(order), input_ids.index_select(0, order)
    plans = {kind: plan.in_slot_order(rows.read_slots) for kind, plan in plans.items()}
    return rows, input_ids, plans, lane_slots
