"""Gated DeltaNet linear attention (Qwen3.5) over a per-slot convolution state and recurrent state.

A ``linear`` layer (``catalog/cache_kinds.py``) keeps no KV cache. Per slot it keeps the last ``conv_kernel - 1``
inputs of its causal depthwise convolution (``conv_state [linear_layers, num_slots, conv_dim, conv_kernel - 1]``) and
the delta rule's ``[heads, key_dim, value_dim]`` matrix (``recurrent_state [linear_layers, num_slots, heads, key_dim,
value_dim]``), the first in the model dtype, the second in FP32 as transformers keeps it. A forward's rows are G
groups of ``R // G`` rows, each group one slot's consecutive positions (``Rows``: a prompt chunk is one group, a
decode step one group a lane, packed prompt chunks one group a lane: ``packed_lanes``); valid rows are a prefix of
their group. For each group the layer:

1. reads its slot's two states (one slot's cells, a copy of ``G`` slots' states, never the whole state), or zeros
   when the group's first row is position 0 (a new sequence starts from nothing, as transformers' fresh cache);
2. convolves the slot's conv state followed by the group's inputs (transformers' ``causal_conv1d_update`` form);
3. runs the gated delta rule from the slot's recurrent state: the recurrent form for one row a group (a decode
   step, transformers' ``torch_recurrent_gated_delta_rule``), the chunked form for more
   (``torch_chunk_gated_delta_rule``, its triangular system solved by ``torch.linalg.solve_triangular``; blocks of
   ``CHUNK_ROWS``, or one block where the rows are a dynamic window). Rows past a group's valid prefix get a decay
   of 1 and a learning rate of 0, so they leave the state as it was;
4. writes the new states of groups with a valid row back in place (``write_slot_states``): the conv state holds the
   last ``conv_kernel - 1`` valid inputs, the recurrent state the rule's final matrix. Verify rows (each a decode
   step) run the recurrent form keeping the states after every row; the verify graph writes, once the round has
   accepted its drafts, each lane's states after its last accepted row (``ACCEPTED_STATES``): the rejected rows'
   updates are never written, so rolling back copies nothing.

The ops mirror transformers' eager ones (FP32 rule, L2-normed queries and keys scaled by ``key_dim ** -0.5``,
the gated RMSNorm in FP32); nothing branches on tensor values, so the forms export with ``torch.export``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ignition.recipes.layers import Rows

CHUNK_ROWS = 64
"""Rows of one block of the chunked delta rule at a static row count (transformers' ``chunk_size``); a shorter group
is one block, and so is a dynamic row count."""

L2_EPS = 1e-6
"""The epsilon of the delta rule's query and key L2 norms (transformers' ``l2norm``, matching the FLA library)."""


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (transformers' ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor):
    """``[G, P, heads, dim]`` inputs (``[G, P, heads]`` for decay and beta) as FP32 ``[G, heads, P, ...]``, queries and
    keys repeated over their value heads, L2-normed, the queries scaled by ``key_dim ** -0.5``."""
    key_heads, value_heads = key.shape[2], value.shape[2]
    if key_heads != value_heads:  # each query/key head serves value_heads // key_heads consecutive value heads
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    # NOTE: contiguous, not ``to(memory_format=...)`` (a no-op on an FP32 view): a batched product of strided
    # operands rounds differently with the batch's size, and a lane must not depend on the lanes packed with it
    query, key, value, beta, decay = (x.transpose(1, 2).to(torch.float32).contiguous()
                                      for x in (query, key, value, beta, decay))
    query, key = l2_normalize(query), l2_normalize(key)
    return query * query.shape[-1] ** -0.5, key, value, decay, beta


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor,
                               every_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one row after another from ``state [G, heads, key_dim, value_dim]`` (FP32): per row the state
    decays by ``exp(decay)``, learns ``beta * (v - S^T k)`` along ``k`` and is read by the query. Inputs as
    ``chunk_gated_delta_rule``'s; returns (``[G, P, heads, value_dim]`` in the query's dtype, the final state, or
    with ``every_state`` the state after each row ``[G, P, heads, key_dim, value_dim]``)."""
    dtype = query.dtype
    query, key, value, decay, beta = _prepare(query, key, value, decay, beta)
    outputs, states = [], []
    for row in range(query.shape[2]):  # a static count: the group's rows
        state = state * decay[:, :, row].exp()[..., None, None]
        remembered = (state * key[:, :, row].unsqueeze(-1)).sum(dim=-2)  # [G, heads, value_dim]
        delta = (value[:, :, row] - remembered) * beta[:, :, row].unsqueeze(-1)
        state = state + key[:, :, row].unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * query[:, :, row].unsqueeze(-1)).sum(dim=-2))
        states.append(state)
    return torch.stack(outputs, dim=1).to(dtype), torch.stack(states, dim=1) if every_state else state


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_rows: int | None = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over blocks of ``chunk_rows`` rows from ``state [G, heads, key_dim, value_dim]`` (FP32):
    within a block the rows' updates are one triangular solve (the UT transform), across blocks a scan.

    ``query``/``key [G, P, key_heads, key_dim]``, ``value [G, P, heads, value_dim]``, ``decay``/``beta [G, P,
    heads]`` (log-space decay <= 0, learning rate); ``chunk_rows`` None: one block of all P rows (a symbolic P has
    no static block count). Returns (``[G, P, heads, value_dim]`` in the query's dtype, the final state)."""
    dtype, rows = query.dtype, query.shape[1]
    query, key, value, decay, beta = _prepare(query, key, value, decay, beta)
    block = rows if chunk_rows is None else min(chunk_rows, rows)
    pad = 0 if chunk_rows is None else (block - rows % block) % block
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    groups, heads = query.shape[:2]
    blocks = (rows + pad) // block
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(groups, heads, blocks, block, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    cum_decay = decay.reshape(groups, heads, blocks, block).cumsum(dim=3)  # [G, heads, blocks, block]
    index = torch.arange(block, device=query.device)
    upper = index.view(1, -1) > index.view(-1, 1)  # [block, block]: the later rows a row may not see
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise  # [G, heads, blocks, block, block], lower triangle
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    state = state.to(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    block_decay = cum_decay[..., -1].exp()[..., None, None]  # [G, heads, blocks, 1, 1]
    outputs = []
    for index in range(blocks):  # a static count: the group's rows over the block
        v_new = new_values[:, :, index] - k_cumdecay[:, :, index] @ state
        outputs.append(query[:, :, index] @ state + intra[:, :, index] @ v_new)
        state = state * block_decay[:, :, index] + key[:, :, index].transpose(-1, -2) @ v_new
    attended = torch.cat(outputs, dim=2)[:, :, :rows]  # [G, heads, P, value_dim]
    return attended.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def causal_conv(inputs: torch.Tensor, conv_in: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution of ``conv_in [G, channels, kernel - 1]`` followed by ``inputs
    [G, P, channels]`` (transformers' ``causal_conv1d_update``): ``([G, P, channels], the joined sequence
    [G, channels, kernel - 1 + P])``, whose window ending at a group's last valid row is its next conv state."""
    joined = torch.cat([conv_in, inputs.transpose(1, 2).to(conv_in.dtype)], dim=2)
    out = F.conv1d(joined.to(weight.dtype), weight, groups=weight.shape[0])  # [G, channels, P]
    return F.silu(out).transpose(1, 2).to(inputs.dtype), joined


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' ``RMSNormGated``: normalise in FP32, scale in the input dtype, times SiLU of the FP32 gate."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.to(torch.float32))).to(x.dtype)


def group_view(rows: Rows) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``(G, P, slots [G] clamped by the caller, fresh [G])`` of the rows: G groups of P consecutive positions;
    ``fresh`` where a group's first row is position 0."""
    groups = rows.read_slots.shape[0]
    per_group = rows.positions.shape[0] // groups
    return groups, per_group, rows.read_slots, rows.positions.view(groups, per_group)[:, 0] == 0


def write_slot_states(state: torch.Tensor, layer: int, slots: torch.Tensor, live: torch.Tensor,
                      new: torch.Tensor) -> None:
    """``state[layer, slots[g]] = new[g]`` for groups with a valid row (``live``), in one ``index_copy_``.

    A group without one repeats the first live group's write (same cell, same value); with none live, every group
    rewrites group 0's cell with its old value. Duplicate targets thus carry identical values and the result never
    depends on write order (``layers.write_rows``' rule, for one cell a slot)."""
    groups, num_slots = slots.shape[0], state.shape[1]
    first_live = torch.argmax(live.to(torch.int32))
    source = torch.where(live, torch.arange(groups, device=slots.device), first_live)  # [G]
    cells = layer * num_slots + slots.index_select(0, source)  # [G]
    flat = state.view(-1, *state.shape[2:])  # [layers * slots, ...]: every slot's state, a view
    keep = live.index_select(0, source).view(-1, *([1] * (new.dim() - 1)))
    flat.index_copy_(0, cells, torch.where(keep, new.index_select(0, source).to(state.dtype),
                                           flat.index_select(0, cells)))


ACCEPTED_STATES = "accepted_states"
"""``Rows.plans`` key of the writes a verify forward leaves for its acceptance: callables of the tokens each lane
emitted (``int64 [G]``), which keep each lane's states after its last accepted row (``recipes/graphs.py``
``VerifyGraph``)."""


def _keep_accepted(conv_state: torch.Tensor, recurrent_state: torch.Tensor, row: int, slots: torch.Tensor,
                   live: torch.Tensor, emitted: torch.Tensor, conv_every: torch.Tensor, every: torch.Tensor) -> None:
    """A verify lane that emitted ``n`` tokens consumed its rows ``0..n-1`` (its last position and the ``n - 1``
    accepted drafts): its states after row ``n - 1`` are its slot's; rejected rows' states are dropped."""
    groups = slots.shape[0]
    last = (emitted - 1).clamp(0, every.shape[1] - 1)  # [G]
    lane = torch.arange(groups, device=slots.device)
    write_slot_states(conv_state, row, slots, live, conv_every[lane, last])
    write_slot_states(recurrent_state, row, slots, live, every[lane, last])


def packed_lanes(rows: Rows) -> tuple[Rows, torch.Tensor]:
    """Packed prompt chunks (``rows.segments``) regrouped as one group of ``E`` rows a lane, ``E`` the segment
    window's extent (at least the longest segment): lane b's segment is its group's valid prefix, from position
    ``starts[b]`` of its slot, so each lane runs the operations of a prefill chunk alone and all lanes run in one
    call. Returns (the grouped rows, the packed row each of the ``lanes * E`` grouped rows reads); the packed rows
    take theirs back through ``segments.row_source``. A grouped row past its segment reads another row (its output
    is dropped, its inputs change no state)."""
    segments, packed_rows = rows.segments, rows.positions.shape[0]
    extent = segments.extent.shape[0]
    local = torch.arange(extent, device=rows.positions.device)
    slots = rows.read_slots.unsqueeze(1).expand(-1, extent).reshape(-1)  # [lanes * E]
    grouped = Rows(positions=(segments.starts.unsqueeze(1) + local).reshape(-1), write_slots=slots,
                   valid=(local < segments.lengths.unsqueeze(1)).reshape(-1), read_slots=rows.read_slots)
    return grouped, (segments.offsets.unsqueeze(1) + local).clamp(max=packed_rows - 1).reshape(-1)


def gated_delta_net(weights: Mapping[str, torch.Tensor], cfg, layer: int, row: int, normed: torch.Tensor,
                    rows: Rows, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s Gated DeltaNet over ``normed [R, d_model]``: its states are row ``row`` of the linear
    layers' ``conv_state`` and ``recurrent_state`` (updated in place). Returns ``[R, d_model]``. The projections,
    the gated norm and the output projection run over the R rows; packed prompt chunks run the convolution and the
    rule as one group a lane (``packed_lanes``), each from its own slot's states, all lanes in one call."""
    prefix = f"layers.{layer}."
    num_rows, heads, value_dim = normed.shape[0], cfg.linear_heads, cfg.linear_value_dim
    mixed = F.linear(normed, weights[prefix + "in_proj_qkv"])  # [R, conv_dim]
    gate = F.linear(normed, weights[prefix + "in_proj_z"]).view(num_rows, heads, value_dim)
    b = F.linear(normed, weights[prefix + "in_proj_b"])  # [R, heads]
    a = F.linear(normed, weights[prefix + "in_proj_a"])
    if rows.segments is None:
        attended = _mix(weights, cfg, prefix, row, rows, mixed, b, a, conv_state, recurrent_state)
    else:  # packed rows -> [lanes * E] grouped rows -> back
        grouped, gather = packed_lanes(rows)
        mixed, b, a = (x.index_select(0, gather) for x in (mixed, b, a))
        attended = _mix(weights, cfg, prefix, row, grouped, mixed, b, a, conv_state, recurrent_state)
        attended = attended.index_select(0, rows.segments.row_source)
    attended = gated_rms_norm(attended, gate, weights[prefix + "norm"], cfg.rms_norm_eps)
    return F.linear(attended.reshape(num_rows, heads * value_dim), weights[prefix + "out_proj"])  # [R, d_model]


def _mix(weights: Mapping[str, torch.Tensor], cfg, prefix: str, row: int, rows: Rows, mixed: torch.Tensor,
         b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
         recurrent_state: torch.Tensor) -> torch.Tensor:
    """The convolution and the delta rule of ``rows``' G groups over their projected rows (``mixed [R, conv_dim]``,
    ``b``/``a [R, heads]``), from and to the groups' slot states: ``[R, heads, value_dim]``."""
    num_rows = mixed.shape[0]
    groups, per_group, slots, fresh = group_view(rows)
    slots = slots.clamp(0, conv_state.shape[1] - 1)
    valid = rows.valid.view(groups, per_group)
    key_heads, key_dim = cfg.linear_key_heads, cfg.linear_key_dim
    heads, value_dim = cfg.linear_heads, cfg.linear_value_dim
    conv_in = conv_state[row].index_select(0, slots)  # [G, conv_dim, kernel - 1]
    conv_in = torch.where(fresh.view(-1, 1, 1), torch.zeros_like(conv_in), conv_in)
    mixed, joined = causal_conv(mixed.view(groups, per_group, -1), conv_in, weights[prefix + "conv"])
    lengths = valid.sum(1)  # [G]: each group's valid rows (a prefix)
    window = lengths.view(-1, 1) + torch.arange(conv_in.shape[2], device=lengths.device)  # [G, kernel - 1]
    conv_next = joined.gather(2, window.unsqueeze(1).expand(-1, joined.shape[1], -1))

    query, key, value = mixed.split([key_heads * key_dim, key_heads * key_dim, heads * value_dim], dim=-1)
    query = query.reshape(groups, per_group, key_heads, key_dim)
    key = key.reshape(groups, per_group, key_heads, key_dim)
    value = value.reshape(groups, per_group, heads, value_dim)
    beta = b.sigmoid().view(groups, per_group, heads)
    decay = (-weights[prefix + "A_log"].float().exp() * F.softplus(a.float() + weights[prefix + "dt_bias"]))
    decay = decay.view(groups, per_group, heads)
    still = ~valid.unsqueeze(-1)  # rows past a group's prefix: no decay, nothing learnt
    beta, decay = beta.masked_fill(still, 0), decay.masked_fill(still, 0)
    start = recurrent_state[row].index_select(0, slots).to(torch.float32)  # [G, heads, key_dim, value_dim]
    start = torch.where(fresh.view(-1, 1, 1, 1), torch.zeros_like(start), start)
    live = valid.any(1)
    if rows.row_forwards:  # verify rows: the states after every row, the accepted one kept after acceptance
        attended, every = recurrent_gated_delta_rule(query, key, value, decay, beta, start, every_state=True)
        after = torch.arange(per_group, device=lengths.device).view(-1, 1) + 1 + torch.arange(
            conv_in.shape[2], device=lengths.device)  # [P, kernel - 1]: the conv inputs after each row
        conv_every = joined[:, :, after].permute(0, 2, 1, 3)  # [G, P, conv_dim, kernel - 1]
        rows.plans.setdefault(ACCEPTED_STATES, []).append(lambda emitted: _keep_accepted(
            conv_state, recurrent_state, row, slots, live & (emitted > 0), emitted, conv_every, every))
        return attended.reshape(num_rows, heads, value_dim)
    if per_group == 1:  # a decode step
        attended, final = recurrent_gated_delta_rule(query, key, value, decay, beta, start)
    else:  # NOTE: a dynamic row count (a windowed chunk) has no static block count to scan: one block of them all
        chunk_rows = CHUNK_ROWS if isinstance(per_group, int) else None
        attended, final = chunk_gated_delta_rule(query, key, value, decay, beta, start, chunk_rows)
    write_slot_states(conv_state, row, slots, live, conv_next)
    write_slot_states(recurrent_state, row, slots, live, final)
    return attended.reshape(num_rows, heads, value_dim)
