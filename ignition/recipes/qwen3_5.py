"""The ``qwen3_5`` recipe (HF ``Qwen3_5ForCausalLM``, and the text model of ``Qwen3_5ForConditionalGeneration``).

Qwen3.5 mixes two kinds of layers (``config.json:layer_types``): Gated DeltaNet linear attention
(``recipes/linear_attention.py``, cache kind ``linear``: a convolution state and a recurrent state per slot) on
three of every four, and gated full attention (cache kind ``full``) on the others: a query twice as wide whose
second half gates the attended values through a sigmoid, zero-centered q/k RMSNorms (``x * (1 + w)``) and RoPE on
the first ``partial_rotary_factor`` of each head. Every RMSNorm of the residual stream is zero-centered too; the
MLP is SiLU-gated. The multimodal checkpoint's text model is read from ``text_config`` and
``model.language_model.*`` (its vision tower and multi-token-prediction head are skipped).

The build, variants and graphs are the shared decoder ones (``llama.build_decoder``). In a verify round a linear
layer keeps its states after every verify row and, once the round has accepted its drafts, writes each lane's
states after its last accepted row (``linear_attention.ACCEPTED_STATES``). Its chunked delta rule solves a
triangular system, which ONNX has no operator for: it refuses ``--onnx``. Packed prompt chunks run their linear
layers as one group a lane (``linear_attention.packed_lanes``). The graphs read the live windows (the full layers'
key window, the sample window) and the prompt and packed rows are dynamic extents, as the Llama family's
(``DecoderFamily.windowed``, ``dynamic_chunks``); a windowed chunk runs its delta rule as one block.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ignition.catalog.cache_kinds import kind_index
from ignition.catalog.geometry import CONV_STATE, FP32_STATE, K_CACHE, RECURRENT_STATE, V_CACHE, state_shape
from ignition.recipes.attention import cached_attention, plan_attention
from ignition.recipes.base import ExportOptions, RecipeBuild, RecipeError
from ignition.recipes.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError, read_field
from ignition.recipes.config import CONFIG_DTYPES, paged_geometry
from ignition.recipes.layers import Rows, write_rows
from ignition.recipes.linear_attention import gated_delta_net
from ignition.recipes.llama import DecoderFamily, build_decoder
from ignition.recipes.packed_attention import packed_attention
from ignition.recipes.rope import RopeScaling, rope_cos_sin, rotate_half_rope, signed_sin
from ignition.recipes.weights import WeightSpec, load_weights

log = logging.getLogger(__name__)

LAYER_KINDS = {"linear_attention": "linear", "full_attention": "full"}
"""``config.json:layer_types`` entry -> the layer's cache kind (catalog/cache_kinds.py)."""

TEXT_PREFIXES = {"Qwen3_5ForCausalLM": "model.", "Qwen3_5ForConditionalGeneration": "model.language_model."}
"""Architecture -> the prefix of its text model's tensors (``WEIGHT_MAP`` is written with ``model.``)."""

SKIPPED_PREFIXES = ("model.visual.", "mtp.")
"""Tensors no text graph reads: the vision tower and the multi-token-prediction head (transformers skips them)."""

ROPE_ONLY_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""``rope_parameters`` fields read here, not by ``RopeScaling`` (multimodal RoPE: a text position is the same on
every axis, so its sections all rotate by it)."""

FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "the MLP and the linear layers' convolution are SiLU-gated"),
    "attention_bias": (False, "the attention projections carry no bias"),
    "quantization_config": (None, "quantized weights must be dequantized first"),
}
"""``text_config`` fields whose only supported value is the one given (absent is fine): field -> (value, why)."""


@dataclass(frozen=True, slots=True)
class Rotary:
    """The RoPE fields ``recipes/rope.py`` reads, over the rotated part of a head."""

    rope_scaling: RopeScaling
    rope_theta: float
    head_dim: int  # the rotated width: head_dim * partial_rotary_factor


@dataclass(frozen=True, slots=True)
class Qwen35Config:
    """Static description of a Qwen3.5 text decoder, parsed from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    layer_kinds: tuple[str, ...]
    linear_key_heads: int
    linear_heads: int  # value heads: the recurrent state's heads
    linear_key_dim: int
    linear_value_dim: int
    linear_conv_kernel: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "rotary_dim", "linear_key_heads", "linear_heads", "linear_key_dim", "linear_value_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"Qwen35Config.{name} must be a positive int; found {value!r}")
        if self.num_heads % self.num_kv_heads or self.linear_heads % self.linear_key_heads:
            raise CheckpointError(f"Qwen35Config: heads must be multiples of their key heads; found num_heads="
                                  f"{self.num_heads}, num_kv_heads={self.num_kv_heads}, linear value heads="
                                  f"{self.linear_heads}, linear key heads={self.linear_key_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise CheckpointError(f"Qwen35Config.rotary_dim must be even and at most head_dim {self.head_dim}; "
                                  f"found {self.rotary_dim}")
        if self.linear_conv_kernel < 2:
            raise CheckpointError(f"Qwen35Config.linear_conv_kernel must be at least 2; "
                                  f"found {self.linear_conv_kernel}")
        if not self.layer_kinds or any(kind not in LAYER_KINDS.values() for kind in self.layer_kinds):
            raise CheckpointError(f"Qwen35Config.layer_kinds must name {sorted(LAYER_KINDS.values())} per layer; "
                                  f"found {self.layer_kinds!r}")

    num_layers = property(lambda self: len(self.layer_kinds))
    full_layers = property(lambda self: tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "full"))
    linear_layers = property(lambda self: tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear"))
    untied_lm_head = property(lambda self: not self.tie_word_embeddings)
    gated_query_width = property(lambda self: 2 * self.num_heads * self.head_dim)
    q_width = property(lambda self: self.num_heads * self.head_dim)
    kv_width = property(lambda self: self.num_kv_heads * self.head_dim)
    linear_key_width = property(lambda self: self.linear_key_heads * self.linear_key_dim)
    linear_value_width = property(lambda self: self.linear_heads * self.linear_value_dim)
    linear_conv_dim = property(lambda self: 2 * self.linear_key_width + self.linear_value_width)
    one = property(lambda self: 1)
    rotary = property(lambda self: Rotary(self.rope_scaling, self.rope_theta, self.rotary_dim))

    @property
    def cache_names(self) -> tuple[str, ...]:
        """The state buffers of the kinds present: K and V for full layers, the two states for linear ones."""
        return (((K_CACHE, V_CACHE) if self.full_layers else ())
                + ((CONV_STATE, RECURRENT_STATE) if self.linear_layers else ()))

    def cache_shapes(self, num_slots: int, max_seq_len: int, block_size: int | None = None,
                     kv_blocks=None) -> dict[str, tuple[int, ...]]:
        """Each cache buffer's shape (``catalog.geometry.STATE_SHAPES``): in the model (export) dtype, the recurrent
        state in FP32 (``catalog.geometry.FP32_STATE``); the full layers' pools by ``config.paged_geometry``."""
        geometry = dict(full_layers=len(self.full_layers), linear_layers=len(self.linear_layers), num_slots=num_slots,
                        **paged_geometry(num_slots, max_seq_len, block_size, kv_blocks),
                        max_seq_len=max_seq_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        linear_conv_dim=self.linear_conv_dim, linear_conv_state=self.linear_conv_kernel - 1,
                        linear_heads=self.linear_heads, linear_key_dim=self.linear_key_dim,
                        linear_value_dim=self.linear_value_dim)
        return {name: tuple(state_shape(name, **geometry)) for name in self.cache_names}

    def summary(self) -> dict:
        """Model fields of the core manifest."""
        summary = {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                   "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "layer_kinds": list(self.layer_kinds)}
        if self.linear_layers:
            summary |= {"linear_conv_dim": self.linear_conv_dim, "linear_conv_kernel": self.linear_conv_kernel,
                        "linear_heads": self.linear_heads, "linear_key_dim": self.linear_key_dim,
                        "linear_value_dim": self.linear_value_dim}
        return summary

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = CONFIG_FILE) -> Qwen35Config:
        """Parse a Hugging Face ``config.json`` dict (a multimodal one through its ``text_config``)."""
        architecture = (config.get("architectures") or [""])[0]
        text = config
        if "text_config" in config:
            text = config["text_config"]
            if not isinstance(text, dict):
                raise CheckpointError(f"{source}: field 'text_config' must be an object; found {text!r}")
            source = f"{source} (text_config)"
            log.warning("%s: a multimodal %s checkpoint; exporting its text model (the vision tower is skipped)",
                     source, architecture)
            # the multimodal model's own fields win (its lm_head ties to the text embedding by the top-level flag)
            text = {"dtype": config.get("dtype")} | {key: value for key, value in text.items() if value is not None} | {
                key: config[key] for key in ("tie_word_embeddings",) if config.get(key) is not None}
        for key, (value, why) in FIXED_FIELDS.items():
            if text.get(key) is not None and text[key] != value:
                raise CheckpointError(f"{source}: field {key!r} must be {value!r} ({why}); found {text[key]!r}")
        num_layers = read_field(text, "num_hidden_layers", int, source)
        layer_types = text.get("layer_types")
        if layer_types is None:  # transformers' default: every fourth layer full
            interval = read_field(text, "full_attention_interval", int, source, 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != num_layers \
                or any(kind not in LAYER_KINDS for kind in layer_types):
            raise CheckpointError(f"{source}: field 'layer_types' must list one of {sorted(LAYER_KINDS)} for each of "
                                  f"the {num_layers} layers; found {layer_types!r}")
        params = dict(text.get("rope_parameters") or {})
        partial = read_field(params, "partial_rotary_factor", float, f"{source} (rope_parameters)",
                             read_field(text, "partial_rotary_factor", float, source, 0.25))
        head_dim = read_field(text, "head_dim", int, source)
        rope_view = {key: value for key, value in text.items() if key not in ("rope_scaling", "partial_rotary_factor")}
        rope_view["rope_parameters"] = {key: value for key, value in params.items() if key not in ROPE_ONLY_FIELDS}
        max_positions = read_field(text, "max_position_embeddings", int, source)
        rope_theta, rope_scaling = RopeScaling.from_hf_config(rope_view, max_positions, source)
        dtype_name = text.get("dtype") or text.get("torch_dtype") or "float32"
        if dtype_name not in CONFIG_DTYPES:
            raise CheckpointError(f"{source}: field 'dtype' must be one of {list(CONFIG_DTYPES)}; found {dtype_name!r}")
        num_heads = read_field(text, "num_attention_heads", int, source)
        return cls(
            vocab_size=read_field(text, "vocab_size", int, source),
            hidden_size=read_field(text, "hidden_size", int, source),
            intermediate_size=read_field(text, "intermediate_size", int, source),
            num_heads=num_heads, num_kv_heads=read_field(text, "num_key_value_heads", int, source, num_heads),
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            layer_kinds=tuple(LAYER_KINDS[kind] for kind in layer_types),
            linear_key_heads=read_field(text, "linear_num_key_heads", int, source, 16),
            linear_heads=read_field(text, "linear_num_value_heads", int, source, 32),
            linear_key_dim=read_field(text, "linear_key_head_dim", int, source, 128),
            linear_value_dim=read_field(text, "linear_value_head_dim", int, source, 128),
            linear_conv_kernel=read_field(text, "linear_conv_kernel_dim", int, source, 4),
            max_position_embeddings=max_positions,
            rms_norm_eps=read_field(text, "rms_norm_eps", float, source, 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            tie_word_embeddings=read_field(text, "tie_word_embeddings", bool, source, False),
            dtype=CONFIG_DTYPES[dtype_name])


_LAYER, _OURS = "model.layers.{layer}.", "layers.{layer}."
_ATTN, _LINEAR = _LAYER + "self_attn.", _LAYER + "linear_attn."
# HF tensor name (text model, ``model.`` prefix) -> our name / shape / presence flag / layers.
WEIGHT_MAP: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed", ("vocab_size", "hidden_size")),
    "model.norm.weight": WeightSpec("final_norm", ("hidden_size",)),
    "lm_head.weight": WeightSpec("lm_head", ("vocab_size", "hidden_size"), "untied_lm_head"),
    _LAYER + "input_layernorm.weight": WeightSpec(_OURS + "attn_norm", ("hidden_size",)),
    _LAYER + "post_attention_layernorm.weight": WeightSpec(_OURS + "mlp_norm", ("hidden_size",)),
    _LAYER + "mlp.gate_proj.weight": WeightSpec(_OURS + "gate_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.up_proj.weight": WeightSpec(_OURS + "up_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.down_proj.weight": WeightSpec(_OURS + "down_proj", ("hidden_size", "intermediate_size")),
    _ATTN + "q_proj.weight": WeightSpec(_OURS + "q_proj", ("gated_query_width", "hidden_size"), layers="full_layers"),
    _ATTN + "k_proj.weight": WeightSpec(_OURS + "k_proj", ("kv_width", "hidden_size"), layers="full_layers"),
    _ATTN + "v_proj.weight": WeightSpec(_OURS + "v_proj", ("kv_width", "hidden_size"), layers="full_layers"),
    _ATTN + "o_proj.weight": WeightSpec(_OURS + "o_proj", ("hidden_size", "q_width"), layers="full_layers"),
    _ATTN + "q_norm.weight": WeightSpec(_OURS + "q_norm", ("head_dim",), layers="full_layers"),
    _ATTN + "k_norm.weight": WeightSpec(_OURS + "k_norm", ("head_dim",), layers="full_layers"),
    _LINEAR + "in_proj_qkv.weight": WeightSpec(_OURS + "in_proj_qkv", ("linear_conv_dim", "hidden_size"),
                                               layers="linear_layers"),
    _LINEAR + "in_proj_z.weight": WeightSpec(_OURS + "in_proj_z", ("linear_value_width", "hidden_size"),
                                             layers="linear_layers"),
    _LINEAR + "in_proj_b.weight": WeightSpec(_OURS + "in_proj_b", ("linear_heads", "hidden_size"),
                                             layers="linear_layers"),
    _LINEAR + "in_proj_a.weight": WeightSpec(_OURS + "in_proj_a", ("linear_heads", "hidden_size"),
                                             layers="linear_layers"),
    _LINEAR + "conv1d.weight": WeightSpec(_OURS + "conv", ("linear_conv_dim", "one", "linear_conv_kernel"),
                                          layers="linear_layers"),
    _LINEAR + "dt_bias": WeightSpec(_OURS + "dt_bias", ("linear_heads",), layers="linear_layers"),
    _LINEAR + "A_log": WeightSpec(_OURS + "A_log", ("linear_heads",), layers="linear_layers"),
    _LINEAR + "norm.weight": WeightSpec(_OURS + "norm", ("linear_value_dim",), layers="linear_layers"),
    _LINEAR + "out_proj.weight": WeightSpec(_OURS + "out_proj", ("hidden_size", "linear_value_width"),
                                            layers="linear_layers"),
}


def text_weights(checkpoint: Checkpoint, config: Mapping[str, Any],
                 weight_map: Mapping[str, WeightSpec]) -> tuple[Checkpoint, dict[str, WeightSpec]]:
    """``weight_map`` under the checkpoint's text prefix (``TEXT_PREFIXES`` by architecture), and the checkpoint
    without the tensors no text graph reads (``SKIPPED_PREFIXES``): the ``DecoderFamily.text_weights`` hook."""
    prefix = TEXT_PREFIXES.get((config.get("architectures") or [""])[0], "model.")
    renamed = {prefix + hf.removeprefix("model.") if hf.startswith("model.") else hf: spec
               for hf, spec in weight_map.items()}
    kept = {name: info for name, info in checkpoint.tensors.items() if not name.startswith(SKIPPED_PREFIXES)}
    return Checkpoint(checkpoint.directory, kept), renamed


def load_qwen3_5_weights(checkpoint: Checkpoint, config: Mapping[str, Any], cfg: Qwen35Config,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight the graphs read under our names, cast to ``dtype`` (``text_weights``, then ``load_weights``)."""
    view, weight_map = text_weights(checkpoint, config, WEIGHT_MAP)
    return load_weights(view, cfg, weight_map, dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' ``Qwen3_5RMSNorm``: normalise in FP32, scale by ``1 + weight`` in FP32, cast back."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head of ``x [R, heads, head_dim]``; the rest pass through."""
    rotary = cos.shape[-1]
    return torch.cat([rotate_half_rope(x[..., :rotary], cos, sin_signed), x[..., rotary:]], dim=-1)


def gated_attention(weights: Mapping[str, torch.Tensor], cfg: Qwen35Config, layer: int, row: int,
                    normed: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rows: Rows, plan,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s gated full attention (row ``row`` of the K/V caches): ``[R, d_model]``."""
    prefix = f"layers.{layer}."
    num_rows, heads, kv_heads, head_dim = normed.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query, gate = F.linear(normed, weights[prefix + "q_proj"]).view(num_rows, heads, 2 * head_dim).chunk(2, dim=-1)
    query = zero_centered_rms_norm(query, weights[prefix + "q_norm"], cfg.rms_norm_eps)
    key = F.linear(normed, weights[prefix + "k_proj"]).view(num_rows, kv_heads, head_dim)
    key = zero_centered_rms_norm(key, weights[prefix + "k_norm"], cfg.rms_norm_eps)
    value = F.linear(normed, weights[prefix + "v_proj"]).view(num_rows, kv_heads, head_dim)
    query, key = partial_rope(query, cos, sin_signed), partial_rope(key, cos, sin_signed)
    write_rows(k_cache, row, rows, key, paged=True)
    write_rows(v_cache, row, rows, value, paged=True)
    if plan is None:  # packed prompt chunks (rows.segments)
        attended = packed_attention(query, k_cache[row], v_cache[row], rows)
    else:
        attended = cached_attention(query, k_cache, v_cache, row, plan)  # [R, heads * head_dim]
    attended = attended * torch.sigmoid(gate.reshape(num_rows, heads * head_dim))
    return F.linear(attended, weights[prefix + "o_proj"])  # [R, d_model]


def decoder_layer(weights: Mapping[str, torch.Tensor], cfg: Qwen35Config, layer: int, hidden: torch.Tensor,
                  rows: Rows, caches: Mapping[str, torch.Tensor], plan=None, rope=None) -> torch.Tensor:
    """One residual layer on ``hidden [R, d_model]``: zero-centered norm, the layer's token mixer (linear or gated
    full attention: ``plan`` and ``rope = (cos, signed sin)`` are the forward's), zero-centered norm, the MLP."""
    prefix = f"layers.{layer}."
    normed = zero_centered_rms_norm(hidden, weights[prefix + "attn_norm"], cfg.rms_norm_eps)
    row = kind_index(cfg.layer_kinds, layer)
    if cfg.layer_kinds[layer] == "linear":
        mixed = gated_delta_net(weights, cfg, layer, row, normed, rows, caches[CONV_STATE], caches[RECURRENT_STATE])
    else:
        mixed = gated_attention(weights, cfg, layer, row, normed, *rope, rows, plan, caches[K_CACHE], caches[V_CACHE])
    hidden = hidden + mixed
    normed = zero_centered_rms_norm(hidden, weights[prefix + "mlp_norm"], cfg.rms_norm_eps)
    gated = F.silu(F.linear(normed, weights[prefix + "gate_proj"])) * F.linear(normed, weights[prefix + "up_proj"])
    return hidden + F.linear(gated, weights[prefix + "down_proj"])  # [R, d_model]


def _check_caches(cfg: Qwen35Config, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> None:
    """Static (trace-time) check that every cache matches ``cache_shapes`` and the weights' dtype."""
    state = caches[CONV_STATE] if cfg.linear_layers else None  # [layers, slots, ...]
    slots = state.shape[1] if state is not None and state.dim() > 1 else 1
    for name in cfg.cache_names:
        pool = caches[name] if name in (K_CACHE, V_CACHE) and caches[name].dim() == 5 else None  # each its own extents
        shape = cfg.cache_shapes(slots, 1, pool.shape[2] if pool is not None else 1,
                                 pool.shape[1] if pool is not None else 1)[name]
        dtype = torch.float32 if name in FP32_STATE else weights["embed"].dtype
        if tuple(caches[name].shape) != shape or caches[name].dtype != dtype:
            raise ValueError(f"{name} must have shape {shape} and dtype {dtype}; "
                             f"found {tuple(caches[name].shape)} {caches[name].dtype}")


def qwen3_5_decoder(weights: Mapping[str, torch.Tensor], cfg: Qwen35Config, input_ids: torch.Tensor, rows: Rows,
                    caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Embedding, pre-norm residual layers (linear or gated full attention by ``cfg.layer_kinds``, then the MLP),
    final norm: final-normed hidden ``[R, d_model]``. Every norm is zero-centered."""
    _check_caches(cfg, weights, caches)
    hidden = F.embedding(input_ids.clamp(0, cfg.vocab_size - 1), weights["embed"])  # [R, d_model]
    plan = rope = None
    if cfg.full_layers:
        k_cache = caches[K_CACHE]
        plan = None if rows.segments is not None else plan_attention(  # packed rows plan per call
            rows, k_cache.shape[1], k_cache.shape[2], cfg.num_heads // cfg.num_kv_heads, k_cache.dtype)
        cos, sin = rope_cos_sin(cfg.rotary, rows.positions, hidden.dtype)  # [R, 1, rotary_dim]
        rope = (cos, signed_sin(sin))
    for layer in range(cfg.num_layers):
        hidden = decoder_layer(weights, cfg, layer, hidden, rows, caches, plan, rope)
    return zero_centered_rms_norm(hidden, weights["final_norm"], cfg.rms_norm_eps)  # [R, d_model]


FAMILY = DecoderFamily("qwen3_5", Qwen35Config.from_hf_config, WEIGHT_MAP, qwen3_5_decoder, windowed=True,
                       dynamic_chunks=True, packed=True, text_weights=text_weights)


def build(options: ExportOptions) -> RecipeBuild:
    if options.onnx:
        raise RecipeError("--onnx: recipe qwen3_5's chunked delta rule uses aten.linalg_solve_triangular, which has "
                          "no ONNX operator; export it without --onnx (it runs with --runtime torch)")
    return build_decoder(options, FAMILY)
