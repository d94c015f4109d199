"""The ``gpt_oss`` recipe (HF ``GptOssForCausalLM``, model type ``gpt_oss``): sliding and full layers alternating,
learned attention sinks, routed experts with a clamped SwiGLU.

``GptOssConfig.from_hf_config`` reads ``config.json`` and refuses what transformers would run differently from
this forward, naming the field. Each layer's cache kind comes from ``layer_types`` (default: even layers sliding,
odd ones full, as transformers derives it) through ``windowed.LAYER_TYPES``; every layer, of either kind, has a sink
logit per head (``recipes/attention.py`` ``sink_attention``). RoPE is one YaRN rotation for every layer
(``rope_parameters``). The experts are the checkpoint's stacked tensors (``[experts, hidden, 2 * intermediate]``
with gate and up interleaved), each routed expert reading its own row of them; experts stored in MXFP4
(``quantization_config.quant_method == "mxfp4"``) are dequantized when read (``recipes/mxfp4.py``). The build,
variants and graphs are the shared decoder ones (``llama.build_decoder``); the model is
``gpt_oss_model.gpt_oss_decoder``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.recipes.base import ExportOptions, RecipeBuild
from ignition.recipes.checkpoint import CheckpointError, read_field
from ignition.recipes.config import config_dtype
from ignition.recipes import gemma3
from ignition.recipes.gemma3 import LayerRope
from ignition.recipes.moe import MoeConfig
from ignition.recipes.rope import RopeScaling
from ignition.recipes.weights import WeightSpec
from ignition.recipes.windowed import WindowedLayers, check_fixed_fields

DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
"""transformers' GPT-OSS RoPE when a config states none (``GptOssConfig.__post_init__``, ``default_theta``)."""

# config.json fields whose only supported value is the one given (absent is fine): field -> (value, why).
FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "the experts' activation is the clamped SwiGLU (swiglu_alpha, swiglu_limit)"),
    "attention_bias": (True, "the q/k/v/o projections carry biases"),
}
MXFP4 = "mxfp4"
"""The one ``quantization_config.quant_method`` this recipe reads: its experts are dequantized at export."""


@dataclass(frozen=True, slots=True)
class GptOssConfig(WindowedLayers):
    """Static description of a GPT-OSS decoder, parsed from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]  # each layer's cache kind, "full" or "sliding"
    sliding_window: int  # W: a sliding layer's row attends over positions (p - W, p]
    rope: LayerRope
    moe: MoeConfig  # router "topk_softmax", every layer sparse
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32
    mxfp4: bool = False  # the checkpoint stores its experts as MXFP4 blocks and scales
    window_cells: int | None = None  # the positions a sliding step reads, bound to the export's step rows (``with_steps``)
    row_blocks: int = ROW_REDUCTION_BLOCKS  # o reduction blocks this graph holds (layers.row_linear)
    row_shard: bool = False  # this graph is one rank's share of the o sums (layers.row_linear)
    family: str = field(default="gpt_oss", init=False)

    def __post_init__(self) -> None:
        self.check_layers(("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                           "max_position_embeddings", "sliding_window"))
        if not self.swiglu_alpha > 0 or not self.swiglu_limit > 0 or not self.rms_norm_eps > 0:
            raise CheckpointError(f"GptOssConfig: swiglu_alpha, swiglu_limit and rms_norm_eps must be > 0; found "
                                  f"{self.swiglu_alpha!r}, {self.swiglu_limit!r}, {self.rms_norm_eps!r}")

    @property
    def gate_up_width(self) -> int:
        """Each expert's interleaved gate and up columns (gate at even columns, up at odd ones)."""
        return 2 * self.moe.intermediate_size

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str) -> GptOssConfig:
        """Parse a Hugging Face ``config.json`` dict."""
        check_fixed_fields(config, FIXED_FIELDS, source)
        num_layers = read_field(config, "num_hidden_layers", int, source)
        head_dim = read_field(config, "head_dim", int, source)
        max_positions = read_field(config, "max_position_embeddings", int, source)
        dtype = config_dtype(config, source)
        moe = MoeConfig(router="topk_softmax",
                        num_experts=read_field(config, "num_local_experts", int, source),
                        experts_per_token=read_field(config, "num_experts_per_tok", int, source),
                        intermediate_size=read_field(config, "intermediate_size", int, source),
                        sparse_layers=tuple(range(num_layers)))
        if moe.experts_per_token > moe.num_experts:
            raise CheckpointError(f"{source}: field 'num_experts_per_tok' must be <= num_local_experts = "
                                  f"{moe.num_experts}; found {moe.experts_per_token}")
        return cls(
            vocab_size=read_field(config, "vocab_size", int, source),
            hidden_size=read_field(config, "hidden_size", int, source),
            num_layers=num_layers,
            num_heads=read_field(config, "num_attention_heads", int, source),
            num_kv_heads=read_field(config, "num_key_value_heads", int, source),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            layer_kinds=layer_kinds(config, num_layers, source),
            sliding_window=read_field(config, "sliding_window", int, source),
            rope=layer_rope(config, head_dim, max_positions, source),
            moe=moe,
            swiglu_alpha=read_field(config, "swiglu_alpha", float, source, 1.702),
            swiglu_limit=read_field(config, "swiglu_limit", float, source, 7.0),
            rms_norm_eps=read_field(config, "rms_norm_eps", float, source, 1e-5),
            tie_word_embeddings=read_field(config, "tie_word_embeddings", bool, source, False),
            dtype=dtype,
            mxfp4=quantized(config, source),
        )


def quantized(config: Mapping[str, Any], source: str) -> bool:
    """True for MXFP4-stored experts (the only quantization read); any other ``quantization_config`` is refused."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != MXFP4:
        raise CheckpointError(f"{source}: field 'quantization_config.quant_method' must be {MXFP4!r} (experts "
                              f"dequantized at export) or absent; found {method!r}. Export a BF16 checkpoint "
                              f"instead (e.g. transformers' GptOssForCausalLM.from_pretrained(..., "
                              f"quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(DIR))")
    return True


def layer_kinds(config: Mapping[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's cache kind from ``layer_types`` (``windowed.LAYER_TYPES``), else transformers' default:
    layer i slides when ``(i + 1) % 2`` is non-zero."""
    if config.get("layer_types") is None:
        return tuple("sliding" if (layer + 1) % 2 else "full" for layer in range(num_layers))
    return gemma3.layer_kinds(config, num_layers, source)  # the same reading of a stated layer_types


def layer_rope(config: Mapping[str, Any], head_dim: int, max_positions: int, source: str) -> LayerRope:
    """The RoPE of every layer: ``rope_parameters`` (or legacy ``rope_theta`` and ``rope_scaling``), else
    transformers' default YaRN (``DEFAULT_ROPE``)."""
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config = {**config, "rope_parameters": dict(DEFAULT_ROPE, rope_theta=config.get("rope_theta", 150_000.0))}
    elif isinstance(config.get("rope_parameters"), dict):
        params = dict(config["rope_parameters"])
        params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_ROPE["rope_theta"]))
        config = {**config, "rope_parameters": params}
    theta, scaling = RopeScaling.from_hf_config(config, max_positions, source)
    return LayerRope(theta, scaling, head_dim)


_LAYER = "model.layers.{layer}."
_ATTN = _LAYER + "self_attn."
_EXPERTS = _LAYER + "mlp.experts."
# HF tensor name -> ours (a table, as llama's WEIGHT_MAP): biased attention with sinks, router, stacked experts.
WEIGHT_MAP: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed", ("vocab_size", "hidden_size")),
    "model.norm.weight": WeightSpec("final_norm", ("hidden_size",)),
    "lm_head.weight": WeightSpec("lm_head", ("vocab_size", "hidden_size"), "untied_lm_head"),
    _LAYER + "input_layernorm.weight": WeightSpec("layers.{layer}.attn_norm", ("hidden_size",)),
    _LAYER + "post_attention_layernorm.weight": WeightSpec("layers.{layer}.mlp_norm", ("hidden_size",)),
    _ATTN + "q_proj.weight": WeightSpec("layers.{layer}.q_proj", ("q_width", "hidden_size")),
    _ATTN + "q_proj.bias": WeightSpec("layers.{layer}.q_bias", ("q_width",)),
    _ATTN + "k_proj.weight": WeightSpec("layers.{layer}.k_proj", ("kv_width", "hidden_size")),
    _ATTN + "k_proj.bias": WeightSpec("layers.{layer}.k_bias", ("kv_width",)),
    _ATTN + "v_proj.weight": WeightSpec("layers.{layer}.v_proj", ("kv_width", "hidden_size")),
    _ATTN + "v_proj.bias": WeightSpec("layers.{layer}.v_bias", ("kv_width",)),
    _ATTN + "o_proj.weight": WeightSpec("layers.{layer}.o_proj", ("hidden_size", "q_width")),
    _ATTN + "o_proj.bias": WeightSpec("layers.{layer}.o_bias", ("hidden_size",)),
    _ATTN + "sinks": WeightSpec("layers.{layer}.sinks", ("num_heads",)),
    _LAYER + "mlp.router.weight": WeightSpec("layers.{layer}.router", ("moe.num_experts", "hidden_size")),
    _LAYER + "mlp.router.bias": WeightSpec("layers.{layer}.router_bias", ("moe.num_experts",)),
    _EXPERTS + "gate_up_proj": WeightSpec("layers.{layer}.experts.gate_up",
                                          ("moe.num_experts", "hidden_size", "gate_up_width")),
    _EXPERTS + "gate_up_proj_bias": WeightSpec("layers.{layer}.experts.gate_up_bias",
                                               ("moe.num_experts", "gate_up_width")),
    _EXPERTS + "down_proj": WeightSpec("layers.{layer}.experts.down",
                                       ("moe.num_experts", "moe.intermediate_size", "hidden_size")),
    _EXPERTS + "down_proj_bias": WeightSpec("layers.{layer}.experts.down_bias", ("moe.num_experts", "hidden_size")),
}


def parse(config: Mapping[str, Any], source: str) -> GptOssConfig:
    return GptOssConfig.from_hf_config(config, source)


def build(options: ExportOptions) -> RecipeBuild:
    from ignition.recipes.gpt_oss_model import gpt_oss_decoder
    from ignition.recipes.llama import DecoderFamily, build_decoder
    from ignition.recipes.mxfp4 import open_gpt_oss_checkpoint

    family = DecoderFamily("gpt_oss", parse, WEIGHT_MAP, gpt_oss_decoder, windowed=True, packed=True,
                           checkpoint=open_gpt_oss_checkpoint)
    return build_decoder(options, family)
