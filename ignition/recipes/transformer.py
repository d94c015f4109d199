"""Functional Qwen3 / Llama decoder: a static-shape forward for ``torch.export``.

The forward mirrors transformers' eager implementation op for op (fp32 RMSNorm cast back like HF,
rotate_half RoPE, GQA repeat, fp32 softmax, SiLU MLP, Qwen3 per-head q/k norm before RoPE).
The KV cache is runtime-owned state that the graph mutates in place:
``[num_layers, num_slots, max_seq_len, num_kv_heads, head_dim]`` in the model dtype, allocated with
finite values (``torch.zeros``). Slots and positions are tensors; nothing branches on tensor values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ignition.recipes.config import ModelConfig, kv_cache_shape
from ignition.recipes.rope import rope_cos_sin

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in fp32, cast back to the input dtype, then scale."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True, slots=True)
class _Rows:
    """Per-row indexing of one forward call. R rows split into G attention groups of R // G rows each."""

    positions: torch.Tensor  # int64 [R]: absolute position of each row
    write_slots: torch.Tensor  # int64 [R]: cache slot each row writes
    valid: torch.Tensor  # bool [R]: rows that may write the cache
    read_slots: torch.Tensor  # int64 [G]: cache slot each group attends over


def _write_rows(cache: torch.Tensor, layer: int, rows: _Rows, values: torch.Tensor) -> None:
    """``cache[layer, slot_i, position_i] = values[i]`` for valid rows; invalid rows leave it bit-identical.

    One index_put_ writes every row. An invalid row repeats the first valid row's write (same cell,
    same value); if no row is valid, every row rewrites row 0's cell with its old value. Duplicate
    targets thus always carry identical values and the result never depends on write order.
    Slots and positions are clamped into range. Valid rows must target distinct cells.
    """
    num_rows = values.shape[0]
    first_valid = torch.argmax(rows.valid.to(torch.int32))  # 0 when no row is valid
    source = torch.where(rows.valid, torch.arange(num_rows, device=values.device), first_valid)  # [R]
    slot_index = rows.write_slots[source].clamp(0, cache.shape[1] - 1)
    position_index = rows.positions[source].clamp(0, cache.shape[2] - 1)
    layer_index = torch.full_like(slot_index, layer)
    old = cache[layer_index, slot_index, position_index]  # [R, kv_heads, head_dim]
    new = torch.where(rows.valid[source].view(-1, 1, 1), values[source], old)
    cache.index_put_((layer_index, slot_index, position_index), new)


def _attention(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int, normed: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, rows: _Rows,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    prefix = f"layers.{layer}."
    bias = (lambda name: weights[prefix + name]) if cfg.attention_bias else (lambda name: None)
    num_rows, heads, kv_heads, head_dim = normed.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query = F.linear(normed, weights[prefix + "q_proj"], bias("q_bias")).view(num_rows, heads, head_dim)
    key = F.linear(normed, weights[prefix + "k_proj"], bias("k_bias")).view(num_rows, kv_heads, head_dim)
    value = F.linear(normed, weights[prefix + "v_proj"], bias("v_bias")).view(num_rows, kv_heads, head_dim)
    if cfg.qk_norm:
        query = _rms_norm(query, weights[prefix + "q_norm"], cfg.rms_norm_eps)
        key = _rms_norm(key, weights[prefix + "k_norm"], cfg.rms_norm_eps)
    query = query * cos + _rotate_half(query) * sin  # cos/sin: [R, 1, head_dim]
    key = key * cos + _rotate_half(key) * sin
    _write_rows(k_cache, layer, rows, key)
    _write_rows(v_cache, layer, rows, value)

    groups = rows.read_slots.shape[0]
    per_group, max_seq_len = num_rows // groups, k_cache.shape[2]
    read_slots = rows.read_slots.clamp(0, k_cache.shape[1] - 1)
    # keys/values: [G, S, kv_heads, D] -> [G, heads, S, D] (HF repeat_kv: each kv head serves a run of heads)
    keys = k_cache[layer].index_select(0, read_slots).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    values = v_cache[layer].index_select(0, read_slots).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    query = query.view(groups, per_group, heads, head_dim).transpose(1, 2)  # [G, heads, R/G, D]
    scores = torch.matmul(query, keys.transpose(2, 3)) * head_dim**-0.5  # [G, heads, R/G, S]
    key_positions = torch.arange(max_seq_len, device=normed.device)
    visible = key_positions.view(1, 1, 1, -1) <= rows.positions.view(groups, 1, per_group, 1)
    scores = scores.to(torch.float32).masked_fill(~visible, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    attended = torch.matmul(probs, values).transpose(1, 2).reshape(num_rows, heads * head_dim)  # [R, q_width]
    return F.linear(attended, weights[prefix + "o_proj"], bias("o_bias"))  # [R, d_model]


def _mlp(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int, normed: torch.Tensor) -> torch.Tensor:
    prefix = f"layers.{layer}."
    bias = (lambda name: weights[prefix + name]) if cfg.mlp_bias else (lambda name: None)
    gate = F.linear(normed, weights[prefix + "gate_proj"], bias("gate_bias"))  # [R, intermediate]
    up = F.linear(normed, weights[prefix + "up_proj"], bias("up_bias"))
    return F.linear(F.silu(gate) * up, weights[prefix + "down_proj"], bias("down_bias"))  # [R, d_model]


def _check_caches(cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Static (trace-time) check that both caches match ``kv_cache_shape`` and the weights' dtype."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expected = kv_cache_shape(cfg, cache.shape[1], cache.shape[2]) if cache.dim() == 5 else "5-D"
        if tuple(cache.shape) != expected or cache.dtype != weights["embed"].dtype:
            raise ValueError(
                f"{name} must have shape {expected} and dtype {weights['embed'].dtype}; "
                f"found {tuple(cache.shape)} {cache.dtype}")


def _decoder(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor, rows: _Rows,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    _check_caches(cfg, weights, k_cache, v_cache)
    token_ids = input_ids.clamp(0, cfg.vocab_size - 1)  # padding ids may be anything
    hidden = F.embedding(token_ids, weights["embed"])  # hidden: [R, d_model]
    cos, sin = rope_cos_sin(cfg, rows.positions, hidden.dtype)  # [R, 1, head_dim] each
    for layer in range(cfg.num_layers):
        normed = _rms_norm(hidden, weights[f"layers.{layer}.attn_norm"], cfg.rms_norm_eps)
        hidden = hidden + _attention(weights, cfg, layer, normed, cos, sin, rows, k_cache, v_cache)
        normed = _rms_norm(hidden, weights[f"layers.{layer}.mlp_norm"], cfg.rms_norm_eps)
        hidden = hidden + _mlp(weights, cfg, layer, normed)
    return _rms_norm(hidden, weights["final_norm"], cfg.rms_norm_eps)  # [R, d_model]


def prefill_hidden(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor,
                   chunk_start: torch.Tensor, chunk_len: torch.Tensor, slot: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Run one request's prompt chunk; returns final-normed hidden ``[C, hidden_size]``.

    ``input_ids`` int64[C] (rows >= chunk_len are padding), ``chunk_start`` int64[1] (position of
    row 0), ``chunk_len`` int64[1], ``slot`` int64[1]. Valid rows write K/V at positions
    chunk_start.. of ``slot``; row j attends over the slot's positions [0, chunk_start + j].
    Padding rows leave the cache untouched and return finite garbage.
    """
    chunk_rows = input_ids.shape[0]
    row = torch.arange(chunk_rows, device=input_ids.device)
    rows = _Rows(positions=chunk_start + row, write_slots=slot.expand(chunk_rows), valid=row < chunk_len,
                 read_slots=slot)
    return _decoder(weights, cfg, input_ids, rows, k_cache, v_cache)


def decode_hidden(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, active: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One decode step for a batch; returns final-normed hidden ``[B, hidden_size]``.

    ``input_ids``, ``positions``, ``slots``: int64[B]; ``active``: bool[B]. Each active row writes
    K/V at (slot, position) and attends over that slot's positions [0, position]; active rows must
    use distinct slots. Inactive rows leave the cache untouched and return finite garbage.
    """
    rows = _Rows(positions=positions, write_slots=slots, valid=active, read_slots=slots)
    return _decoder(weights, cfg, input_ids, rows, k_cache, v_cache)


def lm_head_logits(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Logits ``[rows, vocab_size]`` in the model dtype (callers reduce in fp32)."""
    return F.linear(hidden, weights["lm_head"])  # [rows, vocab_size]
