"""Functional DeepSeek V4 decoder: one step of one slot, op for op transformers' eager incremental forward.

A layer's hidden state is ``hc_mult`` streams (manifold-constrained hyper-connections: each block reads a
sigmoid-weighted sum of the streams and writes its output back through ``post`` and a Sinkhorn-normalized
``comb`` mix); attention is ``deepseek_v4_attention`` over the layer's cache kind; the MoE routes by
``sqrt(softplus)`` scores, top-k with a correction bias or by the ``tid2eid`` table on hash layers, with clamped
SwiGLU experts and one shared expert. The state is ``STATE_BUFFERS``'s tensors for the layer kinds present
(``catalog.geometry.STATE_SHAPES``), each layer at its index among the layers of its kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from ignition.catalog.cache_kinds import compressed_entries, kind_index, layer_counts, source_cells, window_cells
from ignition.catalog.geometry import (CSA_INDEX_CACHE, CSA_INDEX_SOURCE, CSA_KV_CACHE, CSA_SOURCE, CSA_WINDOW_CACHE,
                                       HCA_KV_CACHE, HCA_SOURCE, HCA_WINDOW_CACHE, SWA_KV_CACHE, state_shape)
from ignition.recipes.deepseek_v4_attention import (SlotCells, additive_mask, apply_rope, attend, compress_step,
                                                    entries_seen, indexer_choice, rms_norm, rope_cos_sin, window_keys)

STATE_BUFFERS: dict[str, dict[str, str]] = {
    "shared_window": {"window": SWA_KV_CACHE},
    "compressed": {"window": CSA_WINDOW_CACHE, "entries": CSA_KV_CACHE, "source": CSA_SOURCE,
                   "index_entries": CSA_INDEX_CACHE, "index_source": CSA_INDEX_SOURCE},
    "heavily_compressed": {"window": HCA_WINDOW_CACHE, "entries": HCA_KV_CACHE, "source": HCA_SOURCE},
}
"""Each layer kind's state buffers by role."""


def state_geometry(cfg, num_slots: int, max_seq_len: int, step_rows: int) -> dict[str, int]:
    """The manifest symbols of ``STATE_SHAPES``' DeepSeek V4 buffers for steps of at most ``step_rows`` rows."""
    return {"num_slots": num_slots, "head_dim": cfg.head_dim, "index_head_dim": cfg.index_head_dim,
            "window_cells": window_cells(cfg.sliding_window, step_rows, max_seq_len),
            "csa_entries": compressed_entries(max_seq_len, cfg.csa_rate),
            "hca_entries": compressed_entries(max_seq_len, cfg.hca_rate),
            "csa_source_cells": source_cells(cfg.csa_rate, step_rows, True),
            "hca_source_cells": source_cells(cfg.hca_rate, step_rows, False), **layer_counts(list(cfg.layer_kinds))}


def allocate_state(cfg, num_slots: int, max_seq_len: int, step_rows: int,
                   device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Zeroed state buffers of the layer kinds ``cfg`` has, in the model dtype."""
    geometry = state_geometry(cfg, num_slots, max_seq_len, step_rows)
    names = dict.fromkeys(name for kind in cfg.layer_kinds for name in STATE_BUFFERS[kind].values())
    return {name: torch.zeros(state_shape(name, **geometry), dtype=cfg.dtype, device=device) for name in names}


def check_step(cfg, caches: Mapping[str, torch.Tensor], start: int, rows: int, slot: int) -> None:
    """Refuse a step the state cannot hold, naming the buffer: each kind's buffers present with its layer count,
    ``head_dim`` wide, rings long enough for the positions a step reads before its own plus its rows (``rows``; a
    window ring of ``max_seq_len`` cells holds every position, ``catalog.cache_kinds.window_cells``), entry tables
    holding every window the step may close."""
    reads = {"window": cfg.sliding_window - 1, "source": 2 * cfg.csa_rate - 1, "index_source": 2 * cfg.csa_rate - 1}
    for kind in dict.fromkeys(cfg.layer_kinds):
        layers = cfg.layer_kinds.count(kind)
        rate = cfg.hca_rate if kind == "heavily_compressed" else cfg.csa_rate
        for role, name in STATE_BUFFERS[kind].items():
            cache = caches.get(name)
            if cache is None:
                raise ValueError(f"deepseek_v4 state: buffer {name!r} is required by the {kind!r} layers; found "
                                 f"only {sorted(caches)}")
            width = cfg.index_head_dim if role.startswith("index") else cfg.head_dim
            candidates = start // rate + (rows - 1) // rate + 1  # every window a step may write, stand-ins included
            least = {"window": reads["window"] + rows, "index_source": reads["index_source"] + rows,
                     "source": (rate - 1 if kind == "heavily_compressed" else reads["source"]) + rows,
                     "entries": candidates, "index_entries": candidates}[role]
            whole = role == "window" and start + rows <= cache.shape[2]  # a ring of every position: nothing wraps
            if cache.dim() < 4 or cache.shape[0] != layers or cache.shape[-1] != width \
                    or (cache.shape[2] < least and not whole) \
                    or not 0 <= slot < cache.shape[1] or cache.dtype != cfg.dtype:
                raise ValueError(f"deepseek_v4 state: buffer {name!r} must be [{layers} layers, slots > {slot}, "
                                 f">= {least} cells, ..., {width}] of {cfg.dtype} for {rows} rows from position "
                                 f"{start}; found {list(cache.shape)} {cache.dtype}")


def layer_state(cfg, caches: Mapping[str, torch.Tensor], layer: int, slot: torch.Tensor | int) -> dict[str, SlotCells]:
    """Layer ``layer``'s state buffers of slot ``slot`` by role, read and written in place cell by cell."""
    index = kind_index(cfg.layer_kinds, layer)
    return {role: SlotCells(caches[name][index], slot) for role, name in STATE_BUFFERS[cfg.layer_kinds[layer]].items()}


def attention(weights: Mapping[str, torch.Tensor], cfg, layer: int, x: torch.Tensor, positions: torch.Tensor,
              state: Mapping[str, SlotCells], valid: torch.Tensor | None = None, parallel=None) -> torch.Tensor:
    """transformers' ``DeepseekV4Attention``: ``x [R, hidden]`` of one slot's consecutive ``positions`` ->
    ``[R, hidden]``, reading and writing ``state`` (``layer_state``); ``valid``: the rows that write the rings
    (None: all; no valid row: the step writes nothing).

    ``parallel`` (a ``recipes.sharding.TensorParallel``): ``cfg`` and ``weights`` are one rank's (its query heads,
    sinks, output groups and index heads); the K=V rows, compressors and state are whole on every rank, and the
    result is this rank's partial sum of ``wo_b`` (the caller reduces it)."""
    prefix, kind, eps = f"layers.{layer}.", cfg.layer_kinds[layer], cfg.rms_norm_eps
    rows = x.shape[0]
    rope = cfg.main_rope if kind == "shared_window" else cfg.compress_rope
    cos, sin = rope_cos_sin(rope, positions, x.dtype)
    q_residual = rms_norm(F.linear(x, weights[prefix + "wq_a"]), weights[prefix + "q_norm"], eps)
    query = F.linear(q_residual, weights[prefix + "wq_b"]).view(rows, cfg.num_heads, cfg.head_dim)
    query = apply_rope(rms_norm(query, None, eps), cos, sin)  # [R, H, D]
    kv = rms_norm(F.linear(x, weights[prefix + "wkv"]), weights[prefix + "kv_norm"], eps)
    kv = apply_rope(kv.unsqueeze(1), cos, sin).squeeze(1)  # [R, D]: key and value
    keys, mask = window_keys(state["window"], kv, positions, cfg.sliding_window, valid)
    if kind != "shared_window":
        csa = kind == "compressed"
        rate = cfg.csa_rate if csa else cfg.hca_rate
        compress_step(weights, prefix + "compressor.", x, positions, state["source"], state["entries"], rate, csa,
                      cfg.compress_rope, eps, valid)
        seen = entries_seen(positions, state["entries"].cells, rate)  # [R, extent]
        if csa:
            compress_step(weights, prefix + "indexer.", x, positions, state["index_source"], state["index_entries"],
                          rate, True, cfg.compress_rope, eps, valid)
            seen = indexer_choice(weights, prefix + "indexer.", cfg, x, q_residual, positions,
                                  state["index_entries"].whole(), seen, parallel)
        keys = torch.cat([keys, state["entries"].whole().to(keys.dtype)], dim=0)
        mask = torch.cat([mask, additive_mask(seen, mask.dtype)], dim=1)
    attended = attend(weights, prefix, cfg, query, keys, mask)  # [R, H, D]
    attended = apply_rope(attended, cos, -sin)  # V = K carries the keys' rotation: undo it at the query position
    grouped = attended.reshape(rows, cfg.o_groups, -1).transpose(0, 1)  # [g, R, H D / g]
    wo_a = weights[prefix + "wo_a"].view(cfg.o_groups, cfg.o_lora_rank, -1)  # [g, o_lora, H D / g]
    mixed = torch.bmm(grouped, wo_a.transpose(1, 2)).transpose(0, 1).reshape(rows, -1)  # [R, g o_lora]
    return F.linear(mixed, weights[prefix + "wo_b"])


def hyper_connection(weights: Mapping[str, torch.Tensor], prefix: str, cfg, streams: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' ``DeepseekV4HyperConnection``: ``streams [R, n, hidden]`` -> (post ``[R, n]``, comb
    ``[R, n, n]``, the collapsed block input ``[R, hidden]``)."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = rms_norm(streams.reshape(streams.shape[0], -1).float(), None, cfg.rms_norm_eps)
    mixes = F.linear(flat, weights[prefix + "fn"].float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = weights[prefix + "base"].split([n, n, n * n])
    pre_scale, post_scale, comb_scale = weights[prefix + "scale"].unbind(0)
    comb_w, comb_b = comb_w.view(-1, n, n), comb_b.view(n, n)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    gate = F.linear(x, w1).clamp(max=limit)
    up = F.linear(x, w3).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


def moe(weights: Mapping[str, torch.Tensor], cfg, layer: int, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``DeepseekV4SparseMoeBlock``: routed experts (summed in expert order) plus the shared one.

    On one rank of a sharded core the experts' weights are its slices of their widths (``w1``/``w3`` rows, ``w2``
    columns): the router, replicated, routes every row as every other rank does, and the result is a partial sum."""
    prefix, experts = f"layers.{layer}.", cfg.moe
    scores = F.softplus(F.linear(x, weights[prefix + "router"])).sqrt()  # [R, E]
    if layer in cfg.hash_layers:
        chosen = weights[prefix + "tid2eid"].index_select(0, token_ids).long()  # [R, k]
    else:
        chosen = torch.topk(scores + weights[prefix + "router_bias"], experts.top_k, dim=-1, sorted=False).indices
    routed_weights = scores.gather(1, chosen)
    routed_weights = routed_weights / (routed_weights.sum(dim=-1, keepdim=True) + 1e-20) * experts.routed_scaling_factor
    routed = torch.zeros_like(x)
    for expert in range(experts.num_experts):
        weight = (routed_weights * (chosen == expert)).sum(-1, keepdim=True)  # [R, 1]: 0 where not chosen
        names = [f"{prefix}experts.{expert}.{w}" for w in ("w1", "w2", "w3")]
        out = _swiglu(x, weights[names[0]], weights[names[1]], weights[names[2]], experts.swiglu_limit)
        routed = routed + (out * weight).masked_fill(weight == 0, 0.0)
    shared = _swiglu(x, weights[prefix + "shared.w1"], weights[prefix + "shared.w2"], weights[prefix + "shared.w3"],
                     experts.swiglu_limit)
    return routed + shared


def deepseek_v4_decoder(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, start: int, slot: int,
                        caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One step of slot ``slot``: rows at positions ``start ..``; the final-normed hidden ``[R, hidden]``.

    A prompt chunk or decode step is one call with its cache, as in transformers' incremental forward; with the
    indexer's tie rule (``deepseek_v4_attention.keep_best``) the result does not depend on how a sequence is cut
    into steps, so prompt scoring (transformers' full forward) runs the same steps."""
    return collapse_streams(weights, cfg, deepseek_v4_streams(weights, cfg, input_ids, start, slot, caches))


def deepseek_v4_streams(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, start: int, slot: int,
                        caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``deepseek_v4_decoder``'s step before the head: the last layer's streams ``[R, hc_mult, hidden]`` (what a
    multi-token-prediction layer reads, ``deepseek_v4_mtp``)."""
    rows = input_ids.shape[0]
    check_step(cfg, caches, start, rows, slot)
    positions = start + torch.arange(rows, device=input_ids.device)
    return decoder_streams(weights, cfg, input_ids, lambda layer, x: attention(
        weights, cfg, layer, x, positions, layer_state(cfg, caches, layer, slot)))


def decoder_rows(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor,
                 attention_of: Callable[[int, torch.Tensor], torch.Tensor], parallel=None) -> torch.Tensor:
    """The decoder around its attention blocks: ``attention_of(layer, normed rows)`` -> ``[R, hidden]``; the
    final-normed hidden ``[R, hidden]`` (hyper-connections, MoE and the head's stream collapse row by row).

    ``parallel`` (a ``recipes.sharding.TensorParallel``): the weights are one rank's shards; the embedding is
    vocabulary-parallel, and each attention and MoE output is a partial sum that ``parallel.reduce`` adds over the
    ranks before the hyper-connections (replicated) take it."""
    return collapse_streams(weights, cfg, decoder_streams(weights, cfg, input_ids, attention_of, parallel))


def decoder_streams(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor,
                    attention_of: Callable[[int, torch.Tensor], torch.Tensor], parallel=None) -> torch.Tensor:
    """``decoder_rows`` before the head: the last layer's streams ``[R, hc_mult, hidden]``."""
    token_ids = input_ids.clamp(0, cfg.vocab_size - 1)
    if parallel is None:
        hidden = F.embedding(token_ids, weights["embed"])  # [R, hidden]
    else:
        hidden = parallel.embed(token_ids, weights["embed"])
    streams = hidden.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [R, n, hidden]
    for layer in range(cfg.num_layers):
        streams = block(weights, cfg, layer, streams, token_ids, attention_of, parallel)
    return streams


def block(weights: Mapping[str, torch.Tensor], cfg, layer: int, streams: torch.Tensor, token_ids: torch.Tensor,
          attention_of: Callable[[int, torch.Tensor], torch.Tensor], parallel=None) -> torch.Tensor:
    """transformers' ``DeepseekV4DecoderLayer`` (the reference's ``Block``): streams ``[R, n, hidden]`` in and out,
    attention and then the MoE, each read through and written back by its hyper-connection (``parallel``: each
    output is a rank's partial sum, added over the ranks first)."""
    reduce = (lambda partial: partial) if parallel is None else parallel.reduce
    prefix = f"layers.{layer}."
    post, comb, collapsed = hyper_connection(weights, prefix + "hc_attn_", cfg, streams)
    out = reduce(attention_of(layer, rms_norm(collapsed, weights[prefix + "attn_norm"], cfg.rms_norm_eps)))
    streams = post.to(streams.dtype).unsqueeze(-1) * out.unsqueeze(-2) \
        + torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)
    post, comb, collapsed = hyper_connection(weights, prefix + "hc_ffn_", cfg, streams)
    out = reduce(moe(weights, cfg, layer, rms_norm(collapsed, weights[prefix + "ffn_norm"], cfg.rms_norm_eps),
                     token_ids))
    return post.to(streams.dtype).unsqueeze(-1) * out.unsqueeze(-2) \
        + torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)


def collapse_streams(weights: Mapping[str, torch.Tensor], cfg, streams: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """transformers' ``DeepseekV4HyperHead`` and the final norm: streams ``[R, n, hidden]`` -> the hidden the head
    projects ``[R, hidden]``, with the model's ``hc_head_*`` and ``final_norm`` (``prefix`` "": the decoder's;
    ``mtp.{k}.``: a multi-token-prediction layer's own)."""
    flat = rms_norm(streams.reshape(streams.shape[0], -1).float(), None, cfg.rms_norm_eps)
    mixes = F.linear(flat, weights[prefix + "hc_head_fn"].float())
    pre = torch.sigmoid(mixes * weights[prefix + "hc_head_scale"].float() + weights[prefix + "hc_head_base"].float()) \
        + cfg.hc_eps
    hidden = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return rms_norm(hidden, weights[prefix + "final_norm"], cfg.rms_norm_eps)


__all__ = ["deepseek_v4_decoder", "deepseek_v4_streams", "decoder_rows", "decoder_streams", "block",
           "collapse_streams", "layer_state", "check_step", "STATE_BUFFERS", "state_geometry", "allocate_state",
           "attention", "hyper_connection", "moe"]
