"""DeepSeek V4 (HF ``DeepseekV4ForCausalLM``, model type ``deepseek_v4``): its config and weight table.

``DeepseekV4Config.from_hf_config`` reads ``config.json`` and refuses what transformers would run differently from
``deepseek_v4_model.deepseek_v4_decoder``, naming the field. Each layer's cache kind comes from ``layer_types``
through ``LAYER_TYPES`` (``catalog/cache_kinds.py``): ``shared_window`` (a sliding window of one K=V head),
``compressed`` (CSA: the window plus compressed entries chosen by the lightning indexer) or ``heavily_compressed``
(HCA: the window plus every compressed entry). Sliding layers rotate with ``rope_parameters.main``, compressed ones
and their compressors with ``rope_parameters.compress``. Weights are read under the checkpoint's own names
(``WEIGHT_MAP``: DeepSeek's release names, with or without transformers' ``model.`` prefix).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ignition.recipes.checkpoint import Checkpoint, CheckpointError, read_field
from ignition.recipes.config import CONFIG_DTYPES
from ignition.recipes.rope import RopeScaling

LAYER_TYPES: dict[str, str] = {"sliding_attention": "shared_window", "compressed_sparse_attention": "compressed",
                               "heavily_compressed_attention": "heavily_compressed"}
"""HF ``layer_types`` entry -> our cache kind (catalog/cache_kinds.py)."""

LEGACY_RATIOS: dict[int, str] = {0: "sliding_attention", 4: "compressed_sparse_attention",
                                 128: "heavily_compressed_attention"}
"""A legacy config's ``compress_ratios`` entry -> its layer type (transformers' ``_COMPRESS_RATIO_TO_LAYER_TYPE``)."""

# config.json fields whose only supported value is the one given (absent is fine): field -> (value, why).
FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "scoring_func": ("sqrtsoftplus", "the routers score with sqrt(softplus(logits))"),
    "hidden_act": ("silu", "the experts are SwiGLU"),
    "num_key_value_heads": (1, "attention is shared-KV multi-query (one K=V head)"),
    "n_shared_experts": (1, "one shared expert of moe_intermediate_size"),
    "norm_topk_prob": (True, "the routed weights are normalized over the chosen experts"),
    "attention_bias": (False, "the projections carry no bias"),
    "tie_word_embeddings": (False, "the head is its own tensor"),
    "quantization_config": (None, "quantized (FP8/FP4) weights must be dequantized first"),
}


@dataclass(frozen=True, slots=True)
class LayerRope:
    """One RoPE of the model (``rope.RopeConfig``): its base, scaling and rotated width."""

    rope_theta: float
    rope_scaling: RopeScaling
    head_dim: int  # the rotated trailing channels of a head (qk_rope_head_dim)


@dataclass(frozen=True, slots=True)
class Experts:
    """The MoE of every layer (``weights.WeightSpec`` expands ``{expert}`` over ``num_experts``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    """Static description of a DeepSeek V4 decoder, parsed from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int  # the rotated trailing channels of every head (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int  # W: every attention block's window branch sees positions (p - W, p]
    layer_kinds: tuple[str, ...]  # each layer's cache kind (LAYER_TYPES values)
    hash_layers: tuple[int, ...]  # layers whose experts come from the tid2eid table
    csa_rate: int  # m: a compressed-sparse entry per m positions (overlapping windows of 2m)
    hca_rate: int  # m': a heavily-compressed entry per m' positions
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    moe: Experts
    main_rope: LayerRope
    compress_rope: LayerRope
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    top_names: str = "release"  # which TOP_LEVEL_NAMES column the checkpoint uses
    step_rows: int | None = None  # an export's most rows a slot a step (with_steps): its rings' extra cells
    max_seq_len: int | None = None  # an export's positions a slot (with_steps): its entry tables' extent
    mtp_layers: int = 0  # num_nextn_predict_layers: the multi-token-prediction layers declared (deepseek_v4_mtp)
    mtp_kinds: tuple[str, ...] | None = None  # their cache kinds; None where the config lists none for them
    family: str = field(default="deepseek_v4", init=False)
    tie_word_embeddings = False  # the head is its own tensor (FIXED_FIELDS)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "rope_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "index_heads",
                     "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"DeepseekV4Config.{name} must be a positive int; found {value!r}")
        if self.rope_dim % 2 or self.rope_dim > min(self.head_dim, self.index_head_dim):
            raise CheckpointError(f"DeepseekV4Config.rope_dim must be even and at most head_dim {self.head_dim} and "
                                  f"index_head_dim {self.index_head_dim}; found {self.rope_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise CheckpointError(f"DeepseekV4Config: num_heads * head_dim ({self.num_heads * self.head_dim}) must "
                                  f"split into o_groups = {self.o_groups} equal groups")
        if len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - set(LAYER_TYPES.values()):
            raise CheckpointError(f"DeepseekV4Config.layer_kinds must name one of {sorted(LAYER_TYPES.values())} "
                                  f"for each of {self.num_layers} layers; found {list(self.layer_kinds)}")

    @property
    def topk_layers(self) -> tuple[int, ...]:
        """Layers routed by top-k over the scores plus their correction bias."""
        return tuple(layer for layer in range(self.num_layers) if layer not in self.hash_layers)

    def kind_layers(self, kind: str) -> tuple[int, ...]:
        return tuple(layer for layer, name in enumerate(self.layer_kinds) if name == kind)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return self.kind_layers("compressed")

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return self.kind_layers("heavily_compressed")

    def with_steps(self, step_rows: int, max_seq_len: int) -> DeepseekV4Config:
        """This config bound to an export's steps of at most ``step_rows`` rows a slot and ``max_seq_len``."""
        return replace(self, step_rows=step_rows, max_seq_len=max_seq_len)

    @property
    def cache_names(self) -> tuple[str, ...]:
        """The state buffers of the layer kinds present, in argument order (``STATE_BUFFERS``)."""
        from ignition.recipes.deepseek_v4_model import STATE_BUFFERS
        return tuple(dict.fromkeys(name for kind, roles in STATE_BUFFERS.items() if kind in self.layer_kinds
                                   for name in roles.values()))

    def geometry(self, num_slots: int, max_seq_len: int) -> dict[str, int]:
        """The manifest symbols of the state buffers (``deepseek_v4_model.state_geometry``)."""
        from ignition.recipes.deepseek_v4_model import state_geometry
        if self.step_rows is None:
            raise ValueError("DeepseekV4Config: bind the export's step rows first (with_steps)")
        return state_geometry(self, num_slots, max_seq_len, self.step_rows)

    def cache_shapes(self, num_slots: int, max_seq_len: int) -> dict[str, tuple[int, ...]]:
        """Each state buffer's shape (``catalog.geometry.STATE_SHAPES``), in the model dtype."""
        from ignition.catalog.geometry import state_shape
        geometry = self.geometry(num_slots, max_seq_len)
        return {name: tuple(state_shape(name, **geometry)) for name in self.cache_names}

    def summary(self) -> dict:
        """Model fields of the core manifest: the sizes, each layer's kind and the fields its kind needs
        (``catalog.cache_kinds.CACHE_KINDS``)."""
        from ignition.catalog.cache_kinds import CACHE_KINDS
        geometry = self.geometry(1, self.max_seq_len) | {"sliding_window": self.sliding_window,
                                                         "csa_rate": self.csa_rate, "hca_rate": self.hca_rate}
        fields = dict.fromkeys(f for kind in self.layer_kinds for f in CACHE_KINDS[kind].fields)
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": 1, "head_dim": self.head_dim, "layer_kinds": list(self.layer_kinds),
                **{f: geometry[f] for f in fields}}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json",
                       dtype: torch.dtype | None = None) -> DeepseekV4Config:
        for name, (value, why) in FIXED_FIELDS.items():
            if name in config and config[name] != value:
                raise CheckpointError(f"{source}: field {name!r} must be {value!r} ({why}); found {config[name]!r}")
        layers = read_field(config, "num_hidden_layers", int, source)
        types = config.get("layer_types")
        if types is None and isinstance(config.get("compress_ratios"), list):
            types = [LEGACY_RATIOS.get(ratio, ratio) for ratio in config["compress_ratios"]]
        if not isinstance(types, list) or len(types) < layers or set(types[:layers]) - set(LAYER_TYPES):
            raise CheckpointError(f"{source}: field 'layer_types' must list one of {sorted(LAYER_TYPES)} for each of "
                                  f"{layers} layers; found {types!r}")
        mlp_types = config.get("mlp_layer_types")
        if mlp_types is None:
            hashed = read_field(config, "num_hash_layers", int, source, 3)
            mlp_types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
        if not isinstance(mlp_types, list) or len(mlp_types) < layers or set(mlp_types[:layers]) - {"hash_moe", "moe"}:
            raise CheckpointError(f"{source}: field 'mlp_layer_types' must list 'hash_moe' or 'moe' for each of "
                                  f"{layers} layers; found {mlp_types!r}")
        rates = config.get("compress_rates") or {}
        head_dim = read_field(config, "head_dim", int, source, 512)
        partial = read_field(config, "partial_rotary_factor", float, source, 64 / 512)
        rope_dim = int(head_dim * partial)
        max_positions = read_field(config, "max_position_embeddings", int, source)
        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        if dtype is None and dtype_name not in CONFIG_DTYPES:
            raise CheckpointError(f"{source}: field 'dtype' must be one of {sorted(CONFIG_DTYPES)}; found {dtype_name!r}")
        return cls(
            vocab_size=read_field(config, "vocab_size", int, source), hidden_size=read_field(config, "hidden_size", int, source),
            num_layers=layers, num_heads=read_field(config, "num_attention_heads", int, source), head_dim=head_dim,
            rope_dim=rope_dim, q_lora_rank=read_field(config, "q_lora_rank", int, source),
            o_groups=read_field(config, "o_groups", int, source), o_lora_rank=read_field(config, "o_lora_rank", int, source),
            sliding_window=read_field(config, "sliding_window", int, source),
            layer_kinds=tuple(LAYER_TYPES[kind] for kind in types[:layers]),
            hash_layers=tuple(layer for layer in range(layers) if mlp_types[layer] == "hash_moe"),
            csa_rate=read_field(rates, "compressed_sparse_attention", int, f"{source} (compress_rates)", 4),
            hca_rate=read_field(rates, "heavily_compressed_attention", int, f"{source} (compress_rates)", 128),
            index_heads=read_field(config, "index_n_heads", int, source),
            index_head_dim=read_field(config, "index_head_dim", int, source),
            index_topk=read_field(config, "index_topk", int, source),
            hc_mult=read_field(config, "hc_mult", int, source), hc_sinkhorn_iters=read_field(config, "hc_sinkhorn_iters", int, source),
            hc_eps=read_field(config, "hc_eps", float, source, 1e-6),
            moe=Experts(num_experts=read_field(config, "n_routed_experts", int, source),
                        top_k=read_field(config, "num_experts_per_tok", int, source),
                        intermediate_size=read_field(config, "moe_intermediate_size", int, source),
                        routed_scaling_factor=read_field(config, "routed_scaling_factor", float, source, 1.0),
                        swiglu_limit=read_field(config, "swiglu_limit", float, source, 10.0)),
            main_rope=_rope(config, "main", "rope_theta", rope_dim, max_positions, source),
            compress_rope=_rope(config, "compress", "compress_rope_theta", rope_dim, max_positions, source),
            max_position_embeddings=max_positions, rms_norm_eps=read_field(config, "rms_norm_eps", float, source, 1e-6),
            dtype=dtype or CONFIG_DTYPES[dtype_name], **_mtp_fields(config, layers, source))


def _mtp_fields(config: Mapping[str, Any], layers: int, source: str) -> dict[str, Any]:
    """``mtp_layers`` (``num_nextn_predict_layers``, 0 when absent) and ``mtp_kinds``: the types listed for them
    after the decoder's layers in ``layer_types`` or, in a release config, ``compress_ratios`` (None: unlisted)."""
    count = read_field(config, "num_nextn_predict_layers", int, source, 0)
    if count < 0:
        raise CheckpointError(f"{source}: field 'num_nextn_predict_layers' must be >= 0; found {count}")
    types, ratios = config.get("layer_types"), config.get("compress_ratios")
    if isinstance(types, list) and len(types) >= layers + count:
        named = types[layers:layers + count]
    elif isinstance(ratios, list) and len(ratios) >= layers + count:
        named = [LEGACY_RATIOS.get(ratio, ratio) for ratio in ratios[layers:layers + count]]
    else:
        return {"mtp_layers": count}
    if set(named) - set(LAYER_TYPES):
        raise CheckpointError(f"{source}: the multi-token-prediction layers' entries of 'layer_types' must be among "
                              f"{sorted(LAYER_TYPES)} (of 'compress_ratios' among {sorted(LEGACY_RATIOS)}); found "
                              f"{named}")
    return {"mtp_layers": count, "mtp_kinds": tuple(LAYER_TYPES[kind] for kind in named)}


def _rope(config: Mapping[str, Any], label: str, theta_field: str, rope_dim: int, max_positions: int,
          source: str) -> LayerRope:
    """``rope_parameters[label]`` (transformers' nested form), or the flat legacy fields it is built from."""
    params = config.get("rope_parameters") or {}
    nested = params.get(label) if isinstance(params.get(label), dict) else None
    if nested is None:  # legacy: a flat scaling dict for the compressed layers, plain RoPE for the sliding ones
        flat = {k: v for k, v in params.items() if not isinstance(v, dict)} if label == "compress" else {}
        nested = {**flat, "rope_theta": config.get(theta_field, 10_000.0 if label == "main" else 160_000.0)}
        if nested.get("rope_type", nested.get("type")) == "yarn":
            nested.setdefault("attention_factor", 1.0)  # transformers: V4's compressed YaRN has no mscale
    nested = {k: v for k, v in nested.items() if k != "partial_rotary_factor"}
    theta, scaling = RopeScaling.from_hf_config({"rope_parameters": nested}, max_positions,
                                                f"{source} (rope_parameters.{label})")
    return LayerRope(theta, scaling, rope_dim)


TOP_LEVEL_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("embed.weight", "model.embed_tokens.weight"),
    "head": ("head.weight", "head.weight"),
    "final_norm": ("norm.weight", "model.norm.weight"),
    "hc_head_fn": ("hc_head_fn", "model.hc_head.hc_fn"),
    "hc_head_base": ("hc_head_base", "model.hc_head.hc_base"),
    "hc_head_scale": ("hc_head_scale", "model.hc_head.hc_scale"),
}
"""Our model-level names -> (DeepSeek's release name, the name transformers' ``save_pretrained`` writes)."""

TOP_LEVEL_SHAPES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab_size", "hidden_size"), "head": ("vocab_size", "hidden_size"), "final_norm": ("hidden_size",),
    "hc_head_fn": ("hc_mult", "hc_width"), "hc_head_base": ("hc_mult",), "hc_head_scale": ("one",)}


@dataclass(frozen=True, slots=True)
class LayerWeight:
    """One tensor of a layer: its name inside the layer (``layers.{i}.`` prefixed in both layouts, transformers
    adding ``model.``), ours, its shape as ``extent`` names, which layers hold it, a dtype it keeps."""

    name: str
    ours: str
    shape: tuple[str, ...]
    layers: str = "all"  # "all", "hash", "topk", "compressed", "heavily_compressed"
    dtype: torch.dtype | None = None


LAYER_WEIGHTS: tuple[LayerWeight, ...] = (
    LayerWeight("attn_norm.weight", "attn_norm", ("hidden_size",)),
    LayerWeight("ffn_norm.weight", "ffn_norm", ("hidden_size",)),
    *(LayerWeight(f"hc_{site}_{part}", f"hc_{site}_{part}", shape) for site in ("attn", "ffn")
      for part, shape in (("fn", ("hc_mix", "hc_width")), ("base", ("hc_mix",)), ("scale", ("three",)))),
    LayerWeight("attn.wq_a.weight", "wq_a", ("q_lora_rank", "hidden_size")),
    LayerWeight("attn.q_norm.weight", "q_norm", ("q_lora_rank",)),
    LayerWeight("attn.wq_b.weight", "wq_b", ("q_width", "q_lora_rank")),
    LayerWeight("attn.wkv.weight", "wkv", ("head_dim", "hidden_size")),
    LayerWeight("attn.norm.weight", "kv_norm", ("head_dim",)),
    LayerWeight("attn.wo_a.weight", "wo_a", ("o_a_rows", "o_group_width")),
    LayerWeight("attn.wo_b.weight", "wo_b", ("hidden_size", "o_a_rows")),
    LayerWeight("attn.attn_sink", "attn_sink", ("num_heads",), dtype=torch.float32),
    # CSA: two series of head_dim a position (Ca, Cb), and the indexer's own compressor at index_head_dim
    LayerWeight("attn.compressor.wkv.weight", "compressor.wkv", ("csa_source", "hidden_size"), "compressed"),
    LayerWeight("attn.compressor.wgate.weight", "compressor.wgate", ("csa_source", "hidden_size"), "compressed"),
    LayerWeight("attn.compressor.ape", "compressor.ape", ("csa_rate", "csa_source"), "compressed", torch.float32),
    LayerWeight("attn.compressor.norm.weight", "compressor.norm", ("head_dim",), "compressed"),
    LayerWeight("attn.indexer.compressor.wkv.weight", "indexer.wkv", ("index_source", "hidden_size"), "compressed"),
    LayerWeight("attn.indexer.compressor.wgate.weight", "indexer.wgate", ("index_source", "hidden_size"), "compressed"),
    LayerWeight("attn.indexer.compressor.ape", "indexer.ape", ("csa_rate", "index_source"), "compressed", torch.float32),
    LayerWeight("attn.indexer.compressor.norm.weight", "indexer.norm", ("index_head_dim",), "compressed"),
    LayerWeight("attn.indexer.wq_b.weight", "indexer.wq_b", ("index_width", "q_lora_rank"), "compressed"),
    LayerWeight("attn.indexer.weights_proj.weight", "indexer.weights_proj", ("index_heads", "hidden_size"), "compressed"),
    # HCA: one series of head_dim a position
    LayerWeight("attn.compressor.wkv.weight", "compressor.wkv", ("head_dim", "hidden_size"), "heavily_compressed"),
    LayerWeight("attn.compressor.wgate.weight", "compressor.wgate", ("head_dim", "hidden_size"), "heavily_compressed"),
    LayerWeight("attn.compressor.ape", "compressor.ape", ("hca_rate", "head_dim"), "heavily_compressed", torch.float32),
    LayerWeight("attn.compressor.norm.weight", "compressor.norm", ("head_dim",), "heavily_compressed"),
    LayerWeight("ffn.gate.weight", "router", ("num_experts", "hidden_size")),
    LayerWeight("ffn.gate.tid2eid", "tid2eid", ("vocab_size", "top_k"), "hash", torch.int64),
    LayerWeight("ffn.gate.bias", "router_bias", ("num_experts",), "topk", torch.float32),
    *(LayerWeight(f"ffn.shared_experts.{w}.weight", f"shared.{w}", shape) for w, shape in
      (("w1", ("moe_width", "hidden_size")), ("w2", ("hidden_size", "moe_width")), ("w3", ("moe_width", "hidden_size")))),
    *(LayerWeight(f"ffn.experts.{{expert}}.{w}.weight", f"experts.{{expert}}.{w}", shape) for w, shape in
      (("w1", ("moe_width", "hidden_size")), ("w2", ("hidden_size", "moe_width")), ("w3", ("moe_width", "hidden_size")))),
)
"""Every tensor of a layer, as the checkpoint names it (``{expert}`` expands over the routed experts)."""


def extents(cfg: DeepseekV4Config) -> dict[str, int]:
    """The extents ``TOP_LEVEL_SHAPES`` and ``LAYER_WEIGHTS`` name."""
    width = cfg.num_heads * cfg.head_dim
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "hc_mult": cfg.hc_mult,
            "hc_width": cfg.hc_mult * cfg.hidden_size, "hc_mix": (2 + cfg.hc_mult) * cfg.hc_mult, "one": 1, "three": 3,
            "q_lora_rank": cfg.q_lora_rank, "q_width": width, "head_dim": cfg.head_dim,
            "o_a_rows": cfg.o_groups * cfg.o_lora_rank, "o_group_width": width // cfg.o_groups,
            "num_heads": cfg.num_heads, "csa_source": 2 * cfg.head_dim, "csa_rate": cfg.csa_rate,
            "hca_rate": cfg.hca_rate, "index_source": 2 * cfg.index_head_dim, "index_head_dim": cfg.index_head_dim,
            "index_width": cfg.index_heads * cfg.index_head_dim, "index_heads": cfg.index_heads,
            "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "moe_width": cfg.moe.intermediate_size}


def holds(cfg: DeepseekV4Config, which: str, layer: int) -> bool:
    if which == "all":
        return True
    if which in ("hash", "topk"):
        return (layer in cfg.hash_layers) == (which == "hash")
    return cfg.layer_kinds[layer] == which


def weight_layout(cfg: DeepseekV4Config) -> dict[str, tuple[str, tuple[int, ...], torch.dtype | None]]:
    """Checkpoint name -> (our name, shape, kept dtype) of every tensor ``cfg`` requires."""
    column, prefix = (0, "") if cfg.top_names == "release" else (1, "model.")
    sizes = extents(cfg)
    layout = {names[column]: (ours, tuple(sizes[e] for e in TOP_LEVEL_SHAPES[ours]), None)
              for ours, names in TOP_LEVEL_NAMES.items()}
    for layer in range(cfg.num_layers):
        for weight in LAYER_WEIGHTS:
            if not holds(cfg, weight.layers, layer):
                continue
            experts = range(cfg.moe.num_experts) if "{expert}" in weight.name else (0,)
            for expert in experts:
                name = f"{prefix}layers.{layer}." + weight.name.format(expert=expert)
                layout[name] = (f"layers.{layer}." + weight.ours.format(expert=expert),
                                tuple(sizes[e] for e in weight.shape), weight.dtype)
    return layout


def read_checkpoint(checkpoint: Checkpoint, config: Mapping[str, Any], dtype: torch.dtype | None = None
                    ) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """The config and every weight under our names (``load_weights``)."""
    cfg = DeepseekV4Config.from_hf_config(config, str(checkpoint.directory / "config.json"), dtype)
    cfg = replace(cfg, top_names="release" if TOP_LEVEL_NAMES["embed"][0] in checkpoint else "transformers")
    return cfg, load_weights(checkpoint, cfg)


def load_weights(checkpoint: Checkpoint, cfg: DeepseekV4Config, dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """Every decoder weight under our names, in ``dtype`` (the config's by default) where ``LAYER_WEIGHTS`` keeps
    none; the layout is the one whose embedding name is present. Multi-token-prediction tensors (``mtp.*``) are
    let through unread (``deepseek_v4_mtp.load_mtp_weights`` reads and shape-checks them)."""
    cfg = replace(cfg, top_names="release" if TOP_LEVEL_NAMES["embed"][0] in checkpoint else "transformers")
    layout = weight_layout(cfg)
    mtp = {name: checkpoint.info(name).shape for name in checkpoint.names() if name.startswith(("mtp.", "model.mtp."))}
    checkpoint.validate({name: shape for name, (_, shape, _) in layout.items()}, optional=mtp)
    return {ours: checkpoint.load(name).to(kept or dtype or cfg.dtype) for name, (ours, _, kept) in layout.items()}


__all__ = ["DeepseekV4Config", "LAYER_TYPES", "TOP_LEVEL_NAMES", "LAYER_WEIGHTS", "weight_layout", "read_checkpoint",
           "load_weights"]
