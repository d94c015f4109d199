"""Rotary position embeddings: HF RoPE scaling parameters and frequencies, fixed at build time.

``RopeScaling.from_hf_config`` reads ``rope_parameters`` (or legacy ``rope_scaling``) and rejects
variants whose frequencies depend on run-time lengths; ``rope_frequencies`` reproduces
transformers' RoPE init bit for bit; ``rope_cos_sin`` gives the per-row tables the decoder uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ignition.recipes.checkpoint import CheckpointError, read_field

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
            read_field(params, key, float, where)
        if read_field(params, "partial_rotary_factor", float, where, 1.0) != 1.0:
            raise CheckpointError(
                f"{where}: field 'partial_rotary_factor' must be 1.0; found {params['partial_rotary_factor']!r}")
        theta = read_field(params, "rope_theta", float, where, read_field(config, "rope_theta", float, source, 10000.0))
        # Like HF, a top-level original_max_position_embeddings (Phi-3 style) wins over the rope dict.
        original = read_field(config, "original_max_position_embeddings", int, source,
                         read_field(params, "original_max_position_embeddings", int, where, max_positions))
        factor = read_field(params, "factor", float, where, None)
        if factor is None:
            factor = max_positions / original if kind == "yarn" else 1.0
        return theta, cls(
            kind=kind, factor=factor,
            low_freq_factor=read_field(params, "low_freq_factor", float, where, 1.0),
            high_freq_factor=read_field(params, "high_freq_factor", float, where, 4.0),
            original_max_position_embeddings=original,
            attention_factor=read_field(params, "attention_factor", float, where, None),
            beta_fast=read_field(params, "beta_fast", float, where, 32.0) or 32.0,
            beta_slow=read_field(params, "beta_slow", float, where, 1.0) or 1.0,
            mscale=read_field(params, "mscale", float, where, None),
            mscale_all_dim=read_field(params, "mscale_all_dim", float, where, None),
            truncate=read_field(params, "truncate", bool, where, True),
        )


class RopeConfig(Protocol):
    """The fields of a model config that RoPE reads."""

    rope_scaling: RopeScaling
    rope_theta: float
    head_dim: int


def rope_frequencies(cfg: RopeConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
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


def rope_cos_sin(cfg: RopeConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[R, 1, head_dim]`` in ``dtype`` for int64 ``positions [R]`` (HF: fp32 angles, then cast)."""
    inv_freq, multiplier = rope_frequencies(cfg, positions.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq  # [R, head_dim // 2]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [R, 1, head_dim]
    return (angles.cos() * multiplier).to(dtype), (angles.sin() * multiplier).to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin [..., dim]`` with its first half negated: ``rotate_half(x) * sin`` equals ``x``'s halves swapped times
    ``signed_sin(sin)`` bit for bit (a product's rounding is symmetric in sign); a caller that rotates several
    tensors at the same positions makes it once (``rotate_half_rope``)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``sin_signed = signed_sin(sin)``: the halves of ``x`` swapped
    (a ``roll``) instead of ``rotate_half``'s negation and concatenation, the same values bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE on ``x [R, heads, dim]`` with ``cos``/``sin`` ``[R, 1, dim]`` (``cat(freqs, freqs)`` layout).

    ``interleaved`` (DeepSeek's ``rope_interleave``): pairs are ``(x0, x1), (x2, x3), ...``; like
    transformers, the result is written de-interleaved (rotated evens, then rotated odds), which
    leaves every query-key dot product unchanged as long as both sides use it.
    """
    if not interleaved:
        return rotate_half_rope(x, cos, signed_sin(sin))
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
