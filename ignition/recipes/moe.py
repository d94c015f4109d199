"""Mixture-of-experts feed-forward: routing computed in the graph, experts read as stored.

Three routers, chosen by name from ``ROUTERS`` (a table, read once when the graph is built):

* ``softmax_topk`` (Qwen3-MoE): fp32 softmax of the router logits, top-k, optionally
  renormalised (``norm_topk_prob``), cast to the model dtype;
* ``topk_softmax`` (GPT-OSS): router logits with a bias, top-k of the logits, then a softmax of the
  k picked logits in the model dtype;
* ``grouped_sigmoid_topk`` (DeepSeek-V3): fp32 sigmoid scores; the choice adds
  ``e_score_correction_bias``, keeps the ``topk_group`` groups whose two best scores sum
  highest, then the top-k experts inside them; the weights are the *uncorrected* scores,
  optionally renormalised, times ``routed_scaling_factor``.

The experts are the checkpoint's own per-expert tensors (stored once, never stacked or
transposed), and each runs **only on the rows routed to it** (sorted token dispatch): the R*k
(row, expert) assignments are sorted by expert (stable, so rows ascend within an expert), which
gives every expert one contiguous segment of the sorted order. Graphs are static, so an expert's
segment is padded to the smallest capacity of a fixed ladder (``capacities``) that holds it, and
the choice is made in the graph by ``torch.cond`` on the segment's length: an expert no row picked
runs nothing and reads none of its weights, an expert with ``n`` rows runs GEMMs of about
``max(MIN_CAPACITY, CAPACITY_STEP * n)`` rows at most (1 row when ``n`` is 1). Padding rows add
exact zeros (``torch.where``, so even a non-finite result of a padding row cannot leak). Results
are added into the output in ascending expert order, like transformers' per-expert ``index_add_``.

Why not the alternatives (torch 2.13): slicing each segment at its data-dependent length puts
unbacked symbolic sizes in the program, which the safe ``.pt2`` reader rejects; ``torch._grouped_mm``
needs the experts stacked into one tensor and its export (meta) kernel accepts only bfloat16.

NOTE: the conds read their predicate on the host. On CUDA that is a synchronisation per expert,
and a graph holding them cannot be captured as a CUDA graph (``runtime/graphs.py`` replays it
eagerly and says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

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
                       hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: the picked experts ``[R, k]`` (int64) and their weights ``[R, k]`` in the model dtype."""
    router_logits = F.linear(hidden, weights[prefix + "router"])  # [R, E], model dtype
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top_values, top_experts = torch.topk(probs, moe.experts_per_token, dim=-1)  # [R, k]
    if moe.norm_topk_prob:
        top_values = top_values / top_values.sum(dim=-1, keepdim=True)
    return top_experts, top_values.to(router_logits.dtype)


def route_grouped_sigmoid_topk(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig,
                               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (group-limited, bias-corrected choice): the picked experts ``[R, k]`` and fp32 weights."""
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
    return top_experts, top_values * moe.routed_scaling_factor


def route_topk_softmax(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig,
                       hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: the top-k experts of the biased router logits ``[R, k]`` and the softmax of their logits
    (in the model dtype, as transformers' ``GptOssTopKRouter``)."""
    router_logits = F.linear(hidden, weights[prefix + "router"], weights[prefix + "router_bias"])  # [R, E]
    top_logits, top_experts = torch.topk(router_logits, moe.experts_per_token, dim=-1)  # [R, k]
    return top_experts, torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)


Router = Callable[[Mapping[str, torch.Tensor], str, MoeConfig, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ROUTERS: dict[str, Router] = {
    "softmax_topk": route_softmax_topk,
    "grouped_sigmoid_topk": route_grouped_sigmoid_topk,
    "topk_softmax": route_topk_softmax,
}
"""Router name -> ``(weights, layer prefix, moe, normed hidden [R, d]) -> (experts [R, k] int64, weights [R, k])``."""


MIN_CAPACITY = 8  # rows: the shortest padded rung above the 1-row one
CAPACITY_STEP = 2  # each rung of the ladder holds this many times the rows of the one below


def capacities(rows: int) -> tuple[int, ...]:
    """The static row capacities, ascending, an expert's segment is padded to in a graph of ``rows`` rows.

    The top rung is ``rows`` (an expert appears at most once per row, so it always fits); each rung
    below holds ``1 / CAPACITY_STEP`` of the one above, down to ``MIN_CAPACITY``; the bottom rung is
    1 row, a GEMV, the common case in decode (8 lanes pick 64 experts of 128, most of them once)."""
    ladder = [rows]
    while ladder[-1] // CAPACITY_STEP >= MIN_CAPACITY:
        ladder.append(ladder[-1] // CAPACITY_STEP)
    return tuple(reversed(ladder + [1] if rows > 1 else ladder))


@dataclass(frozen=True, slots=True)
class Dispatch:
    """The R*k (row, expert) assignments sorted by expert: expert e owns ``[starts[e], starts[e] + counts[e])``."""

    rows: torch.Tensor  # int64 [R*k]: the row of each sorted assignment (ascending within an expert)
    weights: torch.Tensor  # [R*k]: its routing weight
    starts: torch.Tensor  # int64 [E]
    counts: torch.Tensor  # int64 [E]

    @classmethod
    def sort(cls, top_experts: torch.Tensor, top_weights: torch.Tensor, num_experts: int,
             valid: torch.Tensor | None = None) -> Dispatch:
        """``valid`` (bool ``[R]``): rows that are routed at all; the others' assignments sort after every
        expert's segment and no expert counts them (padding rows of a static-shape graph run no expert)."""
        flat = top_experts.reshape(-1)  # [R*k]
        if valid is not None:  # an unrouted row's assignments go to a bin past the last expert
            flat = torch.where(valid.repeat_interleave(top_experts.shape[1]), flat, num_experts)
        position = torch.arange(flat.shape[0], device=flat.device)
        # NOTE: distinct keys make any sort stable; ONNX has no stable sort (aten.sort.stable)
        order = torch.argsort(flat * flat.shape[0] + position)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add(
            0, flat, torch.ones_like(flat))[:num_experts]
        return cls(rows=order // top_experts.shape[1], weights=top_weights.reshape(-1)[order],
                   starts=torch.cumsum(counts, 0) - counts, counts=counts)


# The operands every branch of an expert's dispatch takes (torch.cond passes them positionally): out, hidden, rows,
# weights, start, count, then the expert's own tensors; each branch returns a 1-tuple, the form torch.onnx's
# converter of a cond's outputs expects.
_COUNT = 5  # the segment length's position among them


def _run_segment(capacity: int, mlp, out, hidden, rows, weights, start, count, *expert) -> tuple[torch.Tensor]:
    """One expert (``mlp(rows [C, d_model], *expert)``) on its segment padded to ``capacity`` rows; adds the
    weighted results into ``out``."""
    slot = torch.arange(capacity, device=hidden.device)
    index = (start + slot).clamp(max=rows.shape[0] - 1)  # [C]: positions in the sorted assignments
    row = rows[index]  # [C]: padding slots hold later experts' rows
    result = (mlp(hidden[row], *expert) * weights[index, None]).to(out.dtype)  # [C, d_model]
    return (out.index_add(0, row, torch.where((slot < count)[:, None], result, 0)),)


# NOTE: the cond operator itself, not ``torch.cond``: the latter traces every call with dynamo, which
# makes torch.export 2.4-4x slower per expert (measured); both record the same ``higher_order.cond`` node.
def _choose(capacity: int, fits, larger, *operands) -> tuple[torch.Tensor]:
    return torch.ops.higher_order.cond(operands[_COUNT] <= capacity, fits, larger, operands)


def _skip(out, *_) -> tuple[torch.Tensor]:
    return (out.clone(),)  # a branch may not return its input


def _ladder(rows: int, mlp):
    """The routed branch: the smallest capacity that holds the segment, chosen by nested conds."""
    ladder = capacities(rows)
    branch = partial(_run_segment, ladder[-1], mlp)
    for capacity in reversed(ladder[:-1]):
        branch = partial(_choose, capacity, partial(_run_segment, capacity, mlp), branch)
    return branch


def moe_block(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Routed experts (each on its own rows, sorted dispatch) plus shared experts; ``[R, d_model]``."""
    def expert_weights(expert: int) -> tuple[torch.Tensor, ...]:
        name = f"{prefix}experts.{expert}."
        return weights[name + "gate_proj"], weights[name + "up_proj"], weights[name + "down_proj"]

    out = routed_experts(weights, prefix, moe, hidden, expert_weights, gated_mlp)
    if moe.num_shared_experts:
        out = out + gated_mlp(hidden, weights[prefix + "shared.gate_proj"], weights[prefix + "shared.up_proj"],
                              weights[prefix + "shared.down_proj"])
    return out


def routed_experts(weights: Mapping[str, torch.Tensor], prefix: str, moe: MoeConfig, hidden: torch.Tensor,
                   expert_weights: Callable[[int], tuple[torch.Tensor, ...]],
                   mlp: Callable[..., torch.Tensor], valid: torch.Tensor | None = None) -> torch.Tensor:
    """The routed part of an MoE block: ``moe.router``'s choice, then each expert ``mlp(rows, *expert_weights(e))``
    on the rows routed to it (sorted dispatch), weighted and added in ascending expert order; ``[R, d_model]``.
    ``valid`` (bool ``[R]``): only these rows run experts (``Dispatch.sort``); the others' outputs are zero."""
    top_experts, top_weights = ROUTERS[moe.router](weights, prefix, moe, hidden)  # [R, k] each
    assigned = Dispatch.sort(top_experts, top_weights, moe.num_experts, valid)
    routed = _ladder(hidden.shape[0], mlp)
    out = torch.zeros_like(hidden)
    for expert in range(moe.num_experts):  # ascending, like HF's index_add_ per expert
        count = assigned.counts[expert]
        out = torch.ops.higher_order.cond(
            count > 0, routed, _skip,
            (out, hidden, assigned.rows, assigned.weights, assigned.starts[expert], count, *expert_weights(expert)))[0]
    return out


def feed_forward(weights: Mapping[str, torch.Tensor], cfg, layer: int, normed: torch.Tensor) -> torch.Tensor:
    """The layer's MLP: an MoE block on ``cfg.moe_layers``, else the dense SiLU MLP (with biases if any)."""
    prefix = f"layers.{layer}."
    if layer in cfg.moe_layers:
        return moe_block(weights, prefix, cfg.moe, normed)
    bias = (lambda name: weights[prefix + name]) if cfg.mlp_bias else (lambda name: None)
    return gated_mlp(normed, weights[prefix + "gate_proj"], weights[prefix + "up_proj"], weights[prefix + "down_proj"],
                     bias("gate_bias"), bias("up_bias"), bias("down_bias"), cfg.row_blocks, cfg.row_shard)
