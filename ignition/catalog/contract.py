"""The contract's numbers, written once.

Every other module (buffers, validator, components, loader, docs) reads these names; a
literal 20, 128, 16 or 258 anywhere else is a bug.
"""

from __future__ import annotations

FRAMES = 2
"""Each completion output has two frames: a submission writes one while the host reads the other."""

RECORD_HEADER_WORDS = 16
"""ABI6 records: 16 int64 header fields, then T emitted token ids."""

DEFAULT_COMPLETION_TOKEN_CAPACITY = 8
"""T when the core's completion_token_capacity is 0 or omitted."""

NATURAL_K = 20
"""Natural alternatives an export provides per position (K). Requests select 0..K."""

MAX_SELECTED_IDS = 128
"""Largest number of caller-selected token ids (logprob_token_ids) per request."""

PACKED_CHOSEN_WORDS = 2
"""Each packed position starts with the chosen pair: token id, FP32 logprob bits."""

PACKED_WIDTH = PACKED_CHOSEN_WORDS + 2 * MAX_SELECTED_IDS
"""Last extent of completion_logprobs when the explicit-ID inputs are declared (258)."""

PROMPT_ROW_HEADER_WORDS = 3
"""Prompt rows: actual token id, FP32 logprob bits, rank; then the alternatives."""

PROMPT_ROW_WIDTH = PROMPT_ROW_HEADER_WORDS + 2 * NATURAL_K
"""Last extent of prompt_logprobs (43)."""

SCORED_BASE_CAPACITY = 128
SCORED_GROWTH = 4
"""Scored-prefill capacities: 128 * 4**k below the chunk limit, then the chunk limit."""

SCORING_ROW_BLOCK = 64
"""The scoring component projects at most this many hidden rows at a time."""

TILE_SORT_KEYS = 32
"""Integer sort keys each vocabulary tile retains for the final merge (and the sharded exchange)."""

SCRATCH_POINTERS = 2
"""Trailing null pointers every prepared launch takes after its non-constexpr arguments (Triton's
global and profile scratch); prepared kernels must not need either buffer."""

POINTER_DIVISIBILITY = 16
"""Bytes every pointer argument of a prepared launch is a multiple of: the binaries are compiled with
Triton's ``tt.divisibility`` at this value (as the JIT compiles an aligned call), kernels.json records it
per parameter, and the launcher refuses an address that breaks it."""

MAX_LOGIT_BIAS = 300
"""Largest number of (token id, bias) entries per request (OpenAI's logit_bias limit): the sparse bias width."""

BITMASK_WORD_BITS = 32
"""token_bitmask packs 32 tokens per int32 word: bit i of word w allows token 32*w + i."""

INVALID_TOKEN_ID = -1
NAN_BITS = 0x7FC00000
"""FP32 quiet NaN as int32 bits: the value of an unused or invalid pair."""

FORMAT_VERSION = 4
"""Core format version written into and required from every manifest (3: K is the manifest's ``k`` alone; the
full layers' K/V caches are pools of blocks addressed through ``block_tables``, ``model.block_size`` and
``model.kv_blocks``, catalog/geometry.py ``PAGED_STATE``; 4: MLA's latent and rope key caches are pools too, and
the sliding layers' K/V are pools of their own through ``window_block_tables``)."""

FORMAT_CHANGES = {1: "format 1 predates per-layer cache kinds (model.layer_kinds)",
                  2: "format 2 stores K twice (k and features.max_logprobs) and predates the paged KV caches "
                     "(model.block_size, block_tables); format 3 keeps k alone and pages the full layers' caches",
                  3: "format 3 keeps MLA's latent_cache and rope_key_cache and the sliding layers' K/V rings per slot; "
                     "format 4 pages them (block_tables, window_block_tables)"}
"""Why a core of an older format is refused, by version."""


def packed_width(k: int, explicit_ids: bool) -> int:
    """Last extent of completion_logprobs: 2 + 2*A, A = 128 with explicit IDs, else K."""
    alternatives = MAX_SELECTED_IDS if explicit_ids else k
    return PACKED_CHOSEN_WORDS + 2 * alternatives


def bitmask_words(vocab_padded: int) -> int:
    """VOCAB_WORDS: int32 words of one token_bitmask row, ceil(vocab_padded / 32)."""
    return -(-vocab_padded // BITMASK_WORD_BITS)


def resolve_completion_token_capacity(value: int | None) -> int:
    """T: zero or omission means eight, positive values are literal, negatives are errors."""
    if value is None or value == 0:
        return DEFAULT_COMPLETION_TOKEN_CAPACITY
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"completion_token_capacity must be a non-negative integer (0 means "
            f"{DEFAULT_COMPLETION_TOKEN_CAPACITY}), got {value!r}"
        )
    return value


def manifest_token_capacity(manifest: dict) -> int:
    """The core's resolved T: its manifest's completion_token_capacity, which may be 0 or omitted (8)."""
    return resolve_completion_token_capacity(manifest.get("completion_token_capacity"))


def scored_capacities(chunk_limit: int) -> list[int]:
    """128, 512, 2048, ... strictly below the chunk limit, then the chunk limit itself."""
    if chunk_limit < 1:
        raise ValueError(f"chunk limit must be positive, got {chunk_limit}")
    capacities = []
    capacity = SCORED_BASE_CAPACITY
    while capacity < chunk_limit:
        capacities.append(capacity)
        capacity *= SCORED_GROWTH
    capacities.append(chunk_limit)
    return capacities
