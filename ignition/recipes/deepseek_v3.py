"""The ``deepseek_v3`` recipe (HF ``DeepseekV3ForCausalLM``): MLA, yarn RoPE, dense-then-MoE layers.

``DeepseekV3Config.from_hf_config`` reads ``config.json`` and rejects values transformers'
model would not run or that we do not implement, naming the field. ``WEIGHT_MAP`` maps the HF
tensor names (per-expert tensors as stored) to ours; the router and its score-correction bias
stay fp32 like HF keeps them. The build, variants and graphs are the shared decoder ones
(``llama.build_decoder``); the model is ``mla.mla_decoder`` over the compressed latent pools, reading the key
window only (``windowed``; its prompt chunks keep their rows, the MoE capacity ladder's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ignition.catalog.geometry import LATENT_CACHE, ROPE_KEY_CACHE
from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.recipes.base import ExportOptions, RecipeBuild
from ignition.recipes.checkpoint import CheckpointError, read_field
from ignition.recipes.config import CONFIG_DTYPES
from ignition.recipes.llama import DecoderFamily, build_decoder
from ignition.recipes.mla import mla_cache_shapes, mla_decoder
from ignition.recipes.moe import MoeConfig, check_routing
from ignition.recipes.rope import RopeScaling
from ignition.recipes.weights import WeightSpec

# config.json fields whose only supported value is the one given (absent is fine): field -> (value, why).
FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "the MLPs and experts are SiLU-gated"),
    "scoring_func": ("sigmoid", "routing scores are sigmoids (DeepSeek-V3)"),
    "topk_method": ("noaux_tc", "routing is group-limited top-k with e_score_correction_bias"),
    "moe_layer_freq": (1, "every layer from first_k_dense_replace on is an MoE layer"),
    "attention_bias": (False, "MLA projections carry no bias"),
    "quantization_config": (None, "quantized (e.g. FP8 block-scaled) weights must be dequantized first"),
}

# our MoeConfig field -> HF field name, for routing errors.
ROUTING_FIELDS = {"num_experts": "n_routed_experts", "experts_per_token": "num_experts_per_tok",
                  "num_groups": "n_group", "topk_groups": "topk_group"}


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    """Static description of a DeepSeek-V3 decoder, parsed from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    moe: MoeConfig
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32
    row_blocks: int = ROW_REDUCTION_BLOCKS  # o/down reduction blocks this graph holds (layers.row_linear)
    row_shard: bool = False  # this graph is one rank's share of the o/down sums (layers.row_linear)
    cache_names: ClassVar[tuple[str, ...]] = (LATENT_CACHE, ROPE_KEY_CACHE)
    mlp_bias: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"DeepseekV3Config.{name} must be a positive int; found {value!r}")
        if self.q_lora_rank is not None and (isinstance(self.q_lora_rank, bool) or self.q_lora_rank <= 0):
            raise CheckpointError(f"DeepseekV3Config.q_lora_rank must be a positive int or null; "
                                  f"found {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(f"DeepseekV3Config.qk_rope_head_dim must be even; found {self.qk_rope_head_dim}")
        if self.dtype not in CONFIG_DTYPES.values():
            raise CheckpointError(f"DeepseekV3Config.dtype must be one of {list(CONFIG_DTYPES)}; found {self.dtype}")

    head_dim = property(lambda self: self.qk_rope_head_dim, doc="RoPE width (HF sets head_dim = qk_rope_head_dim)")
    qk_head_dim = property(lambda self: self.qk_nope_head_dim + self.qk_rope_head_dim)
    q_width = property(lambda self: self.num_heads * self.qk_head_dim)
    kv_a_width = property(lambda self: self.kv_lora_rank + self.qk_rope_head_dim)
    kv_b_width = property(lambda self: self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
    attended_width = property(lambda self: self.num_heads * self.v_head_dim)
    has_q_lora = property(lambda self: self.q_lora_rank is not None)
    no_q_lora = property(lambda self: self.q_lora_rank is None)
    untied_lm_head = property(lambda self: not self.tie_word_embeddings)
    moe_layers = property(lambda self: self.moe.sparse_layers)
    dense_mlp_layers = property(lambda self: tuple(i for i in range(self.num_layers) if i not in self.moe_layers))

    @property
    def attention_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE (HF)."""
        scale, rope = self.qk_head_dim ** -0.5, self.rope_scaling
        if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
            scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
        return scale

    def cache_shapes(self, num_slots: int, max_seq_len: int, block_size: int | None = None,
                     kv_blocks=None) -> dict[str, tuple[int, ...]]:
        return mla_cache_shapes(self, num_slots, max_seq_len, block_size, kv_blocks)

    def summary(self) -> dict:
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                "layer_kinds": ["full"] * self.num_layers}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str) -> DeepseekV3Config:
        """Parse a Hugging Face ``config.json`` dict; absent behaviour flags take transformers' defaults."""
        for key, (value, why) in FIXED_FIELDS.items():
            if config.get(key) is not None and config[key] != value:
                raise CheckpointError(f"{source}: field {key!r} must be {value!r} ({why}); found {config[key]!r}")
        num_layers = read_field(config, "num_hidden_layers", int, source)
        num_heads = read_field(config, "num_attention_heads", int, source)
        if read_field(config, "num_key_value_heads", int, source, num_heads) != num_heads:
            raise CheckpointError(f"{source}: field 'num_key_value_heads' must equal num_attention_heads={num_heads} "
                                  f"(MLA expands one latent into every head); found {config['num_key_value_heads']!r}")
        first_dense = read_field(config, "first_k_dense_replace", int, source, 3)
        if not 0 <= first_dense <= num_layers:
            raise CheckpointError(f"{source}: field 'first_k_dense_replace' must be in [0, {num_layers}]; "
                                  f"found {first_dense}")
        shared = read_field(config, "n_shared_experts", int, source, 1)
        if shared < 1:
            raise CheckpointError(f"{source}: field 'n_shared_experts' must be >= 1; found {shared}")
        moe = MoeConfig(
            router="grouped_sigmoid_topk", num_experts=read_field(config, "n_routed_experts", int, source),
            experts_per_token=read_field(config, "num_experts_per_tok", int, source),
            intermediate_size=read_field(config, "moe_intermediate_size", int, source),
            sparse_layers=tuple(range(first_dense, num_layers)),
            norm_topk_prob=read_field(config, "norm_topk_prob", bool, source, True),
            num_groups=read_field(config, "n_group", int, source, 8),
            topk_groups=read_field(config, "topk_group", int, source, 4),
            routed_scaling_factor=read_field(config, "routed_scaling_factor", float, source, 2.5),
            num_shared_experts=shared)
        check_routing(moe, source, ROUTING_FIELDS)
        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        if dtype_name not in CONFIG_DTYPES:
            raise CheckpointError(f"{source}: field 'dtype' must be one of {list(CONFIG_DTYPES)}; found {dtype_name!r}")
        max_positions = read_field(config, "max_position_embeddings", int, source)
        rope_theta, rope_scaling = RopeScaling.from_hf_config(config, max_positions, source)
        return cls(
            vocab_size=read_field(config, "vocab_size", int, source),
            hidden_size=read_field(config, "hidden_size", int, source),
            intermediate_size=read_field(config, "intermediate_size", int, source),
            num_layers=num_layers, num_heads=num_heads,
            q_lora_rank=read_field(config, "q_lora_rank", int, source, None) if "q_lora_rank" in config else 1536,
            kv_lora_rank=read_field(config, "kv_lora_rank", int, source),
            qk_nope_head_dim=read_field(config, "qk_nope_head_dim", int, source),
            qk_rope_head_dim=read_field(config, "qk_rope_head_dim", int, source),
            v_head_dim=read_field(config, "v_head_dim", int, source),
            max_position_embeddings=max_positions, moe=moe,
            rms_norm_eps=read_field(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rope_interleave=read_field(config, "rope_interleave", bool, source, True),
            tie_word_embeddings=read_field(config, "tie_word_embeddings", bool, source, False),
            dtype=CONFIG_DTYPES[dtype_name])


_LAYER, _ATTN, _MLP = "model.layers.{layer}.", "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
_DENSE, _SPARSE = "dense_mlp_layers", "moe_layers"
_OURS = "layers.{layer}."
# HF tensor name -> our name / shape / presence flag / layers / kept dtype.
WEIGHT_MAP: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed", ("vocab_size", "hidden_size")),
    "model.norm.weight": WeightSpec("final_norm", ("hidden_size",)),
    "lm_head.weight": WeightSpec("lm_head", ("vocab_size", "hidden_size"), "untied_lm_head"),
    _LAYER + "input_layernorm.weight": WeightSpec(_OURS + "attn_norm", ("hidden_size",)),
    _ATTN + "q_proj.weight": WeightSpec(_OURS + "q_proj", ("q_width", "hidden_size"), "no_q_lora"),
    _ATTN + "q_a_proj.weight": WeightSpec(_OURS + "q_a_proj", ("q_lora_rank", "hidden_size"), "has_q_lora"),
    _ATTN + "q_a_layernorm.weight": WeightSpec(_OURS + "q_a_norm", ("q_lora_rank",), "has_q_lora"),
    _ATTN + "q_b_proj.weight": WeightSpec(_OURS + "q_b_proj", ("q_width", "q_lora_rank"), "has_q_lora"),
    _ATTN + "kv_a_proj_with_mqa.weight": WeightSpec(_OURS + "kv_a_proj", ("kv_a_width", "hidden_size")),
    _ATTN + "kv_a_layernorm.weight": WeightSpec(_OURS + "kv_a_norm", ("kv_lora_rank",)),
    _ATTN + "kv_b_proj.weight": WeightSpec(_OURS + "kv_b_proj", ("kv_b_width", "kv_lora_rank")),
    _ATTN + "o_proj.weight": WeightSpec(_OURS + "o_proj", ("hidden_size", "attended_width")),
    _LAYER + "post_attention_layernorm.weight": WeightSpec(_OURS + "mlp_norm", ("hidden_size",)),
    _MLP + "gate_proj.weight": WeightSpec(_OURS + "gate_proj", ("intermediate_size", "hidden_size"), layers=_DENSE),
    _MLP + "up_proj.weight": WeightSpec(_OURS + "up_proj", ("intermediate_size", "hidden_size"), layers=_DENSE),
    _MLP + "down_proj.weight": WeightSpec(_OURS + "down_proj", ("hidden_size", "intermediate_size"), layers=_DENSE),
    _MLP + "gate.weight": WeightSpec(_OURS + "router", ("moe.num_experts", "hidden_size"), layers=_SPARSE,
                                     dtype=torch.float32),
    _MLP + "gate.e_score_correction_bias": WeightSpec(_OURS + "router_bias", ("moe.num_experts",), layers=_SPARSE,
                                                      dtype=torch.float32),
    _MLP + "experts.{expert}.gate_proj.weight": WeightSpec(_OURS + "experts.{expert}.gate_proj",
                                                           ("moe.intermediate_size", "hidden_size"), layers=_SPARSE),
    _MLP + "experts.{expert}.up_proj.weight": WeightSpec(_OURS + "experts.{expert}.up_proj",
                                                         ("moe.intermediate_size", "hidden_size"), layers=_SPARSE),
    _MLP + "experts.{expert}.down_proj.weight": WeightSpec(_OURS + "experts.{expert}.down_proj",
                                                           ("hidden_size", "moe.intermediate_size"), layers=_SPARSE),
    _MLP + "shared_experts.gate_proj.weight": WeightSpec(_OURS + "shared.gate_proj",
                                                         ("moe.shared_intermediate_size", "hidden_size"), layers=_SPARSE),
    _MLP + "shared_experts.up_proj.weight": WeightSpec(_OURS + "shared.up_proj",
                                                       ("moe.shared_intermediate_size", "hidden_size"), layers=_SPARSE),
    _MLP + "shared_experts.down_proj.weight": WeightSpec(_OURS + "shared.down_proj",
                                                         ("hidden_size", "moe.shared_intermediate_size"), layers=_SPARSE),
}

FAMILY = DecoderFamily("deepseek_v3", DeepseekV3Config.from_hf_config, WEIGHT_MAP, mla_decoder, windowed=True)


def build(options: ExportOptions) -> RecipeBuild:
    return build_decoder(options, FAMILY)
