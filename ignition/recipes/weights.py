"""HF tensor names -> ours, as tables: one ``WeightSpec`` per HF name pattern, expanded from a config.

A weight map is ``{hf_pattern: WeightSpec}``. Patterns may hold ``{layer}`` (expanded over the
layers the spec names, all by default) and ``{expert}`` (expanded over ``cfg.moe.num_experts``).
Shapes and flags are config attribute names (dotted names reach into sub-configs, e.g.
``moe.intermediate_size``). ``load_weights`` checks a checkpoint against the expanded layout and
reports every missing, extra or misshaped tensor together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from ignition.recipes.checkpoint import Checkpoint


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """Our name for one HF tensor, its shape as config attributes, and where it is present.

    ``present_if``: a boolean config attribute gating the tensor; ``layers``: a config attribute
    listing the layers that hold it (``None``: every layer); ``dtype``: a dtype the tensor keeps
    whatever the export dtype (HF keeps e.g. DeepSeek's router in fp32).
    """

    ours: str
    shape: tuple[str, ...]
    present_if: str | None = None
    layers: str | None = None
    dtype: torch.dtype | None = None


def _expansions(cfg: Any, hf: str, spec: WeightSpec) -> list[dict[str, int]]:
    layers = range(cfg.num_layers) if spec.layers is None else attrgetter(spec.layers)(cfg)
    if not layers:
        return []
    experts = range(cfg.moe.num_experts) if "{expert}" in hf else (None,)
    return [{"layer": layer, "expert": expert} for layer in layers for expert in experts]


def weight_layout(cfg: Any, weight_map: Mapping[str, WeightSpec]) -> dict[str, tuple[str, tuple[int, ...], WeightSpec]]:
    """HF name -> (our name, shape, spec) for every tensor ``cfg`` requires: model-level tensors, then layer by layer."""
    present = {hf: spec for hf, spec in weight_map.items()
               if spec.present_if is None or attrgetter(spec.present_if)(cfg)}
    shape_of = lambda spec: tuple(attrgetter(dim)(cfg) for dim in spec.shape)  # noqa: E731
    layout = {hf: (spec.ours, shape_of(spec), spec) for hf, spec in present.items() if "{layer}" not in hf}
    per_layer: dict[int, dict] = {layer: {} for layer in range(cfg.num_layers)}
    for hf, spec in present.items():
        if "{layer}" in hf:
            for names in _expansions(cfg, hf, spec):
                per_layer[names["layer"]][hf.format(**names)] = (spec.ours.format(**names), shape_of(spec), spec)
    for layer in range(cfg.num_layers):
        layout |= per_layer[layer]
    return layout


def expected_shapes(cfg: Any, weight_map: Mapping[str, WeightSpec]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint must hold (no ``lm_head.weight`` when tied)."""
    return {hf_name: shape for hf_name, (_, shape, _) in weight_layout(cfg, weight_map).items()}


def load_weights(checkpoint: Checkpoint, cfg: Any, weight_map: Mapping[str, WeightSpec],
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Validate ``checkpoint`` against ``cfg`` and load every tensor under our names, cast to ``dtype``.

    With tied embeddings ``weights["lm_head"] is weights["embed"]`` (shared, not copied); a tied
    checkpoint may still carry ``lm_head.weight``, which is shape-checked and ignored like HF does.
    """
    dtype = cfg.dtype if dtype is None else dtype
    tied_extra = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
    layout = weight_layout(cfg, weight_map)
    checkpoint.validate({hf: shape for hf, (_, shape, _) in layout.items()}, optional=tied_extra)
    weights = {ours: checkpoint.load(hf_name).to(spec.dtype or dtype) for hf_name, (ours, _, spec) in layout.items()}
    if cfg.tie_word_embeddings:
        weights["lm_head"] = weights["embed"]
    return weights
