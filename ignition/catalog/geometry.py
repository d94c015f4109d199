"""Model geometry as data: which manifest field each extent of a state or weight tensor is.

The decoder recipes build their state declarations from ``STATE_SHAPES``; validate-core
resolves the same expressions with the manifest's fields and compares them with the declared
state and with the header of the weights file (the GEOM-* rules). An extent is a manifest
symbol (``FIELDS``) or a literal int.
"""

from __future__ import annotations

K_CACHE, V_CACHE, PENALTY_COUNTS = "k_cache", "v_cache", "penalty_counts"
LATENT_CACHE, ROPE_KEY_CACHE = "latent_cache", "rope_key_cache"  # MLA (deepseek_v3)
K_WINDOW_CACHE, V_WINDOW_CACHE = "k_window_cache", "v_window_cache"  # sliding-window layers (catalog/cache_kinds.py)
CONV_STATE, RECURRENT_STATE = "conv_state", "recurrent_state"  # linear-attention layers (catalog/cache_kinds.py)
# DeepSeek V4 (catalog/cache_kinds.py): one K=V window ring a layer, compressed entries and their compressors' sources
SWA_KV_CACHE = "swa_kv_cache"
CSA_WINDOW_CACHE, CSA_KV_CACHE, CSA_SOURCE = "csa_window_cache", "csa_kv_cache", "csa_source"
CSA_INDEX_CACHE, CSA_INDEX_SOURCE = "csa_index_cache", "csa_index_source"
HCA_WINDOW_CACHE, HCA_KV_CACHE, HCA_SOURCE = "hca_window_cache", "hca_kv_cache", "hca_source"
PROMPT_PLANE, OUTPUT_PLANE = 0, 1
PENALTY_PLANES = 2
"""penalty_counts planes: prompt-token counts (``PROMPT_PLANE``), emitted-token counts (``OUTPUT_PLANE``)."""

_KV_CACHE = ("full_layers", "kv_blocks", "block_size", "num_kv_heads", "head_dim")
_WINDOW_CACHE = ("sliding_layers", "window_kv_blocks", "block_size", "num_kv_heads", "head_dim")
STATE_SHAPES: dict[str, tuple[str | int, ...]] = {
    K_CACHE: _KV_CACHE,
    V_CACHE: _KV_CACHE,
    LATENT_CACHE: ("full_layers", "kv_blocks", "block_size", "kv_lora_rank"),
    ROPE_KEY_CACHE: ("full_layers", "kv_blocks", "block_size", "qk_rope_head_dim"),
    K_WINDOW_CACHE: _WINDOW_CACHE,
    V_WINDOW_CACHE: _WINDOW_CACHE,
    CONV_STATE: ("linear_layers", "num_slots", "linear_conv_dim", "linear_conv_state"),
    RECURRENT_STATE: ("linear_layers", "num_slots", "linear_heads", "linear_key_dim", "linear_value_dim"),
    SWA_KV_CACHE: ("shared_window_layers", "num_slots", "window_cells", "head_dim"),
    CSA_WINDOW_CACHE: ("compressed_layers", "num_slots", "window_cells", "head_dim"),
    CSA_KV_CACHE: ("compressed_layers", "num_slots", "csa_entries", "head_dim"),
    CSA_SOURCE: ("compressed_layers", "num_slots", "csa_source_cells", 2, 2, "head_dim"),  # kv|gate, Ca|Cb
    CSA_INDEX_CACHE: ("compressed_layers", "num_slots", "csa_entries", "index_head_dim"),
    CSA_INDEX_SOURCE: ("compressed_layers", "num_slots", "csa_source_cells", 2, 2, "index_head_dim"),
    HCA_WINDOW_CACHE: ("heavily_compressed_layers", "num_slots", "window_cells", "head_dim"),
    HCA_KV_CACHE: ("heavily_compressed_layers", "num_slots", "hca_entries", "head_dim"),
    HCA_SOURCE: ("heavily_compressed_layers", "num_slots", "hca_source_cells", 2, 1, "head_dim"),  # kv|gate
    PENALTY_COUNTS: ("num_slots", PENALTY_PLANES, "vocab_padded"),
}
"""Runtime-owned state tensors by name. The caches are in the model dtype (the recurrent state in FP32,
``FP32_STATE``); each cache's first extent counts the layers of its kind (``KIND_LAYERS``)."""

WINDOW_PAGED_STATE = (K_WINDOW_CACHE, V_WINDOW_CACHE)
"""The sliding layers' pools ``[sliding_layers, window_kv_blocks, block_size, ...]``: a KV-cache group of their own,
addressed through the ``window_block_tables`` input (vLLM's hybrid allocator: one block table a group), whose entries
for blocks that left every row's window are ``NULL_BLOCK`` (catalog/cache_kinds.py). Their block count is static,
``window_blocks_bound``: the runtime releases the blocks a request's window has left, so every slot's window fits."""
PAGED_STATE = (K_CACHE, V_CACHE, LATENT_CACHE, ROPE_KEY_CACHE) + WINDOW_PAGED_STATE
"""The pools of blocks (GQA's K and V, MLA's latent and rope key): ``[full_layers, kv_blocks, block_size, ...]``,
addressed through the ``block_tables`` input (catalog/buffers.py): position ``p`` of slot ``s`` is cell
``block_tables[s, p // block_size] * block_size + p % block_size`` of its layer; the sliding layers' pools
(``WINDOW_PAGED_STATE``) the same way through ``window_block_tables``. The full pools' block count (dim
``PAGED_DIM``) is a load-time extent: dynamic in every exported program, the manifest's ``model.kv_blocks`` its upper
bound (``kv_blocks_bound``), the runtime's pool at most that (runtime/kv_pool.py); the sliding pools' is
``model.window_kv_blocks``, fixed. Every other cache stays per slot (linear and DeepSeek V4 state)."""
PAGED_DIM = 1
PAGED_EXTENT = _KV_CACHE[PAGED_DIM]
"""The symbol of a paged cache's layout that counts the pool's blocks (``kv_blocks``)."""
DYNAMIC_BLOCKS = "dynamic_blocks"
"""``layout`` key of a variant whose graph takes any pool of ``[MIN_WINDOW, model.kv_blocks]`` blocks (exporter/
tracing.py); a graph without it fixes the pool at the declared bound (compiled packages)."""
BLOCK_SIZE = 16
"""``--block-size`` when the exporter is not told otherwise: positions per block."""


NULL_BLOCK = 0
"""The pool block no sequence holds: ``block_tables`` entries past a slot's live blocks name it, so the writes a graph
makes there (padding rows, a records-only lane) land where no request reads. A pool of ``n`` blocks holds ``n - 1``
blocks of requests (``usable_blocks``)."""


def usable_blocks(kv_blocks: int) -> int:
    """Blocks of a pool of ``kv_blocks`` that requests can hold: every block but ``NULL_BLOCK``."""
    return max(kv_blocks - 1, 0)


def max_blocks(max_seq_len: int, block_size: int) -> int:
    """Blocks that hold one sequence of ``max_seq_len`` positions: the width of a block table row."""
    return -(-max_seq_len // block_size)


def window_read_blocks(window_cells: int, block_size: int) -> int:
    """Blocks a sliding layer's step reads (recipes/window_pages.py): ``window_cells`` positions starting anywhere
    inside a block. A request holds at most these many of its sliding pools' blocks at once (runtime/kv_groups.py)."""
    return (window_cells + block_size - 2) // block_size + 1


def window_blocks_bound(num_slots: int, window_cells: int, max_seq_len: int, block_size: int) -> int:
    """``window_kv_blocks``, the sliding pools' block count: every slot holding the most blocks one request holds
    (``window_read_blocks``, or a whole sequence's when fewer), and the null block. It grows with the window and
    the slots, not with ``max_seq_len``."""
    return num_slots * min(window_read_blocks(window_cells, block_size), max_blocks(max_seq_len, block_size)) + 1


def kv_blocks_bound(num_slots: int, max_seq_len: int, block_size: int) -> int:
    """The declared upper bound of ``kv_blocks``: every slot at ``max_seq_len`` (the slot-contiguous capacity)."""
    return num_slots * max_blocks(max_seq_len, block_size)


def block_size_problem(block_size, granule: int) -> str | None:
    """Why ``block_size`` cannot page the caches, or None: a positive divisor of the key window's ``granule``, so a
    replayed key window (a multiple of the granule) reads whole blocks."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or granule % block_size:
        divisors = [size for size in range(1, granule + 1) if granule % size == 0]
        return (f"the block size must divide the key window granule {granule} (one of {divisors}), "
                f"found {block_size!r}")
    return None

MODEL_DTYPE_STATE = (K_CACHE, V_CACHE, LATENT_CACHE, ROPE_KEY_CACHE, K_WINDOW_CACHE, V_WINDOW_CACHE, CONV_STATE,
                     SWA_KV_CACHE, CSA_WINDOW_CACHE, CSA_KV_CACHE, CSA_SOURCE, CSA_INDEX_CACHE,
                     CSA_INDEX_SOURCE, HCA_WINDOW_CACHE, HCA_KV_CACHE, HCA_SOURCE)

FP32_STATE = (RECURRENT_STATE,)
"""State kept in FP32 whatever the model dtype: the delta rule's matrix, which every step decays and updates
(transformers keeps it in FP32; rounded to BF16 after each step it moved the tiny BF16 example's logits by 0.125
within 28 decode steps, against 0.0 for the prompt)."""

KIND_LAYERS: dict[str, str] = {"full_layers": "full", "sliding_layers": "sliding", "linear_layers": "linear",
                               "compressed_layers": "compressed", "heavily_compressed_layers": "heavily_compressed",
                               "shared_window_layers": "shared_window"}
"""Symbols that count the layers of one cache kind in ``manifest.json:model.layer_kinds``."""

OFFSETS: dict[str, tuple[str, int]] = {"linear_conv_state": ("linear_conv_kernel", -1)}
"""Symbols that are a manifest field plus a constant (a convolution keeps its last kernel - 1 inputs)."""

VOCAB_WEIGHTS: dict[str, tuple[str | int, ...]] = {
    "embed": ("vocab_padded", "hidden_size"),  # decoder recipes (qwen3, llama, ...); a tied lm_head is stored as embed
    "lm_head": ("vocab_padded", "hidden_size"),
    "embedding.weight": ("vocab_padded", "hidden_size"),  # toy
    "lm_head.weight": ("vocab_padded", "hidden_size"),
}
"""Weights whose rows are the padded vocabulary; every core stores at least one of them."""

ATTENTION_WEIGHTS: dict[str, tuple[str | int, ...]] = {
    "layers.0.q_proj": ("query_width", "hidden_size"),
    "layers.0.k_proj": ("kv_width", "hidden_size"),
    "layers.0.v_proj": ("kv_width", "hidden_size"),
}
"""Attention projections of the first layer (a rank: its heads' rows), whose rows are heads times head_dim."""

ATTENTION_RECIPES = ("qwen3", "llama", "qwen3_moe", "gemma3", "gpt_oss")
"""Recipes whose ``model.head_dim`` is the width of every attention head (MLA's heads are not)."""

DERIVED: dict[str, tuple[str, str]] = {"query_width": ("num_heads", "head_dim"), "kv_width": ("num_kv_heads", "head_dim")}
"""Symbols that are the product of two manifest fields."""

FIELDS: dict[str, tuple[str, ...]] = {
    "num_heads": ("model", "num_heads"),
    "num_layers": ("model", "num_layers"),
    "num_slots": ("model", "num_slots"),
    "max_seq_len": ("model", "max_seq_len"),
    "kv_blocks": ("model", "kv_blocks"),
    "window_kv_blocks": ("model", "window_kv_blocks"),
    "block_size": ("model", "block_size"),
    "num_kv_heads": ("model", "num_kv_heads"),
    "head_dim": ("model", "head_dim"),
    "kv_lora_rank": ("model", "kv_lora_rank"),
    "window_cells": ("model", "window_cells"),
    "linear_conv_dim": ("model", "linear_conv_dim"),
    "linear_conv_kernel": ("model", "linear_conv_kernel"),
    "linear_heads": ("model", "linear_heads"),
    "linear_key_dim": ("model", "linear_key_dim"),
    "linear_value_dim": ("model", "linear_value_dim"),
    "qk_rope_head_dim": ("model", "qk_rope_head_dim"),
    "index_head_dim": ("model", "index_head_dim"),
    "csa_entries": ("model", "csa_entries"),
    "csa_source_cells": ("model", "csa_source_cells"),
    "hca_entries": ("model", "hca_entries"),
    "hca_source_cells": ("model", "hca_source_cells"),
    "hidden_size": ("model", "hidden_size"),
    "vocab_padded": ("vocab_padded",),
}
"""Symbol -> its path in manifest.json."""

SYMBOL_RULES = {"num_slots": "GEOM-SLOTS", "max_seq_len": "GEOM-SEQ", "kv_blocks": "GEOM-KV-BLOCKS",
                "window_kv_blocks": "GEOM-WINDOW-BLOCKS",
                "block_size": "GEOM-BLOCK-SIZE", "vocab_padded": "GEOM-VOCAB-TENSOR",
                "window_cells": "GEOM-WINDOW", "csa_entries": "GEOM-COMPRESS", "csa_source_cells": "GEOM-COMPRESS",
                "hca_entries": "GEOM-COMPRESS", "hca_source_cells": "GEOM-COMPRESS"} | {symbol: "GEOM-KIND-BUFFERS" for symbol in KIND_LAYERS}
"""The validator rule for a mismatched extent; every other symbol is GEOM-MODEL."""


def field_name(symbol: str) -> str:
    if symbol in KIND_LAYERS:
        return f"the count of {KIND_LAYERS[symbol]!r} in manifest.json:model.layer_kinds"
    if symbol in OFFSETS:
        field, offset = OFFSETS[symbol]
        return f"{field_name(field)} {'+' if offset >= 0 else '-'} {abs(offset)}"
    if symbol in DERIVED:
        return " * ".join(field_name(part) for part in DERIVED[symbol])
    return "manifest.json:" + ".".join(FIELDS[symbol])


def manifest_value(manifest: dict, symbol: str):
    """The manifest's value of ``symbol``, or None when the manifest does not state it."""
    if symbol in KIND_LAYERS:
        kinds = manifest.get("model", {}).get("layer_kinds") if isinstance(manifest.get("model"), dict) else None
        return sum(kind == KIND_LAYERS[symbol] for kind in kinds) if isinstance(kinds, list) else None
    if symbol in OFFSETS:
        field, offset = OFFSETS[symbol]
        value = manifest_value(manifest, field)
        return value + offset if isinstance(value, int) else None
    if symbol in DERIVED:
        first, second = (manifest_value(manifest, part) for part in DERIVED[symbol])
        return first * second if isinstance(first, int) and isinstance(second, int) else None
    value = manifest
    for key in FIELDS[symbol]:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def state_shape(name: str, **geometry: int) -> list[int]:
    """The shape of state tensor ``name`` for the given symbol values."""
    return [extent if isinstance(extent, int) else geometry[extent] for extent in STATE_SHAPES[name]]
