"""Enum codes of the wire contract: assigned once here, never reused with another meaning.

SCORED_PREFILL = 12 and PROMPT_TARGET_TOKEN = 39 are fixed by the shared Protobuf; every
other code is Ignition's. docs/api.md is generated from these tables (see ignition.catalog.docs).
"""

from __future__ import annotations

from enum import IntEnum


class Operation(IntEnum):
    """What one graph variant does."""

    PREFILL = 1  # one request's prompt chunk; the final chunk samples the first token
    DECODE = 2  # one token per active lane
    MIXED = 3  # one prompt chunk (prompt role) and decode lanes (decode role) in one graph
    SPECULATIVE_VERIFY = 4  # target scores S+1 positions per lane and accepts a prefix of the draft
    DRAFT_PROPOSE = 5  # draft model proposals (reserved)
    PACKED_PREFILL = 6  # the next prompt chunks of up to capacity requests, concatenated in one submission
    SCORED_PREFILL = 12  # prefill that also scores every prompt token (fixed by the Protobuf)


class ValueSource(IntEnum):
    """What the runtime must upload into an input argument before replay."""

    TOKEN_IDS = 1  # int64[capacity] or int64[C]: the token each lane/row consumes
    POSITIONS = 2  # int64[capacity]: absolute position of each lane's token
    SLOT_IDS = 3  # int64[capacity]: physical slot of each lane (-1: inactive)
    SLOT_EPOCHS = 4  # int64[capacity]: generation counter of each lane's slot
    ACTIVE_LANES = 5  # int32[capacity]: nonzero for lanes in this submission
    FRAME_INDEX = 6  # int64[1]: completion frame this submission writes (0 or 1)
    CHUNK_START = 7  # int64[1]: absolute position of a prompt chunk's first row
    CHUNK_LENGTH = 8  # int64[1]: valid rows of a prompt chunk
    GENERATED_COUNTS = 9  # int64[capacity]: tokens the lane's request generated before this round
    TOKEN_BUDGET = 10  # int64[capacity]: the lane's max_tokens
    EOS_TOKEN_ID = 11  # int64[capacity]: the lane's EOS id (-1: ignore EOS)
    FORCED_TOKEN_ID = 12  # int64[capacity]: token to emit instead of sampling (-1: none)
    CHUNK_EMITS = 13  # int32[1]: nonzero when a prompt chunk ends the prompt and samples the next token
    DRAFT_TOKEN_IDS = 14  # int64[capacity, S]: each lane's proposed tokens, -1 after its proposal ends
    MIXED_PROMPT_LANE = 15  # int64[1]: the lane of a mixed graph in the prompt role (-1: none)
    KEY_WINDOW = 16  # int64[W] (declared [max_seq_len]): its extent W is the key window attention reads; contents unread
    PACKED_TOKEN_IDS = 17  # int64[capacity*C]: the lanes' prompt chunks concatenated in lane order, zero after
    SEGMENT_STARTS = 18  # int64[capacity]: absolute position of each lane's chunk's first row
    SEGMENT_LENGTHS = 19  # int64[capacity]: rows of each lane's chunk (0: an idle lane)
    SEGMENT_EMITS = 23  # int32[capacity]: nonzero when the lane's chunk ends its prompt and samples the next token
    SEGMENT_WINDOW = 24  # int64[E] (declared [C]): its extent E bounds the rows of each lane's chunk; contents unread
    SAMPLE_WINDOW = 25  # int64[W] (declared [vocab_padded]): its extent W bounds the sampler's sorted row; contents unread
    TRANSFORM_WINDOW = 26  # int64[T] (declared [vocab_padded]): its extent T bounds the columns constraints and penalties touch
    LOGPROB_REQUESTED = 20  # int32[capacity]: the flag vector
    LOGPROB_TOKEN_IDS = 21  # int32[capacity, 128]: caller-selected ids
    LOGPROB_TOKEN_ID_COUNTS = 22  # int32[capacity]: selected-id count (0: natural alternatives)
    TEMPERATURE = 30
    TOP_K = 31
    TOP_P = 32
    MIN_P = 33
    REPETITION_PENALTY = 34
    PRESENCE_PENALTY = 35
    FREQUENCY_PENALTY = 36
    SEED = 37
    RNG_OFFSET = 38
    PROMPT_TARGET_TOKEN = 39  # int32[C]: prompt token at chunk_start + j + 1, or -1 (fixed by the Protobuf)
    TOKEN_BITMASK = 40  # int32[capacity, VOCAB_WORDS]: bit i of word w allows token 32*w+i; an all-zero row: no mask
    LOGIT_BIAS_IDS = 41  # int64[capacity, 300]: biased token ids, -1 for an empty entry
    LOGIT_BIAS_VALUES = 42  # float32[capacity, 300]: the bias added to each id's sampling logit
    BLOCK_TABLES = 43  # int32[num_slots, max_blocks]: row s lists slot s's pool blocks in position order, 0 past them
    WINDOW_BLOCK_TABLES = 44  # int32[num_slots, max_blocks]: the sliding layers' pool blocks, 0 outside the window


class Role(IntEnum):
    """How a declared argument's storage is owned and filled."""

    INPUT = 1  # uploaded by the runtime each submission; must carry a value binding
    OUTPUT = 2  # runtime-owned storage the graph writes; never uploaded
    STATE = 3  # runtime-owned persistent storage the graph reads and updates (KV cache)
    WEIGHT = 4  # read-only tensor from the core's weights file, bound by name


class RoundKind(IntEnum):
    """ABI6 record field ROUND_KIND: what produced the record."""

    INVALID = 0  # lane not in the submission; writes the record only
    SAMPLING = 1  # ordinary sampling: emits position zero
    SPECULATIVE = 2  # verification round: emits the accepted prefix
    ADMISSION = 3  # records only, no emitted token
    MAINTENANCE = 4  # records only
    VISION = 5  # records only
    PROMPT = 6  # non-final prompt chunk: records only


class FinishReason(IntEnum):
    """ABI6 record field FINISH_REASON."""

    NONE = 0
    EOS = 1  # the emitted token is the request's EOS
    LENGTH = 2  # the request reached its token budget
    STOP_TOKEN = 3  # a caller stop-token id was emitted
    ERROR = 4


ENUMS = (Operation, ValueSource, Role, RoundKind, FinishReason)

_REJECTED = "a core declaring it is rejected by `ENUM-RESERVED`"
_RECORD_ONLY = ("no graph writes it; a record carrying it fails its request at the loader's record check "
                "(no validator rule: round kinds live in runtime records, not in cores)")
_RESERVED = (
    (Operation.DRAFT_PROPOSE, _REJECTED),
    (RoundKind.VISION, _RECORD_ONLY),
    (FinishReason.STOP_TOKEN, "no graph writes it; the loader matches stop ids on the host (no validator rule)"),
    (FinishReason.ERROR, "no graph writes it; the loader reports errors per request (no validator rule)"),
)
"""Codes assigned for features not built yet, and what a core (or record) using one gets today."""


def reserved_status(member: IntEnum) -> str | None:
    """What a core or record using a reserved code gets today; None for codes that are built.

    NOTE: keyed by (enum, name): IntEnum members of different enums with equal values compare equal.
    """
    return next((text for code, text in _RESERVED if type(code) is type(member) and code.name == member.name), None)
