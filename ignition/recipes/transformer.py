"""Functional Qwen3 / Llama / Qwen3-MoE decoder: a static-shape forward for ``torch.export``.

The forward mirrors transformers' eager implementation op for op (fp32 RMSNorm cast back like HF,
rotate_half RoPE, SiLU MLP or MoE block, Qwen3 per-head q/k norm before RoPE); attention reads the
grouped KV heads in place from the cache (``recipes/attention.py``). ``decoder_stack`` (embedding, residual layers, final norm) is shared with DeepSeek-V3 (MLA).
The KV cache is runtime-owned state that the graph mutates in place: pools of blocks
``[num_layers, kv_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype, addressed through the rows'
block tables (``Rows.block_tables``; without them, the slot layout ``[num_layers, num_slots, max_seq_len, ...]``),
allocated with finite values (``torch.zeros``). Slots and positions are tensors; nothing branches on tensor values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from ignition.recipes.config import ModelConfig, kv_cache_shape
from ignition.recipes.attention import AttentionPlan, cached_attention, plan_attention
from ignition.recipes.layers import Rows, rms_norm, row_linear, write_rows
from ignition.recipes.moe import feed_forward
from ignition.recipes.packed_attention import packed_attention
from ignition.recipes.rope import rope_cos_sin, rotate_half_rope, signed_sin

K_CACHE, V_CACHE = ModelConfig.cache_names
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, normed [R, d_model], cos, sin) -> attention output [R, d_model]``, caches already bound."""


def qk_norm_scales(weights: Mapping[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Every layer's q and k norm weights, one row a head: ``[layers, heads + kv_heads, head_dim]``, the scale of
    ``_attention``'s side-by-side heads. Built once a forward (a handful of graph nodes) instead of an expand of each
    weight and their concatenation in every layer."""
    def stacked(name: str, heads: int) -> torch.Tensor:
        norms = torch.stack([weights[f"layers.{layer}.{name}"] for layer in range(cfg.num_layers)])  # [L, head_dim]
        return norms.unsqueeze(1).expand(-1, heads, -1)
    return torch.cat((stacked("q_norm", cfg.num_heads), stacked("k_norm", cfg.num_kv_heads)), dim=1)


def _attention(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int, normed: torch.Tensor,
               cos: torch.Tensor, sin_signed: torch.Tensor, rows: Rows, plan: AttentionPlan | None,
               k_cache: torch.Tensor, v_cache: torch.Tensor, qk_scales: torch.Tensor | None) -> torch.Tensor:
    """One layer's attention: ``qk_scales`` is ``qk_norm_scales`` (when ``cfg.qk_norm``)."""
    prefix = f"layers.{layer}."
    bias = (lambda name: weights[prefix + name]) if cfg.attention_bias else (lambda name: None)
    num_rows, heads, kv_heads, head_dim = normed.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query = F.linear(normed, weights[prefix + "q_proj"], bias("q_bias")).view(num_rows, heads, head_dim)
    key = F.linear(normed, weights[prefix + "k_proj"], bias("k_bias")).view(num_rows, kv_heads, head_dim)
    value = F.linear(normed, weights[prefix + "v_proj"], bias("v_bias")).view(num_rows, kv_heads, head_dim)
    # the query and key heads side by side, so their norms and RoPE are one set of ops (the same values per head)
    heads_qk = torch.cat((query, key), dim=1)  # [R, heads + kv_heads, head_dim]
    if cfg.qk_norm:
        heads_qk = rms_norm(heads_qk, qk_scales[layer], cfg.rms_norm_eps, rows)  # [heads + kv_heads, head_dim] scale
    heads_qk = rotate_half_rope(heads_qk, cos, sin_signed)  # cos, sin_signed: [R, 1, head_dim]
    query, key = heads_qk[:, :heads], heads_qk[:, heads:]
    write_rows(k_cache, layer, rows, key, paged=True)
    write_rows(v_cache, layer, rows, value, paged=True)

    if plan is None:  # packed prompt chunks (rows.segments)
        attended = packed_attention(query, k_cache[layer], v_cache[layer], rows)  # [R, q_width]
    else:
        attended = cached_attention(query, k_cache, v_cache, layer, plan)  # [R, q_width]
    return row_linear(attended, weights[prefix + "o_proj"], bias("o_bias"), cfg.row_blocks, cfg.row_shard)  # [R, d_model]


def _check_caches(cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Static (trace-time) check that both caches match ``kv_cache_shape`` and the weights' dtype."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expected = kv_cache_shape(cfg, 1, 1, cache.shape[2], cache.shape[1]) if cache.dim() == 5 else "5-D"
        if tuple(cache.shape) != expected or cache.dtype != weights["embed"].dtype:
            raise ValueError(
                f"{name} must have shape {expected} and dtype {weights['embed'].dtype}; "
                f"found {tuple(cache.shape)} {cache.dtype}")


def decoder_stack(weights: Mapping[str, torch.Tensor], cfg, input_ids: torch.Tensor, rows: Rows,
                  attention: Attention, parallel=None) -> torch.Tensor:
    """Embedding, pre-norm residual layers (``attention``, then the dense or MoE MLP), final norm: ``[R, d_model]``.

    ``parallel`` (a ``recipes.sharding.TensorParallel``): the weights are one rank's shards; the
    embedding is vocabulary-parallel and each layer's attention and MLP outputs are partial sums
    that ``parallel.reduce`` adds over the ranks before the residual add.
    """
    token_ids = input_ids.clamp(0, cfg.vocab_size - 1)  # padding ids may be anything
    if parallel is None:
        hidden = F.embedding(token_ids, weights["embed"])  # hidden: [R, d_model]
    else:
        hidden = parallel.embed(token_ids, weights["embed"])
    reduce = (lambda partial: partial) if parallel is None else parallel.reduce
    cos, sin = rope_cos_sin(cfg, rows.positions, hidden.dtype)  # [R, 1, rope_dim] each
    for layer in range(cfg.num_layers):
        normed = rms_norm(hidden, weights[f"layers.{layer}.attn_norm"], cfg.rms_norm_eps, rows)
        hidden = hidden + reduce(attention(layer, normed, cos, sin))
        normed = rms_norm(hidden, weights[f"layers.{layer}.mlp_norm"], cfg.rms_norm_eps, rows)
        hidden = hidden + reduce(feed_forward(weights, cfg, layer, normed))
    return rms_norm(hidden, weights["final_norm"], cfg.rms_norm_eps, rows)  # [R, d_model]


def gqa_decoder(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor, rows: Rows,
                caches: Mapping[str, torch.Tensor], parallel=None) -> torch.Tensor:
    """Qwen3 / Llama / Qwen3-MoE: GQA attention over ``caches["k_cache"]``, ``caches["v_cache"]``."""
    k_cache, v_cache = caches[K_CACHE], caches[V_CACHE]
    _check_caches(cfg, weights, k_cache, v_cache)
    plan = None if rows.segments is not None else plan_attention(
        rows, k_cache.shape[1], k_cache.shape[2], cfg.num_heads // cfg.num_kv_heads, k_cache.dtype)
    signed = functools.cache(signed_sin)  # once per forward: every layer passes the same table
    qk_scales = qk_norm_scales(weights, cfg) if cfg.qk_norm else None
    return decoder_stack(weights, cfg, input_ids, rows, lambda layer, normed, cos, sin: _attention(
        weights, cfg, layer, normed, cos, signed(sin), rows, plan, k_cache, v_cache, qk_scales), parallel)


def prefill_hidden(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor,
                   chunk_start: torch.Tensor, chunk_len: torch.Tensor, slot: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Run one request's prompt chunk; returns final-normed hidden ``[C, hidden_size]``.

    ``input_ids`` int64[C] (rows >= chunk_len are padding), ``chunk_start`` int64[1] (position of
    row 0), ``chunk_len`` int64[1], ``slot`` int64[1]. Valid rows write K/V at positions
    chunk_start.. of ``slot``; row j attends over the slot's positions [0, chunk_start + j].
    Padding rows leave the cache untouched and return finite garbage.
    """
    rows = Rows.prefill(input_ids.shape[0], chunk_start, chunk_len, slot)
    return gqa_decoder(weights, cfg, input_ids, rows, {K_CACHE: k_cache, V_CACHE: v_cache})


def decode_hidden(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, input_ids: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, active: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One decode step for a batch; returns final-normed hidden ``[B, hidden_size]``.

    ``input_ids``, ``positions``, ``slots``: int64[B]; ``active``: bool[B]. Each active row writes
    K/V at (slot, position) and attends over that slot's positions [0, position]; active rows must
    use distinct slots. Inactive rows leave the cache untouched and return finite garbage.
    """
    rows = Rows.decode(positions, slots, active)
    return gqa_decoder(weights, cfg, input_ids, rows, {K_CACHE: k_cache, V_CACHE: v_cache})


def lm_head_logits(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Logits ``[rows, vocab_size]`` in the model dtype (callers reduce in fp32)."""
    return F.linear(hidden, weights["lm_head"])  # [rows, vocab_size]


SAMPLED_ROW_BLOCK = 8
"""The rows of every LM-head product that projects prompt lanes' sampled rows (``sampled_row_logits``)."""


def sampled_row_logits(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, hidden: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor:
    """The logits of ``hidden``'s rows ``rows`` (int64 ``[n]``): ``[n, vocab_size]``, each row projected as one row of
    an LM-head product of ``SAMPLED_ROW_BLOCK`` rows (the rows padded with copies of row 0, one product a block).

    A prefill chunk's sampled row, a mixed round's prompt row and a packed round's lanes all sample through here, so
    a lane's logits are the same bits whichever of them runs its chunk: a GEMM's sum order can depend on its row
    count (MKL's FP32 ``sgemm`` at 1 or 2 rows differs from 4 or more), not, at a fixed count, on a row's position
    or on the other rows (checked by ``tests/test_packed_prefill.py``). One product for a packed round's lanes
    instead of one a lane: an LM head read once, not once a lane (a BF16 packed round of 8 four-token prompts at
    Qwen3-0.6B's width spent 122 of its 330 ms in eight one-row products)."""
    count = rows.shape[0]
    padded = -(-count // SAMPLED_ROW_BLOCK) * SAMPLED_ROW_BLOCK
    picked = hidden.index_select(0, F.pad(rows, (0, padded - count)))  # [padded, d_model]
    blocks = [lm_head_logits(weights, cfg, picked[start:start + SAMPLED_ROW_BLOCK])
              for start in range(0, padded, SAMPLED_ROW_BLOCK)]
    logits = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return logits if padded == count else logits[:count]
