"""Mixture-of-experts feed-forward: routing computed in the graph, experts read as stored.

Two routers, chosen by name from ``ROUTERS`` (a table, read once when the graph is built):

* ``softmax_topk`` (Qwen3-MoE): fp32 softmax of the router logits, top-k, optionally
  renormalised (``norm_topk_prob``), cast to the model dtype;
* ``grouped_sigmoid_topk`` (DeepSeek-V3): fp32 sigmoid scores; the choice adds
  ``e_score_correction_bias``, keeps the ``topk_group`` groups whose two best scores sum
  highest, then the top-k experts inside them; the weights are the *uncorrected* scores,
  optionally renormalised, times ``routed_scaling_factor``.

The experts are the checkpoint's own per-expert tensors (stored once, never stacked or
transposed). The plain batched implementation runs **every expert on every row** and weights
each result by the row's dense routing weight (zero for experts it did not pick), summing in
ascending expert order like transformers' ``index_add_``. Its cost, per MoE layer and row:
``num_experts / experts_per_token`` times the FLOPs of sparse dispatch, and every expert's
weights are read on every call; see docs/api.md ("Mixture of experts").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ignition.recipes.checkpoint import CheckpointError
from ignition.recipes.layers import gated_mlp


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Routed (and shared) experts of a decoder; ``sparse_layers`` are the layers whose MLP is an MoE block."""

    router: str
    num_experts: int
    experts_per_token: int
    intermediate_size: int  # per expert (HF moe_intermediate_size)
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise CheckpointError(f"MoeConfig.router must be one of {sorted(ROUTERS)}; found {self.router!r}")
        for name in ("num_experts", "experts_per_token", "intermediate_size", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"MoeConfig.{name} must be a positive int; found {value!r}")
        if self.num_shared_experts < 0 or not self.routed_scaling_factor > 0:
            raise CheckpointError(f"MoeConfig needs num_shared_experts >= 0 and routed_scaling_factor > 0; found "
                                  f"{self.num_shared_experts!r}, {self.routed_scaling_factor!r}")

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups


def check_routing(moe: MoeConfig, source: str, fields: Mapping[str, str]) -> None:
    """Reject routing geometry the HF model cannot run; ``fields`` maps our names to the HF field names."""
    def fail(name: str, rule: str, found) -> None:
        raise CheckpointError(f"{source}: field {fields[name]!r} {rule}; found {found!r}")

    if moe.num_experts % moe.num_groups:
        fail("num_groups", f"must divide {fields['num_experts']}={moe.num_experts}", moe.num_groups)
    if moe.num_groups > 1 and moe.experts_per_group < 2:
        fail("num_groups", "must leave at least 2 experts per group (groups are scored by their top 2)",
             moe.num_groups)
    if moe.topk_groups > moe.num_groups:
        fail("topk_groups", f"must be <= {fields['num_groups']}={moe.num_groups}", moe.topk_groups)
    if moe.experts_per_token > moe.topk_groups * moe.experts_per_group:
        fail("experts_per_token", f"must be <= the {moe.topk_groups * moe.experts_per_group} experts of the "
             f"selected groups", moe.experts_per_token)


def route_softmax_topk(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig,
                       hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE routing: dense weights ``[R, num_experts]`` in the model dtype (zero for unpicked experts)."""
    router_logits = F.linear(hidden, weights[prefix + "router"])  # [R, E], model dtype
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top_values, top_experts = torch.topk(probs, moe.experts_per_token, dim=-1)  # [R, k]
    if moe.norm_topk_prob:
        top_values = top_values / top_values.sum(dim=-1, keepdim=True)
    top_values = top_values.to(router_logits.dtype)
    return torch.zeros_like(router_logits).scatter(1, top_experts, top_values)


def route_grouped_sigmoid_topk(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig,
                               hidden: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 routing (group-limited, bias-corrected choice): dense fp32 weights ``[R, num_experts]``."""
    rows = hidden.shape[0]
    router_logits = F.linear(hidden.to(torch.float32), weights[prefix + "router"].to(torch.float32))  # [R, E]
    scores = router_logits.sigmoid()
    choice = scores + weights[prefix + "router_bias"]  # e_score_correction_bias steers the choice only
    grouped = choice.view(rows, moe.num_groups, moe.experts_per_group)
    group_scores = grouped.topk(min(2, moe.experts_per_group), dim=-1)[0].sum(dim=-1)  # [R, groups]
    top_groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, top_groups, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, moe.experts_per_group).reshape(rows, moe.num_experts)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    top_experts = torch.topk(choice, k=moe.experts_per_token, dim=-1, sorted=False)[1]  # [R, k]
    top_values = scores.gather(1, top_experts)
    if moe.norm_topk_prob:
        top_values = top_values / (top_values.sum(dim=-1, keepdim=True) + 1e-20)
    top_values = top_values * moe.routed_scaling_factor
    return torch.zeros_like(scores).scatter(1, top_experts, top_values)


Router = Callable[[Mapping[str, torch.Tensor], str, MoeConfig, torch.Tensor], torch.Tensor]
ROUTERS: dict[str, Router] = {
    "softmax_topk": route_softmax_topk,
    "grouped_sigmoid_topk": route_grouped_sigmoid_topk,
}
"""Router name -> function ``(weights, layer prefix, moe, normed hidden [R, d]) -> dense weights [R, E]``."""


def moe_block(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Routed experts (plain batched: every expert on every row) plus shared experts; ``[R, d_model]``."""
    routing = ROUTERS[moe.router](weights, prefix, moe, hidden)  # [R, E], zero where not routed
    out = torch.zeros_like(hidden)
    for expert in range(moe.num_experts):  # ascending, like HF's index_add_ per expert
        name = f"{prefix}experts.{expert}."
        expert_out = gated_mlp(hidden, weights[name + "gate_proj"], weights[name + "up_proj"],
                               weights[name + "down_proj"])  # [R, d_model]
        out = out + (expert_out * routing[:, expert:expert + 1]).to(out.dtype)
    if moe.num_shared_experts:
        out = out + gated_mlp(hidden, weights[prefix + "shared.gate_proj"], weights[prefix + "shared.up_proj"],
                              weights[prefix + "shared.down_proj"])
    return out


def feed_forward(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor) -> torch.Tensor:
    """The layer's MLP: an MoE block on ``cfg.moe_layers``, else the dense SiLU MLP (with biases if any)."""
    prefix = f"layers.{layer}."
    if layer in cfg.moe_layers:
        return moe_block(weights, prefix, cfg.moe, normed)
    bias = (lambda name: weights[prefix + name]) if cfg.mlp_bias else (lambda name: None)
    return gated_mlp(normed, weights[prefix + "gate_proj"], weights[prefix + "up_proj"], weights[prefix + "down_proj"],
                     bias("gate_bias"), bias("up_bias"), bias("down_bias"), cfg.row_blocks)
