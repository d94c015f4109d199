"""The buffer table: every contract buffer's name, dtype, shape expression, role and binding.

Shapes are expressions over the geometry symbols ``capacity``, ``T``, ``C`` (scored
chunk capacity; a packed prefill's rows per lane), ``S`` (draft tokens a verification variant scores after each
lane's input token) and ``VOCAB_WORDS`` (``ceil(vocab_padded / 32)``) and the contract constants; ``resolve_shape``
evaluates them and ``shape_expression`` renders them for docs and error messages, so ``[2, capacity, T, 258]``
is written exactly once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ignition.catalog import contract
from ignition.catalog.enums import Operation, Role, ValueSource


@dataclass(frozen=True, slots=True)
class BufferSpec:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[str, ...]  # each dim: a sum of symbols / constant names / integers
    role: Role
    source: ValueSource | None  # binding for INPUT buffers
    meaning: str


COMPLETION_BUFFERS = (
    BufferSpec("completion_records", "int64", ("FRAMES", "capacity", "RECORD_HEADER_WORDS+T"), Role.OUTPUT, None,
               "ABI6 completion vectors"),
    BufferSpec("completion_logprobs", "int32", ("FRAMES", "capacity", "T", "PACKED_WIDTH"), Role.OUTPUT, None,
               "Packed token statistics: the chosen pair and up to 128 alternative pairs"),
    BufferSpec("logprob_requested", "int32", ("capacity",), Role.INPUT, ValueSource.LOGPROB_REQUESTED,
               "Nonzero for requesting lanes in this submission"),
    BufferSpec("logprob_token_ids", "int32", ("capacity", "MAX_SELECTED_IDS"), Role.INPUT, ValueSource.LOGPROB_TOKEN_IDS,
               "Caller-selected token IDs per slot"),
    BufferSpec("logprob_token_id_counts", "int32", ("capacity",), Role.INPUT, ValueSource.LOGPROB_TOKEN_ID_COUNTS,
               "Number of selected IDs per slot; zero selects the K natural alternatives"),
)
"""The CompletionOutputs bundle, in the specification's order."""

PROMPT_BUFFERS = (
    BufferSpec("prompt_logprobs", "int32", ("FRAMES", "C", "PROMPT_ROW_WIDTH"), Role.OUTPUT, None,
               "Per prompt row: actual id, FP32 logprob bits, rank, then 20 (id, bits) alternatives"),
    BufferSpec("prompt_target_tokens", "int32", ("C",), Role.INPUT, ValueSource.PROMPT_TARGET_TOKEN,
               "Prompt token at chunk_start + j + 1, or -1 at the prompt end and inside image spans"),
)

LANE_INPUTS = (
    BufferSpec("input_ids", "int64", ("capacity",), Role.INPUT, ValueSource.TOKEN_IDS, "Token each lane consumes"),
    BufferSpec("positions", "int64", ("capacity",), Role.INPUT, ValueSource.POSITIONS, "Absolute position of each lane's token"),
    BufferSpec("slot_ids", "int64", ("capacity",), Role.INPUT, ValueSource.SLOT_IDS, "Physical slot of each lane"),
    BufferSpec("slot_epochs", "int64", ("capacity",), Role.INPUT, ValueSource.SLOT_EPOCHS, "Generation counter of each lane's slot"),
    BufferSpec("active_lanes", "int32", ("capacity",), Role.INPUT, ValueSource.ACTIVE_LANES, "Nonzero for lanes in this submission"),
    BufferSpec("frame_index", "int64", ("1",), Role.INPUT, ValueSource.FRAME_INDEX, "Completion frame this submission writes"),
    BufferSpec("generated_counts", "int64", ("capacity",), Role.INPUT, ValueSource.GENERATED_COUNTS,
               "Tokens each lane's request generated before this round"),
    BufferSpec("token_budget", "int64", ("capacity",), Role.INPUT, ValueSource.TOKEN_BUDGET, "Each lane's max_tokens"),
    BufferSpec("eos_token_ids", "int64", ("capacity",), Role.INPUT, ValueSource.EOS_TOKEN_ID, "Each lane's EOS id, -1 to ignore"),
    BufferSpec("forced_token_ids", "int64", ("capacity",), Role.INPUT, ValueSource.FORCED_TOKEN_ID,
               "Token to emit instead of sampling (no logprob entry), -1 for none"),
)
"""Per-submission inputs of every sampling graph (decode lanes; prefill has capacity 1)."""

CHUNK_INPUTS = (
    BufferSpec("chunk_input_ids", "int64", ("C",), Role.INPUT, ValueSource.TOKEN_IDS, "Prompt chunk tokens, padded to C"),
    BufferSpec("chunk_start", "int64", ("1",), Role.INPUT, ValueSource.CHUNK_START, "Absolute position of the chunk's first row"),
    BufferSpec("chunk_length", "int64", ("1",), Role.INPUT, ValueSource.CHUNK_LENGTH, "Valid rows of the chunk"),
    BufferSpec("chunk_emits", "int32", ("1",), Role.INPUT, ValueSource.CHUNK_EMITS,
               "Nonzero: the chunk ends the prompt and samples the first token; zero: records only"),
)
"""Additional inputs of prefill graphs (one request per submission)."""

SAMPLING_INPUTS = (
    BufferSpec("temperature", "float32", ("capacity",), Role.INPUT, ValueSource.TEMPERATURE, "Below 1e-5: greedy"),
    BufferSpec("top_k", "int32", ("capacity",), Role.INPUT, ValueSource.TOP_K, "0 or >= vocabulary: off"),
    BufferSpec("top_p", "float32", ("capacity",), Role.INPUT, ValueSource.TOP_P, ">= 1.0: off"),
    BufferSpec("min_p", "float32", ("capacity",), Role.INPUT, ValueSource.MIN_P, "0: off"),
    BufferSpec("repetition_penalty", "float32", ("capacity",), Role.INPUT, ValueSource.REPETITION_PENALTY, "1.0: off"),
    BufferSpec("presence_penalty", "float32", ("capacity",), Role.INPUT, ValueSource.PRESENCE_PENALTY, "0: off"),
    BufferSpec("frequency_penalty", "float32", ("capacity",), Role.INPUT, ValueSource.FREQUENCY_PENALTY, "0: off"),
    BufferSpec("seed", "int64", ("capacity",), Role.INPUT, ValueSource.SEED, "Philox key of the lane's request"),
    BufferSpec("offset", "int64", ("capacity",), Role.INPUT, ValueSource.RNG_OFFSET,
               "Philox counter: the request's generated-token index"),
)
"""Per-lane sampling parameters (ignition.components.sampling reads its field order from here)."""

SAMPLING_DEFAULTS: dict[str, float | int] = dict(
    temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, seed=0, offset=0,
)
"""The value of each sampling input when a request leaves it out: greedy, every filter and penalty off. The
runtime's ``SamplingParams``, the CLI's options and ``SamplingTensors.from_requests`` all read it from here."""
assert set(SAMPLING_DEFAULTS) == {spec.name for spec in SAMPLING_INPUTS}
PENALTY_INPUTS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
"""The sampling inputs of the penalties: a lane whose three hold their ``SAMPLING_DEFAULTS`` value applies none (the
``transform_window`` rule reads them from here)."""

SPECULATIVE_INPUTS = (
    BufferSpec("draft_token_ids", "int64", ("capacity", "S"), Role.INPUT, ValueSource.DRAFT_TOKEN_IDS,
               "Each lane's proposed tokens after its input token; -1 from the end of its proposal on"),
)
"""The additional input of SPECULATIVE_VERIFY variants (``verify.s{S}.c{capacity}``)."""

MIXED_BUFFERS = (
    BufferSpec("mixed_prompt_lane", "int64", ("1",), Role.INPUT, ValueSource.MIXED_PROMPT_LANE,
               "The lane in the prompt role (its chunk is the chunk inputs), -1 for none"),
    BufferSpec("prompt_role_records", "int64", ("FRAMES", "capacity", "RECORD_HEADER_WORDS+T"), Role.OUTPUT, None,
               "The prompt role's private records frames"),
    BufferSpec("prompt_role_logprobs", "int32", ("FRAMES", "capacity", "T", "PACKED_WIDTH"), Role.OUTPUT, None,
               "The prompt role's private packed frames"),
    BufferSpec("decode_role_records", "int64", ("FRAMES", "capacity", "RECORD_HEADER_WORDS+T"), Role.OUTPUT, None,
               "The decode role's private records frames"),
    BufferSpec("decode_role_logprobs", "int32", ("FRAMES", "capacity", "T", "PACKED_WIDTH"), Role.OUTPUT, None,
               "The decode role's private packed frames"),
)
"""The additional arguments of MIXED variants (``mixed.t{C}.c{capacity}``): the merge copies the active frame of
the role each lane is in into the shared completion_records / completion_logprobs."""

CONSTRAINT_INPUTS = (
    BufferSpec("token_bitmask", "int32", ("capacity", "VOCAB_WORDS"), Role.INPUT, ValueSource.TOKEN_BITMASK,
               "Bit i of word w allows token 32*w+i for the lane's sampling; an all-zero row leaves the lane unmasked"),
    BufferSpec("logit_bias_ids", "int64", ("capacity", "MAX_LOGIT_BIAS"), Role.INPUT, ValueSource.LOGIT_BIAS_IDS,
               "Token ids whose sampling logit gets a bias, distinct per lane; -1 for an empty entry"),
    BufferSpec("logit_bias_values", "float32", ("capacity", "MAX_LOGIT_BIAS"), Role.INPUT, ValueSource.LOGIT_BIAS_VALUES,
               "The bias added to each id's sampling logit (entries with id -1 are ignored)"),
)
"""Structured-output inputs (``features.structured_output``): they shape the *sampling* logits only; the logprob
reduction reads the raw row. Declared by every variant of a CONSTRAINED_OPERATIONS operation, or by none."""
CONSTRAINED_OPERATIONS = (Operation.PREFILL, Operation.SCORED_PREFILL, Operation.DECODE, Operation.MIXED,
                          Operation.PACKED_PREFILL)
"""Operations whose variants take the constraint inputs: one sampled position per lane. A verify round samples S+1
positions per lane, so SPECULATIVE_VERIFY variants take none (constrained requests never speculate)."""

WINDOW_INPUTS = (
    BufferSpec("key_window", "int64", ("max_seq_len",), Role.INPUT, ValueSource.KEY_WINDOW,
               "Its extent W bounds the keys attention reads, [0, W); pass a prefix covering every row's position (contents unread)"),
    BufferSpec("sample_window", "int64", ("vocab_padded",), Role.INPUT, ValueSource.SAMPLE_WINDOW,
               "Its extent W bounds the row the sampler sorts, [0, W): pass the whole extent when any lane samples "
               "(temperature >= the greedy threshold); a round of greedy lanes only may pass less, as its tokens are "
               "the argmax of the whole row (contents unread)"),
    BufferSpec("transform_window", "int64", ("vocab_padded",), Role.INPUT, ValueSource.TRANSFORM_WINDOW,
               "Its extent T bounds the columns of the row the sampling transforms (token bitmask, logit bias, "
               "repetition, frequency and presence penalties) are applied to, [0, T): pass the whole extent when any "
               "lane has a bitmask, a bias or a penalty other than the neutral one; a round without any may pass "
               "less, as the transforms are then the identity (contents unread)"),
)
"""The windows of the decoder recipes: the key window attention reads, the sampler's sorted width (a greedy
round skips the full-vocabulary sort and filtering: the tokens are the same, the sort is not needed), and the
columns the sampling transforms touch (a round without constraints or penalties skips a dozen passes over every
row: the sampled row is the raw one, the transforms are not needed)."""

PACKED_INPUTS = (
    BufferSpec("packed_input_ids", "int64", ("capacity*C",), Role.INPUT, ValueSource.PACKED_TOKEN_IDS,
               "The lanes' prompt chunks concatenated in lane order (lane 0's rows first), zero after"),
    BufferSpec("segment_starts", "int64", ("capacity",), Role.INPUT, ValueSource.SEGMENT_STARTS,
               "Absolute position of each lane's chunk's first row"),
    BufferSpec("segment_lengths", "int64", ("capacity",), Role.INPUT, ValueSource.SEGMENT_LENGTHS,
               "Rows of each lane's chunk, at most C; 0 for a lane outside the submission"),
    BufferSpec("segment_emits", "int32", ("capacity",), Role.INPUT, ValueSource.SEGMENT_EMITS,
               "Nonzero: the lane's chunk ends its prompt and samples the first token; zero: records only"),
    BufferSpec("segment_window", "int64", ("C",), Role.INPUT, ValueSource.SEGMENT_WINDOW,
               "Its extent E bounds the rows of each lane's chunk, [0, E); pass a prefix covering the longest "
               "(contents unread)"),
)
"""The additional inputs of PACKED_PREFILL variants (``packed.t{C}.c{capacity}``): each lane's next prompt chunk
(a *segment* of at most C rows), all of them in one submission. They replace the chunk inputs."""

PACKED_LANES = 8
"""The default catalog's packed variant holds at most this many lanes (``recipes.llama.packed_capacity``).

Each lane projects its last row through the LM head alone, as a serial prefill does (its logits are the
serial ones bit for bit), and every lane of the variant does, active or not: at Qwen3-0.6B's width one
lane's projection reads the whole 151,936 x 1,024 head (about 45 ms on 2 cores). A 32-lane variant
packing 8 short prompts spent 1.4 s of its 2.4 s round on 24 idle lanes; more waiting prompts than
this take another round."""

PAGED_INPUTS = (
    BufferSpec("block_tables", "int32", ("num_slots", "max_blocks"), Role.INPUT, ValueSource.BLOCK_TABLES,
               "Row s: the pool blocks of slot s's positions [i * block_size, (i + 1) * block_size), in order; "
               "entries past the slot's live blocks are unread (0)"),
)
"""The input of every variant of a core with paged caches (``catalog.geometry.PAGED_STATE``): each slot's block table
(``max_blocks = ceil(max_seq_len / block_size)``)."""

WINDOW_PAGED_INPUTS = (
    BufferSpec("window_block_tables", "int32", ("num_slots", "max_blocks"), Role.INPUT,
               ValueSource.WINDOW_BLOCK_TABLES,
               "Row s: the sliding layers' pool blocks of slot s's positions [i * block_size, (i + 1) * block_size), "
               "in order; entries of blocks outside every row's window, and past the slot's live blocks, are the "
               "null block (unread)"),
)
"""The second table of every variant of a core with sliding-window pools (``catalog.geometry.WINDOW_PAGED_STATE``):
each slot's blocks in the sliding layers' own pool, a KV-cache group of its own (its block count is
``model.window_kv_blocks``)."""

BUFFERS = {spec.name: spec for spec in COMPLETION_BUFFERS + PROMPT_BUFFERS + LANE_INPUTS + CHUNK_INPUTS
           + SAMPLING_INPUTS + SPECULATIVE_INPUTS + MIXED_BUFFERS + CONSTRAINT_INPUTS + WINDOW_INPUTS + PACKED_INPUTS
           + PAGED_INPUTS + WINDOW_PAGED_INPUTS}
RECORDS, LOGPROBS, REQUESTED, TOKEN_IDS, TOKEN_ID_COUNTS = (spec.name for spec in COMPLETION_BUFFERS)
PROMPT_LOGPROBS, PROMPT_TARGETS = (spec.name for spec in PROMPT_BUFFERS)
(DRAFT_TOKENS,) = (spec.name for spec in SPECULATIVE_INPUTS)
PROMPT_LANE, PROMPT_ROLE_RECORDS, PROMPT_ROLE_LOGPROBS, DECODE_ROLE_RECORDS, DECODE_ROLE_LOGPROBS = (
    spec.name for spec in MIXED_BUFFERS)
ROLE_FRAMES = {"prompt": (PROMPT_ROLE_RECORDS, PROMPT_ROLE_LOGPROBS), "decode": (DECODE_ROLE_RECORDS, DECODE_ROLE_LOGPROBS)}
"""Role -> (its private records buffer, its private packed buffer)."""
ID_INPUTS = (TOKEN_IDS, TOKEN_ID_COUNTS)
KEY_WINDOW, SAMPLE_WINDOW, TRANSFORM_WINDOW = (spec.name for spec in WINDOW_INPUTS)
TOKEN_BITMASK, BIAS_IDS, BIAS_VALUES = (spec.name for spec in CONSTRAINT_INPUTS)
CHUNK_TOKENS = CHUNK_INPUTS[0].name
PACKED_TOKENS, SEGMENT_STARTS, SEGMENT_LENGTHS, SEGMENT_EMITS, SEGMENT_WINDOW = (spec.name for spec in PACKED_INPUTS)
(BLOCK_TABLES,) = (spec.name for spec in PAGED_INPUTS)
(WINDOW_BLOCK_TABLES,) = (spec.name for spec in WINDOW_PAGED_INPUTS)


@dataclass(frozen=True, slots=True)
class Window:
    """A windowed input: the graph takes any prefix ``[0, W)`` of its declared extent along ``dim``,
    ``MIN_WINDOW <= W``; the runtime passes the smallest multiple of ``granule`` (capped at the
    extent) that covers the submission, so replays reuse few shapes."""

    dim: int
    granule: int

    def covering(self, needed: int, extent: int | None = None) -> int:
        """The extent a replay passes to cover ``needed``: the smallest multiple of the granule at least
        ``max(needed, MIN_WINDOW)``, capped at the declared ``extent``."""
        rounded = -(-max(needed, MIN_WINDOW) // self.granule) * self.granule
        return rounded if extent is None else min(extent, rounded)


WINDOWS = {KEY_WINDOW: Window(dim=0, granule=32), SAMPLE_WINDOW: Window(dim=0, granule=64),
           TRANSFORM_WINDOW: Window(dim=0, granule=64),
           CHUNK_TOKENS: Window(dim=0, granule=16),
           PACKED_TOKENS: Window(dim=0, granule=16), SEGMENT_WINDOW: Window(dim=0, granule=16)}
"""Buffer -> its window. A variant's ``layout["windows"]`` names the ones whose extent is dynamic in its graph."""
MIN_WINDOW = 2  # torch.export specializes extents 0 and 1
SHORTEST_WINDOWED = 8
"""Declared extents below this stay static: a window is traced at half its extent, which must stay above 1."""

_CONSTANTS = {name: getattr(contract, name) for name in (
    "FRAMES", "RECORD_HEADER_WORDS", "PACKED_WIDTH", "MAX_SELECTED_IDS", "PROMPT_ROW_WIDTH", "MAX_LOGIT_BIAS")}


def resolve_shape(spec: BufferSpec, **geometry: int) -> list[int]:
    """Evaluate the shape expression for ``capacity=``, ``T=``, ``C=``, ``S=``, ``VOCAB_WORDS=`` (and ``PACKED_WIDTH=``
    override).

    A dimension is a sum of terms, each a product of integers and names (``RECORD_HEADER_WORDS+T``, ``capacity*C``)."""
    env = {**_CONSTANTS, **geometry}
    shape = []
    for dim in spec.shape:
        total = 0
        for term in dim.split("+"):
            product = 1
            for factor in term.split("*"):
                product *= int(factor) if factor.isdigit() else env[factor]
            total += product
        shape.append(total)
    return shape


def shape_expression(spec: BufferSpec, **overrides: str) -> str:
    """``[2, capacity, 16+T]``: constants substituted, geometry symbols kept."""
    env = {name: str(value) for name, value in _CONSTANTS.items()} | overrides
    dims = ["+".join(env.get(term, term) for term in dim.split("+")) for dim in spec.shape]
    return "[" + ", ".join(dims) + "]"
