"""Qwen3 / Llama / Qwen3-MoE model configuration and weight layout, parsed from a Hugging Face checkpoint.

``ModelConfig.from_hf_config`` reads ``config.json``; ``WEIGHT_MAP`` maps HF tensor names to ours
(a table, not code); ``load_weights`` validates a checkpoint against the layout the config implies
and loads it. Every failure is a CheckpointError naming the file, field or tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ignition.catalog.geometry import K_CACHE, V_CACHE, kv_blocks_bound, state_shape
from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.recipes import weights as weight_tables
from ignition.recipes.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError, family_of, read_field
from ignition.recipes.moe import MoeConfig, check_routing
from ignition.recipes.rope import RopeScaling
from ignition.recipes.weights import WeightSpec

# family -> whether attention applies RMSNorm to each q/k head before RoPE.
FAMILY_QK_NORM: dict[str, bool] = {"qwen3": True, "llama": False, "qwen3_moe": True}

# config.json `dtype` / `torch_dtype` -> torch dtype.
CONFIG_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def config_dtype(config: Mapping[str, Any], source: str) -> torch.dtype:
    """The checkpoint's dtype: ``dtype``, else ``torch_dtype``, else FP32 (what HF loads when unset)."""
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype_name not in CONFIG_DTYPES:
        raise CheckpointError(f"{source}: field 'dtype' must be one of {list(CONFIG_DTYPES)}; found {dtype_name!r}")
    return CONFIG_DTYPES[dtype_name]


def check_positive_ints(config, names: tuple[str, ...]) -> None:
    """Refuse a config whose field in ``names`` is not a positive int (a bool is not one)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{type(config).__name__}.{name} must be a positive int; found {value!r}")


class DecoderWidths:
    """The projection widths every decoder config derives from its head counts (a mixin of frozen dataclasses
    with ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``tie_word_embeddings``)."""

    __slots__ = ()

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def untied_lm_head(self) -> bool:
        return not self.tie_word_embeddings


@dataclass(frozen=True, slots=True)
class ModelConfig(DecoderWidths):
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
    moe: MoeConfig | None = None  # qwen3_moe: routed experts on moe.sparse_layers
    row_blocks: int = ROW_REDUCTION_BLOCKS  # o/down reduction blocks this graph holds (a rank: its share)
    row_shard: bool = False  # this graph is one rank's share of the o/down sums (layers.row_linear)
    cache_names: ClassVar[tuple[str, ...]] = (K_CACHE, V_CACHE)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_QK_NORM:
            raise CheckpointError(f"ModelConfig.family must be one of {sorted(FAMILY_QK_NORM)}; found {self.family!r}")
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                   "num_kv_heads", "head_dim", "max_position_embeddings"))
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

    def cache_shapes(self, num_slots: int, max_seq_len: int, block_size: int | None = None,
                     kv_blocks=None) -> dict[str, tuple[int, ...]]:
        """The KV cache state buffers, both ``kv_cache_shape``, in the model (export) dtype."""
        shape = kv_cache_shape(self, num_slots, max_seq_len, block_size, kv_blocks)
        return {name: shape for name in self.cache_names}

    def summary(self) -> dict:
        """Model fields of the core manifest."""
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "layer_kinds": ["full"] * self.num_layers}

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.sparse_layers if self.moe else ()

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if layer not in self.moe_layers)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; invalid or unsupported fields raise CheckpointError."""
        family = family_of(config, source)
        hidden_size = read_field(config, "hidden_size", int, source)
        num_heads = read_field(config, "num_attention_heads", int, source)
        head_dim = config.get("head_dim")
        if head_dim is None and family == "llama":
            head_dim = hidden_size // num_heads if num_heads > 0 else 0  # HF Llama derives it
        head_dim = read_field({"head_dim": head_dim}, "head_dim", int, source)
        if read_field(config, "hidden_act", str, source, "silu") != "silu":
            raise CheckpointError(f"{source}: field 'hidden_act' must be 'silu'; found {config['hidden_act']!r}")
        if read_field(config, "use_sliding_window", bool, source, False):
            raise CheckpointError(f"{source}: field 'use_sliding_window' must be false; found true")
        layer_types = config.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise CheckpointError(
                f"{source}: field 'layer_types' must contain only 'full_attention'; found {sorted(set(layer_types))}")
        dtype = config_dtype(config, source)
        max_positions = read_field(config, "max_position_embeddings", int, source)
        rope_theta, rope_scaling = RopeScaling.from_hf_config(config, max_positions, source)
        return cls(
            family=family,
            vocab_size=read_field(config, "vocab_size", int, source),
            hidden_size=hidden_size,
            intermediate_size=read_field(config, "intermediate_size", int, source),
            num_layers=read_field(config, "num_hidden_layers", int, source),
            num_heads=num_heads,
            num_kv_heads=read_field(config, "num_key_value_heads", int, source, num_heads),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=read_field(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=read_field(config, "tie_word_embeddings", bool, source, False),
            qk_norm=FAMILY_QK_NORM[family],
            attention_bias=read_field(config, "attention_bias", bool, source, False),
            mlp_bias=read_field(config, "mlp_bias", bool, source, False),
            dtype=dtype,
            moe=qwen3_moe_config(config, source) if family == "qwen3_moe" else None,
        )


def qwen3_moe_config(config: Mapping[str, Any], source: str) -> MoeConfig:
    """Qwen3-MoE routing: softmax top-k; layer i is sparse unless in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0`` (HF's rule)."""
    num_layers = read_field(config, "num_hidden_layers", int, source)
    experts_field = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    num_experts = read_field(config, experts_field, int, source)
    step = read_field(config, "decoder_sparse_step", int, source, 1)
    if step <= 0:
        raise CheckpointError(f"{source}: field 'decoder_sparse_step' must be a positive int; found {step!r}")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
                                             for i in mlp_only):
        raise CheckpointError(f"{source}: field 'mlp_only_layers' must list layer indices in [0, {num_layers}); "
                              f"found {mlp_only!r}")
    if read_field(config, "shared_expert_intermediate_size", int, source, 0):
        raise CheckpointError(f"{source}: field 'shared_expert_intermediate_size' must be 0 or absent "
                              f"(Qwen3-MoE has no shared expert); found {config['shared_expert_intermediate_size']!r}")
    moe = MoeConfig(
        router="softmax_topk", num_experts=num_experts,
        experts_per_token=read_field(config, "num_experts_per_tok", int, source),
        intermediate_size=read_field(config, "moe_intermediate_size", int, source),
        sparse_layers=tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0),
        norm_topk_prob=read_field(config, "norm_topk_prob", bool, source, False))
    check_routing(moe, source, {"num_experts": experts_field, "experts_per_token": "num_experts_per_tok",
                                "num_groups": "n_group", "topk_groups": "topk_group"})
    return moe


_LAYER = "model.layers.{layer}."
_EXPERT = _LAYER + "mlp.experts.{expert}."
_DENSE, _SPARSE = "dense_mlp_layers", "moe_layers"
# HF tensor name -> our name / shape / presence flag / layers. `{layer}` expands to the spec's layers
# (all by default), `{expert}` to 0..num_experts-1.
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
    _LAYER + "mlp.gate_proj.weight": WeightSpec("layers.{layer}.gate_proj", ("intermediate_size", "hidden_size"),
                                                layers=_DENSE),
    _LAYER + "mlp.gate_proj.bias": WeightSpec("layers.{layer}.gate_bias", ("intermediate_size",), "mlp_bias", _DENSE),
    _LAYER + "mlp.up_proj.weight": WeightSpec("layers.{layer}.up_proj", ("intermediate_size", "hidden_size"),
                                              layers=_DENSE),
    _LAYER + "mlp.up_proj.bias": WeightSpec("layers.{layer}.up_bias", ("intermediate_size",), "mlp_bias", _DENSE),
    _LAYER + "mlp.down_proj.weight": WeightSpec("layers.{layer}.down_proj", ("hidden_size", "intermediate_size"),
                                                layers=_DENSE),
    _LAYER + "mlp.down_proj.bias": WeightSpec("layers.{layer}.down_bias", ("hidden_size",), "mlp_bias", _DENSE),
    _LAYER + "mlp.gate.weight": WeightSpec("layers.{layer}.router", ("moe.num_experts", "hidden_size"), layers=_SPARSE),
    _EXPERT + "gate_proj.weight": WeightSpec("layers.{layer}.experts.{expert}.gate_proj",
                                             ("moe.intermediate_size", "hidden_size"), layers=_SPARSE),
    _EXPERT + "up_proj.weight": WeightSpec("layers.{layer}.experts.{expert}.up_proj",
                                           ("moe.intermediate_size", "hidden_size"), layers=_SPARSE),
    _EXPERT + "down_proj.weight": WeightSpec("layers.{layer}.experts.{expert}.down_proj",
                                             ("hidden_size", "moe.intermediate_size"), layers=_SPARSE),
}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint must hold (no ``lm_head.weight`` when tied)."""
    return weight_tables.expected_shapes(cfg, WEIGHT_MAP)


def load_weights(checkpoint: Checkpoint, cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Validate ``checkpoint`` against ``cfg`` and load every tensor under our names (see ``weights.load_weights``)."""
    return weight_tables.load_weights(checkpoint, cfg, WEIGHT_MAP, dtype)


def paged_geometry(num_slots: int, max_seq_len: int, block_size: int | None = None, kv_blocks=None) -> dict:
    """The ``kv_blocks`` and ``block_size`` symbols of the paged caches (``catalog.geometry.PAGED_STATE``).

    ``block_size`` None: the slot layout, each slot one block of ``max_seq_len`` positions (``kv_blocks =
    num_slots``; a recipe-level forward without block tables, ``layers.page_cells``). ``kv_blocks`` None: the
    declared upper bound, ``kv_blocks_bound``; else the pool's own (a symbolic extent while tracing)."""
    for name, value in (("num_slots", num_slots), ("max_seq_len", max_seq_len), ("block_size", block_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"kv_cache_shape: {name} must be a positive int; found {value!r}")
    if block_size is None:
        return dict(kv_blocks=num_slots if kv_blocks is None else kv_blocks, block_size=max_seq_len)
    return dict(kv_blocks=kv_blocks_bound(num_slots, max_seq_len, block_size) if kv_blocks is None else kv_blocks,
                block_size=block_size)


def kv_cache_shape(cfg: ModelConfig, num_slots: int, max_seq_len: int, block_size: int | None = None,
                   kv_blocks=None) -> tuple[int, int, int, int, int]:
    """Shape of ``k_cache`` and ``v_cache``: ``[num_layers, kv_blocks, block_size, num_kv_heads, head_dim]``
    (``paged_geometry``; without a ``block_size``, the slot layout ``[num_layers, num_slots, max_seq_len, ...]``)."""
    return tuple(state_shape(K_CACHE, full_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             **paged_geometry(num_slots, max_seq_len, block_size, kv_blocks)))
