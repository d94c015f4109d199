"""The ``gemma3`` recipe (HF ``Gemma3ForCausalLM``, model type ``gemma3_text``, and the text model of a multimodal
``Gemma3ForConditionalGeneration``): sliding-window layers beside global ones.

``Gemma3Config.from_hf_config`` reads ``config.json`` and refuses what transformers would run differently from
this forward, naming the field. Each layer's cache kind comes from ``layer_types`` (or the legacy
``sliding_window_pattern``) through ``LAYER_TYPES``: ``sliding`` layers page pools of their own, a step reading
``window_cells`` positions (``catalog/cache_kinds.py``), ``full`` layers every position. Global layers rotate with ``rope_parameters
.full_attention`` (legacy: ``rope_theta``, ``rope_scaling``), sliding ones with ``rope_parameters
.sliding_attention`` (legacy: ``rope_local_base_freq``). The build, variants and graphs are the shared decoder
ones (``llama.build_decoder``); the model is ``gemma3_model.gemma3_decoder``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.recipes.base import ExportOptions, RecipeBuild
from ignition.recipes.checkpoint import Checkpoint, CheckpointError, read_field
from ignition.recipes.config import config_dtype
from ignition.recipes.rope import RopeScaling
from ignition.recipes.weights import WeightSpec
from ignition.recipes.windowed import LAYER_TYPES, WindowedLayers, check_fixed_fields

DEFAULT_SLIDING_PATTERN = 6
"""transformers' ``sliding_window_pattern`` when a config states neither it nor ``layer_types``: every sixth layer
is global."""

DEFAULT_THETA = {"full": 1_000_000.0, "sliding": 10_000.0}
"""transformers' Gemma 3 RoPE bases when a config states none: global layers, sliding layers."""

# config.json fields whose only supported value is the one given (absent is fine): field -> (value, why).
FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_activation": ("gelu_pytorch_tanh", "the MLP is GeGLU with the tanh approximation"),
    "use_bidirectional_attention": (False, "attention is causal"),
    "attn_logit_softcapping": (None, "scores are not soft-capped (the fused attention kernel has no tanh cap)"),
    "final_logit_softcapping": (None, "the logits are not soft-capped (the reduction reads the raw LM-head row)"),
    "attention_bias": (False, "the projections carry no bias"),
    "quantization_config": (None, "quantized weights must be dequantized first"),
}


@dataclass(frozen=True, slots=True)
class LayerRope:
    """The RoPE of one kind of layer (``rope.RopeConfig``): its base, scaling and head width."""

    rope_theta: float
    rope_scaling: RopeScaling
    head_dim: int


@dataclass(frozen=True, slots=True)
class Gemma3Config(WindowedLayers):
    """Static description of a Gemma 3 text decoder, parsed from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]  # each layer's cache kind, "full" or "sliding"
    sliding_window: int  # W: a sliding layer's row attends over positions (p - W, p]
    query_pre_attn_scalar: float  # the scores' scale is query_pre_attn_scalar ** -0.5
    global_rope: LayerRope
    local_rope: LayerRope
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    dtype: torch.dtype = torch.float32
    window_cells: int | None = None  # the positions a sliding step reads, bound to the export's step rows (``with_steps``)
    row_blocks: int = ROW_REDUCTION_BLOCKS  # o/down reduction blocks this graph holds (layers.row_linear)
    row_shard: bool = False  # this graph is one rank's share of the o/down sums (layers.row_linear)
    family: str = field(default="gemma3", init=False)

    def __post_init__(self) -> None:
        self.check_layers(("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                           "num_kv_heads", "head_dim", "max_position_embeddings", "sliding_window"))
        if not self.query_pre_attn_scalar > 0 or not self.rms_norm_eps > 0:
            raise CheckpointError(f"Gemma3Config: query_pre_attn_scalar and rms_norm_eps must be > 0; found "
                                  f"{self.query_pre_attn_scalar!r}, {self.rms_norm_eps!r}")

    @property
    def scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str) -> Gemma3Config:
        """Parse a Hugging Face ``config.json`` dict (a ``gemma3`` multimodal one: its ``text_config``)."""
        check_fixed_fields(config, FIXED_FIELDS, source)
        num_layers = read_field(config, "num_hidden_layers", int, source)
        head_dim = read_field(config, "head_dim", int, source)
        max_positions = read_field(config, "max_position_embeddings", int, source)
        dtype = config_dtype(config, source)
        return cls(
            vocab_size=read_field(config, "vocab_size", int, source),
            hidden_size=read_field(config, "hidden_size", int, source),
            intermediate_size=read_field(config, "intermediate_size", int, source),
            num_layers=num_layers,
            num_heads=read_field(config, "num_attention_heads", int, source),
            num_kv_heads=read_field(config, "num_key_value_heads", int, source),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            layer_kinds=layer_kinds(config, num_layers, source),
            sliding_window=read_field(config, "sliding_window", int, source),
            query_pre_attn_scalar=read_field(config, "query_pre_attn_scalar", float, source),
            global_rope=layer_rope(config, "full", head_dim, max_positions, source),
            local_rope=layer_rope(config, "sliding", head_dim, max_positions, source),
            rms_norm_eps=read_field(config, "rms_norm_eps", float, source, 1e-6),
            tie_word_embeddings=read_field(config, "tie_word_embeddings", bool, source, True),
            dtype=dtype,
        )


def layer_kinds(config: Mapping[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's cache kind from ``layer_types`` (``LAYER_TYPES``), else from ``sliding_window_pattern`` as
    transformers derives it (layer i is global when ``(i + 1) % pattern == 0``)."""
    types = config.get("layer_types")
    if types is None:
        pattern = read_field(config, "sliding_window_pattern", int, source, DEFAULT_SLIDING_PATTERN)
        if pattern < 1:
            raise CheckpointError(f"{source}: field 'sliding_window_pattern' must be a positive int; found {pattern}")
        return tuple("sliding" if (layer + 1) % pattern else "full" for layer in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"{source}: field 'layer_types' must list one of {sorted(LAYER_TYPES)} for each of "
                              f"num_hidden_layers = {num_layers} layers; found {types!r}")
    return tuple(LAYER_TYPES[t] for t in types)


def layer_rope(config: Mapping[str, Any], kind: str, head_dim: int, max_positions: int, source: str) -> LayerRope:
    """The RoPE of ``kind``'s layers: ``rope_parameters[<HF layer type>]`` (transformers 5), else the legacy fields
    (``rope_theta`` and ``rope_scaling`` for global layers, ``rope_local_base_freq`` for sliding ones)."""
    hf_type = next(name for name, ours in LAYER_TYPES.items() if ours == kind)
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get(hf_type), dict):
        params = dict(nested[hf_type])
        params.setdefault("rope_theta", DEFAULT_THETA[kind])
        where = f"{source} (rope_parameters.{hf_type})"
        theta, scaling = RopeScaling.from_hf_config({"rope_parameters": params}, max_positions, where)
        return LayerRope(theta, scaling, head_dim)
    if kind == "sliding":
        theta = read_field(config, "rope_local_base_freq", float, source, DEFAULT_THETA[kind])
        return LayerRope(theta, RopeScaling(), head_dim)
    legacy = {"rope_theta": read_field(config, "rope_theta", float, source, DEFAULT_THETA[kind])}
    if config.get("rope_scaling") is not None:
        legacy["rope_scaling"] = config["rope_scaling"]
    theta, scaling = RopeScaling.from_hf_config(legacy, max_positions, source)
    return LayerRope(theta, scaling, head_dim)


_LAYER = "model.layers.{layer}."
# HF tensor name -> ours (a table, as llama's WEIGHT_MAP): the four norms of a layer, q/k norms, GeGLU MLP.
WEIGHT_MAP: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed", ("vocab_size", "hidden_size")),
    "model.norm.weight": WeightSpec("final_norm", ("hidden_size",)),
    "lm_head.weight": WeightSpec("lm_head", ("vocab_size", "hidden_size"), "untied_lm_head"),
    _LAYER + "input_layernorm.weight": WeightSpec("layers.{layer}.attn_norm", ("hidden_size",)),
    _LAYER + "self_attn.q_proj.weight": WeightSpec("layers.{layer}.q_proj", ("q_width", "hidden_size")),
    _LAYER + "self_attn.k_proj.weight": WeightSpec("layers.{layer}.k_proj", ("kv_width", "hidden_size")),
    _LAYER + "self_attn.v_proj.weight": WeightSpec("layers.{layer}.v_proj", ("kv_width", "hidden_size")),
    _LAYER + "self_attn.o_proj.weight": WeightSpec("layers.{layer}.o_proj", ("hidden_size", "q_width")),
    _LAYER + "self_attn.q_norm.weight": WeightSpec("layers.{layer}.q_norm", ("head_dim",)),
    _LAYER + "self_attn.k_norm.weight": WeightSpec("layers.{layer}.k_norm", ("head_dim",)),
    _LAYER + "post_attention_layernorm.weight": WeightSpec("layers.{layer}.post_attn_norm", ("hidden_size",)),
    _LAYER + "pre_feedforward_layernorm.weight": WeightSpec("layers.{layer}.mlp_norm", ("hidden_size",)),
    _LAYER + "post_feedforward_layernorm.weight": WeightSpec("layers.{layer}.post_mlp_norm", ("hidden_size",)),
    _LAYER + "mlp.gate_proj.weight": WeightSpec("layers.{layer}.gate_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.up_proj.weight": WeightSpec("layers.{layer}.up_proj", ("intermediate_size", "hidden_size")),
    _LAYER + "mlp.down_proj.weight": WeightSpec("layers.{layer}.down_proj", ("hidden_size", "intermediate_size")),
}


MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"
"""A ``gemma3`` checkpoint with a vision tower: its ``text_config`` and text weights are exported, nothing else."""

MULTIMODAL_LAYOUTS: dict[str, str] = {
    "model.language_model.": "lm_head.weight",  # transformers 5 ``save_pretrained``
    "language_model.model.": "language_model.lm_head.weight",  # the Hub's original layout
}
"""Where a multimodal checkpoint stores the text model: the prefix that replaces ``model.`` in ``WEIGHT_MAP``, and
the LM head's name (present only when untied)."""

log = logging.getLogger("ignition.recipes")


def is_multimodal(config: Mapping[str, Any]) -> bool:
    return (config.get("architectures") or [None])[0] == MULTIMODAL_ARCHITECTURE


def parse(config: Mapping[str, Any], source: str) -> Gemma3Config:
    """``Gemma3Config`` of a ``gemma3_text`` config, or of a multimodal config's ``text_config`` (saying so)."""
    if not is_multimodal(config):
        return Gemma3Config.from_hf_config(config, source)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: a {MULTIMODAL_ARCHITECTURE} config needs a 'text_config' object; "
                              f"found {text!r}")
    # the dtype is stated at the top; so is the tying transformers applies to the whole model (it wins over
    # text_config's: a tied multimodal checkpoint stores no LM head whatever text_config says)
    inherited = {key: config[key] for key in ("dtype", "torch_dtype") if key in config and key not in text}
    if "tie_word_embeddings" in config:
        inherited["tie_word_embeddings"] = config["tie_word_embeddings"]
    log.warning("%s: a multimodal Gemma 3 checkpoint (%s); exporting its text model only (text_config and the "
                "language model's weights; the vision tower and projector are left out)", source,
                MULTIMODAL_ARCHITECTURE)
    return Gemma3Config.from_hf_config(text | inherited, f"{source} (text_config)")


def text_weights(checkpoint: Checkpoint, config: Mapping[str, Any],
                 weight_map: Mapping[str, WeightSpec]) -> tuple[Checkpoint, dict[str, WeightSpec]]:
    """The checkpoint's text-model tensors and ``weight_map`` under their stored names (``MULTIMODAL_LAYOUTS``); a
    ``gemma3_text`` checkpoint is returned as it is."""
    if not is_multimodal(config):
        return checkpoint, dict(weight_map)
    layout = next((prefix for prefix in MULTIMODAL_LAYOUTS if any(n.startswith(prefix) for n in checkpoint.tensors)),
                  None)
    if layout is None:
        raise CheckpointError(f"{checkpoint.directory}: a {MULTIMODAL_ARCHITECTURE} checkpoint stores its text model "
                              f"under one of {list(MULTIMODAL_LAYOUTS)}; found no tensor there")
    head = MULTIMODAL_LAYOUTS[layout]
    renamed = {head if hf == "lm_head.weight" else layout + hf.removeprefix("model."): spec
               for hf, spec in weight_map.items()}
    text = {name: info for name, info in checkpoint.tensors.items() if name.startswith(layout) or name == head}
    return Checkpoint(checkpoint.directory, text), renamed


def build(options: ExportOptions) -> RecipeBuild:
    from ignition.recipes.gemma3_model import gemma3_decoder
    from ignition.recipes.llama import DecoderFamily, build_decoder

    family = DecoderFamily("gemma3", parse, WEIGHT_MAP, gemma3_decoder, windowed=True, dynamic_chunks=True,
                           packed=True, text_weights=text_weights)
    return build_decoder(options, family)
