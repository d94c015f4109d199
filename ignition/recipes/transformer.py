"""Functional Qwen3 / Llama decoder: config, weight layout and a static-shape forward for ``torch.export``.

The forward mirrors transformers' eager implementation op for op (fp32 RMSNorm cast back like HF,
rotate_half RoPE, GQA repeat, fp32 softmax, SiLU MLP, Qwen3 per-head q/k norm before RoPE).
The KV cache is runtime-owned state that the graph mutates in place:
``[num_layers, num_slots, max_seq_len, num_kv_heads, head_dim]`` in the model dtype, allocated with
finite values (``torch.zeros``). Slots and positions are tensors; nothing branches on tensor values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ignition.recipes.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError, family_of

# family -> whether attention applies RMSNorm to each q/k head before RoPE.
FAMILY_QK_NORM: dict[str, bool] = {"qwen3": True, "llama": False}

# config.json `dtype` / `torch_dtype` -> torch dtype.
CONFIG_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_REQUIRED = object()


def _read(config: Mapping[str, Any], key: str, kind: type, source: str, default: Any = _REQUIRED) -> Any:
    """``config[key]`` checked to be ``kind`` (int excludes bool; float accepts int); ``default`` if absent."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source}: field {key!r} is required; expected {kind.__name__}, found nothing")
        return default
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise CheckpointError(f"{source}: field {key!r} must be {kind.__name__}; found {value!r}")
    return kind(value)


# RoPE variants whose frequencies are fixed at build time -> fields their HF parameters must carry.
ROPE_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),  # `factor` may be null: derived from max_position_embeddings / original_max_position_embeddings
}
ROPE_REJECTED: dict[str, str] = {
    "dynamic": "it recomputes frequencies from the longest sequence seen at run time (data-dependent)",
    "longrope": "it switches frequency sets on the run-time sequence length (data-dependent)",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_parameters`` / legacy ``rope_scaling``), static at build time."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None derives it from factor/mscale
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.kind not in ROPE_REQUIRED_FIELDS:
            raise CheckpointError(
                f"RopeScaling.kind must be one of {sorted(ROPE_REQUIRED_FIELDS)}; found {self.kind!r}")
        if not self.factor > 0 or (self.kind in ("llama3", "yarn") and self.original_max_position_embeddings <= 0):
            raise CheckpointError(
                f"RopeScaling({self.kind}) needs factor > 0 and original_max_position_embeddings > 0; "
                f"found {self.factor!r}, {self.original_max_position_embeddings!r}")
        if self.kind == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise CheckpointError(
                f"RopeScaling(llama3) needs high_freq_factor != low_freq_factor; found both {self.low_freq_factor}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], max_positions: int, source: str) -> tuple[float, RopeScaling]:
        """Return ``(rope_theta, scaling)``; reads ``rope_scaling`` (legacy) before ``rope_parameters`` like HF."""
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: field 'rope_parameters' must be an object; found {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if not isinstance(kind, str) or any(isinstance(value, dict) for value in params.values()):
            raise CheckpointError(
                f"{source}: field 'rope_parameters' must be one flat dict with a string rope_type "
                f"(per-layer RoPE is unsupported); found {params!r}")
        if kind in ROPE_REJECTED:
            raise CheckpointError(
                f"{source}: rope_type {kind!r} cannot be exported with static shapes: {ROPE_REJECTED[kind]}")
        if kind not in ROPE_REQUIRED_FIELDS:
            raise CheckpointError(
                f"{source}: field 'rope_parameters.rope_type' must be one of {sorted(ROPE_REQUIRED_FIELDS)}; "
                f"found {kind!r}")
        where = f"{source} (rope_parameters)"
        for key in ROPE_REQUIRED_FIELDS[kind]:
            _read(params, key, float, where)
        if _read(params, "partial_rotary_factor", float, where, 1.0) != 1.0:
            raise CheckpointError(
                f"{where}: field 'partial_rotary_factor' must be 1.0; found {params['partial_rotary_factor']!r}")
        theta = _read(params, "rope_theta", float, where, _read(config, "rope_theta", float, source, 10000.0))
        # Like HF, a top-level original_max_position_embeddings (Phi-3 style) wins over the rope dict.
        original = _read(config, "original_max_position_embeddings", int, source,
                         _read(params, "original_max_position_embeddings", int, where, max_positions))
        factor = _read(params, "factor", float, where, None)
        if factor is None:
            factor = max_positions / original if kind == "yarn" else 1.0
        return theta, cls(
            kind=kind, factor=factor,
            low_freq_factor=_read(params, "low_freq_factor", float, where, 1.0),
            high_freq_factor=_read(params, "high_freq_factor", float, where, 4.0),
            original_max_position_embeddings=original,
            attention_factor=_read(params, "attention_factor", float, where, None),
            beta_fast=_read(params, "beta_fast", float, where, 32.0) or 32.0,
            beta_slow=_read(params, "beta_slow", float, where, 1.0) or 1.0,
            mscale=_read(params, "mscale", float, where, None),
            mscale_all_dim=_read(params, "mscale_all_dim", float, where, None),
            truncate=_read(params, "truncate", bool, where, True),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Static description of a Qwen3 / Llama decoder, parsed from a Hugging Face ``config.json``."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.family not in FAMILY_QK_NORM:
            raise CheckpointError(f"ModelConfig.family must be one of {sorted(FAMILY_QK_NORM)}; found {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"ModelConfig.{name} must be a positive int; found {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"ModelConfig.num_heads must be a multiple of num_kv_heads; "
                f"found num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"ModelConfig.head_dim must be even for rotate_half RoPE; found {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise CheckpointError(
                f"ModelConfig.rms_norm_eps and rope_theta must be > 0; "
                f"found {self.rms_norm_eps!r}, {self.rope_theta!r}")
        if self.dtype not in CONFIG_DTYPES.values():
            raise CheckpointError(f"ModelConfig.dtype must be one of {list(CONFIG_DTYPES)}; found {self.dtype}")

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def untied_lm_head(self) -> bool:
        return not self.tie_word_embeddings

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; invalid or unsupported fields raise CheckpointError."""
        family = family_of(config, source)
        hidden_size = _read(config, "hidden_size", int, source)
        num_heads = _read(config, "num_attention_heads", int, source)
        head_dim = config.get("head_dim")
        if head_dim is None and family == "llama":
            head_dim = hidden_size // num_heads if num_heads > 0 else 0  # HF Llama derives it
        head_dim = _read({"head_dim": head_dim}, "head_dim", int, source)
        if _read(config, "hidden_act", str, source, "silu") != "silu":
            raise CheckpointError(f"{source}: field 'hidden_act' must be 'silu'; found {config['hidden_act']!r}")
        if _read(config, "use_sliding_window", bool, source, False):
            raise CheckpointError(f"{source}: field 'use_sliding_window' must be false; found true")
        layer_types = config.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise CheckpointError(
                f"{source}: field 'layer_types' must contain only 'full_attention'; found {sorted(set(layer_types))}")
        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"  # HF loads fp32 when unset
        if dtype_name not in CONFIG_DTYPES:
            raise CheckpointError(f"{source}: field 'dtype' must be one of {list(CONFIG_DTYPES)}; found {dtype_name!r}")
        max_positions = _read(config, "max_position_embeddings", int, source)
        rope_theta, rope_scaling = RopeScaling.from_hf_config(config, max_positions, source)
        return cls(
            family=family,
            vocab_size=_read(config, "vocab_size", int, source),
            hidden_size=hidden_size,
            intermediate_size=_read(config, "intermediate_size", int, source),
            num_layers=_read(config, "num_hidden_layers", int, source),
            num_heads=num_heads,
            num_kv_heads=_read(config, "num_key_value_heads", int, source, num_heads),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=_read(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_read(config, "tie_word_embeddings", bool, source, False),
            qk_norm=FAMILY_QK_NORM[family],
            attention_bias=_read(config, "attention_bias", bool, source, False),
            mlp_bias=_read(config, "mlp_bias", bool, source, False),
            dtype=CONFIG_DTYPES[dtype_name],
        )


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """Our name for one HF tensor, its shape as ModelConfig attributes, and the flag gating its presence."""

    ours: str
    shape: tuple[str, ...]
    present_if: str | None = None


_LAYER = "model.layers.{layer}."
# HF tensor name -> our name / shape / presence flag. `{layer}` expands to 0..num_layers-1.
WEIGHT_MAP: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed", ("vocab_size", "hidden_size")),
    "model.norm.weight": WeightSpec("final_norm", ("hidden_size",)),
    "lm_head.weight": WeightSpec("lm_head", ("vocab_size", "hidden_size"), "untied_lm_head"),
    _LAYER + "input_layernorm.weight": WeightSpec("layers.{layer}.attn_norm", ("hidden_size",)),
    _LAYER + "self_attn.q_proj.weight": WeightSpec("layers.{layer}.q_proj", ("q_width", "hidden_size")),
    _LAYER + "self_attn.q_proj.bias": WeightSpec("layers.{layer}.q_bias", ("q_width",), "attention_bias"),
    _LAYER + "self_attn.k_proj.weight": WeightSpec("layers.{layer}.k_proj", ("kv_width", "hidden_size")),
    _LAYER + "self_attn.k_proj.bias": WeightSpec("layers.{layer}.k_bias", ("kv_width",), "attention_bias"),
    _LAYER + "self_attn.v_proj.weight": WeightSpec("layers.{layer}.v_proj", ("kv_width", "hidden_size")),
    _LAYER + "self_attn.v_proj.bias": WeightSpec("layers.{layer}.v_bias", ("kv_width",), "attention_bias"),
    _LAYER + "self_attn.o_proj.weight": WeightSpec("layers.{layer}.o_proj", ("hidden_size", "q_width")),
    _LAYER + "self_attn.o_proj.bias": WeightSpec("layers.{layer}.o_bias", ("hidden_size",), "attention_bias"),
    _LAYER + "self_attn.q_norm.weight": WeightSpec("layers.{layer}.q_norm", ("head_dim",), "qk_norm"),
    _LAYER + "self_attn.k_norm.weight": WeightSpec("layers.{layer}.k_norm", ("head_dim",), "qk_norm"),
    _LAYER + "post_attention_layernorm.weight": WeightSpec("layers.{layer}.mlp_norm", ("hidden_size",)),
    _LAYER + "mlp.gate_proj.weight": WeightSpec("layers.{layer}.gate_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.gate_proj.bias": WeightSpec("layers.{layer}.gate_bias", ("intermediate_size",), "mlp_bias"),
    _LAYER + "mlp.up_proj.weight": WeightSpec("layers.{layer}.up_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.up_proj.bias": WeightSpec("layers.{layer}.up_bias", ("intermediate_size",), "mlp_bias"),
    _LAYER + "mlp.down_proj.weight": WeightSpec("layers.{layer}.down_proj", ("hidden_size", "intermediate_size")),
    _LAYER + "mlp.down_proj.bias": WeightSpec("layers.{layer}.down_bias", ("hidden_size",), "mlp_bias"),
}


def weight_layout(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (our name, shape) for every tensor ``cfg`` requires."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for hf_template, spec in WEIGHT_MAP.items():
        if spec.present_if is not None and not getattr(cfg, spec.present_if):
            continue
        shape = tuple(getattr(cfg, dim) for dim in spec.shape)
        layers = range(cfg.num_layers) if "{layer}" in hf_template else [None]
        for layer in layers:
            layout[hf_template.format(layer=layer)] = (spec.ours.format(layer=layer), shape)
    return layout


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint must hold (no ``lm_head.weight`` when tied)."""
    return {hf_name: shape for hf_name, (_, shape) in weight_layout(cfg).items()}


def load_weights(checkpoint: Checkpoint, cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Validate ``checkpoint`` against ``cfg`` and load every tensor under our names, cast to ``dtype``.

    With tied embeddings ``weights["lm_head"] is weights["embed"]`` (shared, not copied); a tied
    checkpoint may still carry ``lm_head.weight``, which is shape-checked and ignored like HF does.
    """
    dtype = cfg.dtype if dtype is None else dtype
    tied_extra = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
    checkpoint.validate(expected_shapes(cfg), optional=tied_extra)
    weights = {ours: checkpoint.load(hf_name).to(dtype) for hf_name, (ours, _) in weight_layout(cfg).items()}
    if cfg.tie_word_embeddings:
        weights["lm_head"] = weights["embed"]
    return weights


def kv_cache_shape(cfg: ModelConfig, num_slots: int, max_seq_len: int) -> tuple[int, int, int, int, int]:
    """Shape of ``k_cache`` and ``v_cache``: ``[num_layers, num_slots, max_seq_len, num_kv_heads, head_dim]``."""
    for name, value in (("num_slots", num_slots), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"kv_cache_shape: {name} must be a positive int; found {value!r}")
    return (cfg.num_layers, num_slots, max_seq_len, cfg.num_kv_heads, cfg.head_dim)


def rope_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [head_dim // 2], cos/sin multiplier)``, computed exactly like transformers' rope init."""
    rope, dim, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)  # [dim // 2]
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, dim, base, exponents)
    return inv_freq, 1.0


def _yarn_inv_freq(rope: RopeScaling, dim: int, base: float, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale_of(rope.factor, rope.mscale) / mscale_of(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale_of(rope.factor)

    def correction_dim(num_rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    frequency_index = torch.arange(dim // 2, dtype=torch.float32, device=exponents.device)
    ramp = torch.clamp((frequency_index - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # [dim // 2]
    position_freqs = base**exponents  # HF's exact op order, so the result is bit-identical
    interpolated, extrapolated = 1.0 / (rope.factor * position_freqs), 1.0 / position_freqs
    blended = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return blended, float(attention_factor)


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
    inv_freq, rope_multiplier = rope_frequencies(cfg, hidden.device)
    angles = rows.positions.to(torch.float32)[:, None] * inv_freq  # [R, head_dim // 2]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [R, 1, head_dim]
    cos = (angles.cos() * rope_multiplier).to(hidden.dtype)
    sin = (angles.sin() * rope_multiplier).to(hidden.dtype)
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
