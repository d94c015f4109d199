"""Per-layer cache kinds as data: what each kind of layer keeps per slot, and how large it is.

Every layer of a core declares its kind in ``manifest.json:model.layer_kinds`` (one name a layer, in layer
order). A kind's layers share its state buffers, stacked on their first extent in layer order: the k-th
``sliding`` layer of the model is index k of ``k_window_cache``. The buffers' shapes are expressions over
manifest symbols in ``catalog.geometry.STATE_SHAPES`` (the recipes build their declarations from them and
validate-core resolves them, the GEOM rules); this table says which buffers belong to which kind.

- ``full``: every position of the sequence: GQA's K and V, or MLA's latent and rope key, as pools of blocks
  ``[layers, kv_blocks, block_size, ...]`` addressed through ``block_tables`` (catalog/geometry.py ``PAGED_STATE``).
- ``sliding``: a window of ``W = model.sliding_window`` positions (a recipe with attention sinks adds them as
  weights; they change no buffer). K and V are pools of blocks of their own ``[layers, window_kv_blocks,
  block_size, ...]`` (catalog/geometry.py ``WINDOW_PAGED_STATE``), a KV-cache group addressed through
  ``window_block_tables`` as vLLM's hybrid allocator gives each attention kind its own block table. A step writes
  all its rows before any row attends; a group of ``R`` rows (a prompt chunk, or a verify round's ``S + 1`` rows)
  whose first row is at ``s`` reads the positions ``[s - W + 1, s + R)``, at most ``window_cells = W + R - 1``
  (or ``max_seq_len`` when that is fewer), from the block holding ``s - W + 1`` on (``recipes/window_pages.py``).
  A block wholly below ``s - W + 1`` is read by no later row: every later step starts at or after ``s`` (a
  rejected verify row's position is rewritten by a later step, never read below its window), so the runtime may
  release it and name the null block in its place.
- ``linear``: linear attention with a recurrent state (Qwen3.5 Gated DeltaNet): no KV cache; per slot a
  causal-convolution state of the last ``conv_kernel - 1`` inputs and a ``[heads, key_dim, value_dim]``
  recurrent state. Declared here; built by the recipe that needs it.
- DeepSeek V4's three kinds share one design (``recipes/deepseek_v4_attention.py``): every attention block keeps a
  ring of one K=V head over ``window_cells`` cells, position ``p`` in cell ``p mod window_cells`` (its window ``W =
  model.sliding_window``; a step's rows never overwrite a position its first row still reads), and
  a compressed layer adds a table of compressed entries and its compressor's source ring. Entry ``w`` compresses
  the positions ``[w m, (w + 1) m)`` and is written by the step holding position ``(w + 1) m - 1``; the table has
  ``max_seq_len // m + 1`` entries (the last one takes the stand-in writes of windows a step cannot close). The
  source ring keeps each position's projected kv and gate rows, ``q mod cells``, read before the step writes it:
  a step of ``R`` rows needs the ``2m - 1`` (CSA) or ``m - 1`` (HCA) positions before it, so the ring holds
  ``2m + R - 1`` or ``m + R - 1`` cells and a rejected verify row never overwrites a position a later step reads.

  - ``shared_window``: the window only (``swa_kv_cache``).
  - ``compressed``: compressed sparse attention, ``m = model.csa_rate``: entries of ``head_dim`` mixing two
    windows (``csa_kv_cache``, ``csa_source``), and the lightning indexer's own entries of ``index_head_dim``
    (``csa_index_cache``, ``csa_index_source``), from which each row keeps the ``index_topk`` best.
  - ``heavily_compressed``: heavily compressed attention, ``m = model.hca_rate``: every complete entry
    (``hca_kv_cache``, ``hca_source``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ignition.catalog.geometry import (CONV_STATE, CSA_INDEX_CACHE, CSA_INDEX_SOURCE, CSA_KV_CACHE, CSA_SOURCE,
                                       CSA_WINDOW_CACHE, HCA_KV_CACHE, HCA_SOURCE, HCA_WINDOW_CACHE, K_CACHE,
                                       K_WINDOW_CACHE, KIND_LAYERS, LATENT_CACHE, RECURRENT_STATE, ROPE_KEY_CACHE,
                                       SWA_KV_CACHE, V_CACHE, V_WINDOW_CACHE)


class CacheKind(IntEnum):
    """What a layer keeps between steps (codes fixed once; ``CACHE_KINDS`` holds each one's buffers)."""

    FULL = 1  # every position: pools [layers, kv_blocks, block_size, ...] (GQA's K/V, MLA's latent/rope key)
    SLIDING = 2  # pools [layers, window_kv_blocks, block_size, ...] through window_block_tables (window W, sinks)
    LINEAR = 3  # a convolution state and a recurrent state per slot, no KV
    COMPRESSED = 4  # DeepSeek V4 CSA: a K=V window ring, compressed entries, the indexer's entries
    HEAVILY_COMPRESSED = 5  # DeepSeek V4 HCA: a K=V window ring and compressed entries
    SHARED_WINDOW = 6  # DeepSeek V4 sliding layer: a K=V window ring


@dataclass(frozen=True, slots=True)
class CacheKindSpec:
    """One kind: its manifest name, code, the state buffers its layers may declare, the manifest fields it needs,
    and whether Ignition builds it."""

    name: str
    code: CacheKind
    buffers: tuple[str, ...]  # the state buffers of this kind's layers (a recipe declares one family of them)
    fields: tuple[str, ...] = ()  # manifest.json:model fields a core with such a layer states
    built: bool = True  # False: reserved, refused when declared (GEOM-KIND-RESERVED); every kind today is built
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
                  summary="every position: K/V (MLA: latent/rope key) pools [layers, kv_blocks, block_size, ...] "
                          "through block_tables"),
    CacheKindSpec("sliding", CacheKind.SLIDING, (K_WINDOW_CACHE, V_WINDOW_CACHE),
                  ("sliding_window", "window_cells"),
                  summary="K/V pools [layers, window_kv_blocks, block_size, kv_heads, head_dim] through "
                          "window_block_tables; a step reads window_cells positions"),
    CacheKindSpec("linear", CacheKind.LINEAR, (CONV_STATE, RECURRENT_STATE),
                  ("linear_conv_dim", "linear_conv_kernel", "linear_heads", "linear_key_dim", "linear_value_dim"),
                  summary="conv [layers, num_slots, conv_dim, conv_kernel - 1] and recurrent "
                          "[layers, num_slots, heads, key_dim, value_dim] states", rewinds=False),
    CacheKindSpec("compressed", CacheKind.COMPRESSED,
                  (CSA_WINDOW_CACHE, CSA_KV_CACHE, CSA_SOURCE, CSA_INDEX_CACHE, CSA_INDEX_SOURCE),
                  ("sliding_window", "window_cells", "csa_rate", "csa_entries", "csa_source_cells", "index_head_dim"),
                  summary="DeepSeek V4 CSA: window [layers, num_slots, window_cells, head_dim], entries "
                          "[layers, num_slots, csa_entries, head_dim], source [layers, num_slots, csa_source_cells, "
                          "2, 2, head_dim], and the indexer's entries and source at index_head_dim"),
    CacheKindSpec("heavily_compressed", CacheKind.HEAVILY_COMPRESSED, (HCA_WINDOW_CACHE, HCA_KV_CACHE, HCA_SOURCE),
                  ("sliding_window", "window_cells", "hca_rate", "hca_entries", "hca_source_cells"),
                  summary="DeepSeek V4 HCA: window [layers, num_slots, window_cells, head_dim], entries "
                          "[layers, num_slots, hca_entries, head_dim], source [layers, num_slots, hca_source_cells, "
                          "2, 1, head_dim]"),
    CacheKindSpec("shared_window", CacheKind.SHARED_WINDOW, (SWA_KV_CACHE,), ("sliding_window", "window_cells"),
                  summary="DeepSeek V4 sliding layer: a K=V ring [layers, num_slots, window_cells, head_dim]"),
)}
"""Kind name -> its spec; ``manifest.json:model.layer_kinds`` names these."""

KIND_OF_BUFFER: dict[str, str] = {buffer: spec.name for spec in CACHE_KINDS.values() for buffer in spec.buffers}
"""State buffer -> the kind whose layers it holds."""


def window_cells(window: int, step_rows: int, max_seq_len: int) -> int:
    """Positions a sliding step reads (a DeepSeek V4 ring's cells): ``W + R - 1`` for a window of ``W`` positions and
    steps of at most ``R`` rows (the widest prompt chunk or verify round), or ``max_seq_len`` when that is fewer."""
    for name, value in (("window", window), ("step_rows", step_rows), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"window_cells: {name} must be a positive int; found {value!r}")
    return min(window + step_rows - 1, max_seq_len)


def compressed_entries(max_seq_len: int, rate: int) -> int:
    """Entries of a compressed layer's table: ``max_seq_len // rate`` complete windows at most, plus the cell that
    takes the stand-in writes of windows a step cannot close."""
    return max_seq_len // rate + 1


def source_cells(rate: int, step_rows: int, overlap: bool) -> int:
    """Cells of a compressor's source ring: the ``2 rate - 1`` (``overlap``, CSA) or ``rate - 1`` positions a step
    reads before its own, plus its ``step_rows``."""
    return (2 if overlap else 1) * rate + step_rows - 1


def layer_counts(layer_kinds: list[str]) -> dict[str, int]:
    """Each kind's ``layers_symbol`` -> how many layers declare it (0 for a kind no layer declares)."""
    return {spec.layers_symbol: sum(kind == name for kind in layer_kinds) for name, spec in CACHE_KINDS.items()}


def kind_index(layer_kinds: list[str] | tuple[str, ...], layer: int) -> int:
    """Layer ``layer``'s index among the layers of its own kind (its row of that kind's buffers)."""
    return sum(kind == layer_kinds[layer] for kind in layer_kinds[:layer])


__all__ = ["CacheKind", "CacheKindSpec", "CACHE_KINDS", "KIND_OF_BUFFER", "window_cells", "compressed_entries",
           "source_cells", "layer_counts", "kind_index"]
