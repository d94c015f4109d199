"""Per-layer cache kinds as data: what each kind of layer keeps per slot, and how large it is.

Every layer of a core declares its kind in ``manifest.json:model.layer_kinds`` (one name a layer, in layer
order). A kind's layers share its state buffers, stacked on their first extent in layer order: the k-th
``sliding`` layer of the model is index k of ``k_window_cache``. The buffers' shapes are expressions over
manifest symbols in ``catalog.geometry.STATE_SHAPES`` (the recipes build their declarations from them and
validate-core resolves them, the GEOM rules); this table says which buffers belong to which kind.

- ``full``: every position of the sequence, ``[layers, num_slots, max_seq_len, ...]`` (GQA's K and V, MLA's
  latent and rope key).
- ``sliding``: a window of ``W = model.sliding_window`` positions (a recipe with attention sinks adds them as
  weights; they change no buffer). The cache is a ring of ``model.window_cells`` cells a slot:
  position ``p`` lives in cell ``p mod window_cells``. A step writes all its rows before any row attends, so
  a step of ``R`` rows (a prompt chunk, or a verify round's ``S + 1`` rows) starting at position ``s`` must not
  overwrite a position its first row still reads, ``s - W + 1``: the ring holds ``W + R - 1`` cells
  (``window_cells``), or ``max_seq_len`` when that is fewer (then nothing wraps). A rejected verify row's cell
  holds a position at most ``p + S``, which displaced ``p + S - window_cells <= p - W``: out of every later
  row's window, so rolling back needs no copy. A row at ``p`` reads cell ``c`` where ``d = (p - c) mod
  window_cells`` is below ``W`` and at most ``p`` (the cell then holds position ``p - d``, written by this step
  or an earlier one; ``recipes/attention.py`` ``sliding_mask``).
- ``linear``: linear attention with a recurrent state (Qwen3.5 Gated DeltaNet): no KV cache; per slot a
  causal-convolution state of the last ``conv_kernel - 1`` inputs and a ``[heads, key_dim, value_dim]``
  recurrent state. Declared here; built by the recipe that needs it.
- ``compressed``: reserved for DeepSeek V4's compressed attention; a core that declares it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ignition.catalog.geometry import (CONV_STATE, K_CACHE, K_WINDOW_CACHE, KIND_LAYERS, LATENT_CACHE,
                                       RECURRENT_STATE, ROPE_KEY_CACHE, V_CACHE, V_WINDOW_CACHE)


class CacheKind(IntEnum):
    """What a layer keeps between steps (codes fixed once; ``CACHE_KINDS`` holds each one's buffers)."""

    FULL = 1  # every position: [layers, num_slots, max_seq_len, ...]
    SLIDING = 2  # a ring of window_cells positions (window W, optional sinks)
    LINEAR = 3  # a convolution state and a recurrent state per slot, no KV
    COMPRESSED = 4  # reserved (DeepSeek V4)


@dataclass(frozen=True, slots=True)
class CacheKindSpec:
    """One kind: its manifest name, code, the state buffers its layers may declare, the manifest fields it needs,
    and whether Ignition builds it."""

    name: str
    code: CacheKind
    buffers: tuple[str, ...]  # the state buffers of this kind's layers (a recipe declares one family of them)
    fields: tuple[str, ...] = ()  # manifest.json:model fields a core with such a layer states
    built: bool = True  # False: reserved, refused when declared (GEOM-KIND-RESERVED)
    summary: str = ""
    # a step may restart from an earlier position of the slot (its state holds positions, so a draft core rewinds to
    # the prefix it shares with a new context); False: the state summarises every position it has seen
    rewinds: bool = True

    @property
    def layers_symbol(self) -> str:
        """The ``catalog.geometry`` symbol counting this kind's layers: the first extent of its buffers."""
        return next(symbol for symbol, kind in KIND_LAYERS.items() if kind == self.name)


CACHE_KINDS: dict[str, CacheKindSpec] = {spec.name: spec for spec in (
    CacheKindSpec("full", CacheKind.FULL, (K_CACHE, V_CACHE, LATENT_CACHE, ROPE_KEY_CACHE),
                  summary="every position: [layers, num_slots, max_seq_len, ...]"),
    CacheKindSpec("sliding", CacheKind.SLIDING, (K_WINDOW_CACHE, V_WINDOW_CACHE),
                  ("sliding_window", "window_cells"),
                  summary="a ring of window_cells positions: [layers, num_slots, window_cells, kv_heads, head_dim]"),
    CacheKindSpec("linear", CacheKind.LINEAR, (CONV_STATE, RECURRENT_STATE),
                  ("linear_conv_dim", "linear_conv_kernel", "linear_heads", "linear_key_dim", "linear_value_dim"),
                  summary="conv [layers, num_slots, conv_dim, conv_kernel - 1] and recurrent "
                          "[layers, num_slots, heads, key_dim, value_dim] states", rewinds=False),
    CacheKindSpec("compressed", CacheKind.COMPRESSED, (), built=False,
                  summary="DeepSeek V4 compressed attention, not built"),
)}
"""Kind name -> its spec; ``manifest.json:model.layer_kinds`` names these."""

KIND_OF_BUFFER: dict[str, str] = {buffer: spec.name for spec in CACHE_KINDS.values() for buffer in spec.buffers}
"""State buffer -> the kind whose layers it holds."""


def window_cells(window: int, step_rows: int, max_seq_len: int) -> int:
    """Cells of a sliding layer's ring: ``W + R - 1`` for a window of ``W`` positions and steps of at most ``R``
    rows (the widest prompt chunk or verify round), or ``max_seq_len`` when that is fewer (nothing wraps)."""
    for name, value in (("window", window), ("step_rows", step_rows), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"window_cells: {name} must be a positive int; found {value!r}")
    return min(window + step_rows - 1, max_seq_len)


def layer_counts(layer_kinds: list[str]) -> dict[str, int]:
    """Each kind's ``layers_symbol`` -> how many layers declare it (0 for a kind no layer declares)."""
    return {spec.layers_symbol: sum(kind == name for kind in layer_kinds) for name, spec in CACHE_KINDS.items()}


def kind_index(layer_kinds: list[str] | tuple[str, ...], layer: int) -> int:
    """Layer ``layer``'s index among the layers of its own kind (its row of that kind's buffers)."""
    return sum(kind == layer_kinds[layer] for kind in layer_kinds[:layer])


__all__ = ["CacheKind", "CacheKindSpec", "CACHE_KINDS", "KIND_OF_BUFFER", "window_cells", "layer_counts",
           "kind_index"]
