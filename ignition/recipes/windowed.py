"""What the decoder configs with sliding-window layers beside full ones share (``gemma3``, ``gpt_oss``): each
layer's cache kind, the state caches those kinds need, the window's read span bound to the export's step rows, the
manifest fields, and the refusal of ``config.json`` fields whose only supported value is fixed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ignition.catalog.cache_kinds import window_cells
from ignition.catalog.geometry import K_CACHE, K_WINDOW_CACHE, V_CACHE, V_WINDOW_CACHE, state_shape, window_blocks_bound
from ignition.recipes.checkpoint import CheckpointError
from ignition.recipes.config import DecoderWidths, check_positive_ints, paged_geometry

LAYER_TYPES: dict[str, str] = {"full_attention": "full", "sliding_attention": "sliding"}
"""HF ``layer_types`` entry -> our cache kind (catalog/cache_kinds.py)."""


def check_fixed_fields(config: Mapping[str, Any], fixed: Mapping[str, tuple[Any, str]], source: str) -> None:
    """Refuse a ``config.json`` field set to anything but its one supported value (``fixed``: field -> (value,
    why); absent or null is fine)."""
    for key, (value, why) in fixed.items():
        if config.get(key) is not None and config[key] != value:
            raise CheckpointError(f"{source}: field {key!r} must be {value!r} ({why}); found {config[key]!r}")


class WindowedLayers(DecoderWidths):
    """A mixin of frozen dataclasses with ``layer_kinds`` ("full" or "sliding" per layer), ``sliding_window``,
    ``window_cells`` and the ``DecoderWidths`` fields."""

    __slots__ = ()

    def check_layers(self, positive: tuple[str, ...]) -> None:
        """Refuse a non-positive field in ``positive``, heads that do not group evenly, an odd head width, or
        layer kinds that are not one ``LAYER_TYPES`` kind per layer."""
        name = type(self).__name__
        check_positive_ints(self, positive)
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise CheckpointError(f"{name}: num_heads must be a multiple of num_kv_heads and head_dim even; "
                                  f"found {self.num_heads}, {self.num_kv_heads}, {self.head_dim}")
        if len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - set(LAYER_TYPES.values()):
            raise CheckpointError(f"{name}.layer_kinds must name 'full' or 'sliding' for each of "
                                  f"{self.num_layers} layers; found {list(self.layer_kinds)}")

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(layer for layer, found in enumerate(self.layer_kinds) if found == kind)

    @property
    def cache_names(self) -> tuple[str, ...]:
        """The state caches in argument order: the full layers' K and V, then the sliding layers' pools."""
        return (((K_CACHE, V_CACHE) if self.layers_of("full") else ())
                + ((K_WINDOW_CACHE, V_WINDOW_CACHE) if self.layers_of("sliding") else ()))

    def with_steps(self, step_rows: int, max_seq_len: int):
        """This config with its window's read span sized for steps of at most ``step_rows`` rows a slot."""
        return replace(self, window_cells=window_cells(self.sliding_window, step_rows, max_seq_len))

    def cache_shapes(self, num_slots: int, max_seq_len: int, block_size: int | None = None,
                     kv_blocks=None, window_kv_blocks: int | None = None) -> dict[str, tuple[int, ...]]:
        """The caches of the kinds present: the full layers' pools (``config.paged_geometry``; ``kv_blocks``: the
        pool's own, a symbolic extent while tracing) and the sliding layers' pools (``window_kv_blocks``, None:
        ``catalog.geometry.window_blocks_bound``)."""
        if self.window_cells is None and self.layers_of("sliding"):
            raise ValueError(f"{type(self).__name__}.cache_shapes: bind the window's step rows first (with_steps)")
        pages = paged_geometry(num_slots, max_seq_len, block_size, kv_blocks)
        if window_kv_blocks is None and self.layers_of("sliding"):
            window_kv_blocks = window_blocks_bound(num_slots, self.window_cells, max_seq_len, pages["block_size"])
        geometry = dict(full_layers=len(self.layers_of("full")), sliding_layers=len(self.layers_of("sliding")),
                        num_slots=num_slots, max_seq_len=max_seq_len, window_cells=self.window_cells,
                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, window_kv_blocks=window_kv_blocks,
                        **pages)
        return {name: tuple(state_shape(name, **geometry)) for name in self.cache_names}

    def summary(self) -> dict:
        """Model fields of the core manifest."""
        cache = {"sliding_window": self.sliding_window, "window_cells": self.window_cells} \
            if self.layers_of("sliding") else {}
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "layer_kinds": list(self.layer_kinds)} | cache
