"""Fill a variant's input arguments from their value sources for one submission.

The full flag and count vectors are uploaded every submission (unused lanes cleared);
only each selecting lane's ID prefix is uploaded. Only lanes in the submission may set
flags, and a nonzero count requires that lane's flag: both are checked before upload.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ignition.catalog.buffers import (BUFFERS, CHUNK_TOKENS, PACKED_TOKENS, PENALTY_INPUTS, REQUESTED, SAMPLE_WINDOW,
                                     SAMPLING_DEFAULTS, SEGMENT_WINDOW, TOKEN_ID_COUNTS, TOKEN_IDS, TRANSFORM_WINDOW,
                                     WINDOW_INPUTS, WINDOWS)
from ignition.catalog.enums import ValueSource as S
from ignition.components.sampling import GREEDY_TEMPERATURE
from ignition.runtime.constraints import fill_mask_rows
from ignition.runtime.kv_groups import window_tables_of


@dataclass(slots=True)
class ChunkPlan:
    start: int  # absolute position of the chunk's first row
    tokens: list[int]
    emits: bool  # the chunk ends the context and samples the next token
    targets: list[int] | None = None  # scored prefill: prompt token at start + j + 1, or -1


@dataclass(slots=True)
class Lane:
    state: object  # RequestState
    chunk: ChunkPlan | None = None
    retire: bool = False  # a cancelled request's lane: no budget left, so the commit writes a MAINTENANCE record
    draft: list[int] = field(default_factory=list)  # a verify round's proposed tokens after the lane's input token

    @property
    def constrained(self) -> bool:
        """Whether this lane samples under its request's constraints: it writes bitmask and bias rows."""
        return self.state.request.constraints is not None and (self.chunk is None or self.chunk.emits) \
            and not self.retire


def _seed(state) -> int:
    seed = state.request.sampling.seed
    return seed if seed is not None else hash(state.request_id) & 0x7FFFFFFF


def _lane_values(lane: Lane, eos: int | None) -> dict[S, object]:
    state, request = lane.state, lane.state.request
    sampling = request.sampling
    generated = len(state.generated)
    if lane.chunk is not None:
        token, position = lane.chunk.tokens[-1], lane.chunk.start + len(lane.chunk.tokens) - 1
    elif not state.generated:  # a retiring lane cancelled before its first token
        token, position = request.prompt_ids[-1], len(request.prompt_ids) - 1
    else:
        token, position = state.generated[-1], len(request.prompt_ids) + generated - 1
    return {
        S.TOKEN_IDS: token, S.POSITIONS: position, S.SLOT_IDS: state.slot, S.SLOT_EPOCHS: state.epoch,
        S.ACTIVE_LANES: 1, S.GENERATED_COUNTS: generated, S.TOKEN_BUDGET: generated if lane.retire else request.max_tokens,
        S.EOS_TOKEN_ID: -1 if request.ignore_eos or eos is None else eos,
        S.FORCED_TOKEN_ID: request.forced_tokens.get(generated, -1),
        S.TEMPERATURE: sampling.temperature, S.TOP_K: sampling.top_k, S.TOP_P: sampling.top_p, S.MIN_P: sampling.min_p,
        S.REPETITION_PENALTY: sampling.repetition_penalty, S.PRESENCE_PENALTY: sampling.presence_penalty,
        S.FREQUENCY_PENALTY: sampling.frequency_penalty, S.SEED: _seed(state), S.RNG_OFFSET: generated,
    }


_WINDOW_SOURCES = frozenset([spec.source for spec in WINDOW_INPUTS] + [BUFFERS[SEGMENT_WINDOW].source])
"""The inputs whose extent alone is read (``Windowed`` narrows them; nothing is uploaded)."""
_IDLE = {S.SLOT_IDS: -1, S.EOS_TOKEN_ID: -1, S.FORCED_TOKEN_ID: -1, S.TOP_P: 1.0, S.REPETITION_PENALTY: 1.0}


def fill_inputs(variant, lanes: list[Lane], frame: int, core) -> tuple[np.ndarray, int]:
    """Upload every bound input; return the lane request mask and W (pairs to read back)."""
    inputs = core.transfer.inputs(variant)  # pinned host mirrors on CUDA, uploaded below; the buffers themselves on CPU
    b = inputs.buffers
    eos = core.spec.eos_token_id
    per_lane = [_lane_values(lane, eos) for lane in lanes]
    for name, source in variant.bindings.items():
        target = b[name]
        if source is S.FRAME_INDEX:
            target.fill_(frame)
        elif source is S.MIXED_PROMPT_LANE:  # a mixed round: the lane that carries the prompt chunk
            target.fill_(next((index for index, lane in enumerate(lanes) if lane.chunk is not None), -1))
        elif source in (S.CHUNK_START, S.CHUNK_LENGTH, S.CHUNK_EMITS) or (source is S.TOKEN_IDS and name == "chunk_input_ids"):
            plan = next(lane.chunk for lane in lanes if lane.chunk is not None)
            value = {S.CHUNK_START: plan.start, S.CHUNK_LENGTH: len(plan.tokens), S.CHUNK_EMITS: int(plan.emits)}.get(source)
            if value is None:
                target.zero_()
                target[:len(plan.tokens)] = torch.tensor(plan.tokens, dtype=target.dtype)
            else:
                target.fill_(value)
        elif source is S.PROMPT_TARGET_TOKEN:
            targets = lanes[0].chunk.targets
            target.fill_(-1)
            target[:len(targets)] = torch.tensor(targets, dtype=target.dtype)
        elif source is S.DRAFT_TOKEN_IDS:  # [lanes, S]: each lane's proposal, -1 after it (and in unused lanes)
            target.fill_(-1)
            for index, lane in enumerate(lanes):
                if len(lane.draft) > target.shape[1]:
                    raise RuntimeError(f"lane {index} proposes {len(lane.draft)} tokens; {variant.name} takes "
                                       f"{target.shape[1]}")
                target[index, :len(lane.draft)] = torch.tensor(lane.draft, dtype=target.dtype)
        elif source is S.BLOCK_TABLES:  # every lane's slot row: its request's blocks (runtime/kv_pool.py)
            core.kv_pool.fill_block_tables(target, {lane.state.slot: lane.state.block_table for lane in lanes})
        elif source is S.WINDOW_BLOCK_TABLES:  # the sliding pools' group (runtime/kv_groups.py)
            core.kv_pool.window.fill_block_tables(target, window_tables_of(lanes))
        elif source in _SEGMENT_SOURCES:  # a packed prefill: every lane's chunk
            fill_segments(variant, target, source, lanes)
        elif source in _WINDOW_SOURCES:  # only the extent is read (Windowed)
            continue
        elif source in (S.LOGPROB_REQUESTED, S.LOGPROB_TOKEN_IDS, S.LOGPROB_TOKEN_ID_COUNTS):
            continue  # below: the logprob inputs follow their own upload rules
        elif source in CONSTRAINT_SOURCES:
            continue  # below: fill_constraints writes the three together
        else:
            values = [values[source] for values in per_lane] + [_IDLE.get(source, 0)] * (variant.lanes - len(lanes))
            target.copy_(torch.tensor(values, dtype=target.dtype))
    fill_constraints(variant, lanes, b)
    flags = np.zeros(variant.lanes, dtype=np.int32)
    counts = np.zeros(variant.lanes, dtype=np.int32)
    for index, lane in enumerate(lanes):
        request = lane.state.request
        emits = (lane.chunk is None or lane.chunk.emits) and not lane.retire
        if request.wants_logprobs and emits:
            flags[index] = 1
            counts[index] = len(request.logprob_token_ids or ())
    if np.any((counts > 0) & (flags == 0)) or np.any(flags[len(lanes):]):
        raise RuntimeError("upload rule violated: a count without its flag, or a flag outside the submission")
    if REQUESTED in b:
        b[REQUESTED].copy_(torch.from_numpy(flags))
    if TOKEN_ID_COUNTS in b:
        b[TOKEN_ID_COUNTS].copy_(torch.from_numpy(counts))
        for index, lane in enumerate(lanes):
            if counts[index]:
                b[TOKEN_IDS][index, :counts[index]] = torch.tensor(lane.state.request.logprob_token_ids, dtype=torch.int32)
    inputs.upload()
    pairs = max([core.k] + [int(c) for c in counts]) if flags.any() else 0
    return flags.astype(bool), pairs


_SEGMENT_SOURCES = (S.PACKED_TOKEN_IDS, S.SEGMENT_STARTS, S.SEGMENT_LENGTHS, S.SEGMENT_EMITS)


def fill_segments(variant, target: torch.Tensor, source: S, lanes: list[Lane]) -> None:
    """One packed-prefill input: lane b's chunk is segment b (its rows follow lanes < b's in ``packed_input_ids``);
    lanes past the submission get zeros (no rows). RuntimeError when a lane has no chunk or the chunks do not fit."""
    plans = [lane.chunk for lane in lanes]
    if any(plan is None for plan in plans) or len(plans) > variant.lanes:
        raise RuntimeError(f"{variant.name}: a packed prefill takes 1 to {variant.lanes} lanes, each with a prompt "
                           f"chunk; got {len(plans)} lanes, {sum(plan is None for plan in plans)} without a chunk")
    target.zero_()
    if source is S.PACKED_TOKEN_IDS:
        tokens = [token for plan in plans for token in plan.tokens]
        if len(tokens) > target.shape[0]:
            raise RuntimeError(f"{variant.name}: the lanes' chunks hold {len(tokens)} rows; it takes {target.shape[0]}")
        target[:len(tokens)] = torch.tensor(tokens, dtype=target.dtype)
        return
    if source is S.SEGMENT_LENGTHS:
        rows = variant.layout["packed"]["segment_rows"]
        longest = max((len(plan.tokens) for plan in plans), default=0)
        if longest > rows:
            raise RuntimeError(f"{variant.name}: a chunk of {longest} rows; a lane takes at most {rows}")
    value = {S.SEGMENT_STARTS: lambda plan: plan.start, S.SEGMENT_LENGTHS: lambda plan: len(plan.tokens),
             S.SEGMENT_EMITS: lambda plan: int(plan.emits)}[source]
    target[:len(plans)] = torch.tensor([value(plan) for plan in plans], dtype=target.dtype)


def replayed_extent(variant, name: str, needed: int) -> int:
    """The extent of input ``name`` a replay of ``variant`` passes when it must cover ``needed`` positions or rows:
    the declared extent, unless the variant replays through a ``Windowed`` layer that narrows ``name`` (then the
    smallest multiple of its granule covering ``needed``, as ``Windowed.sizes`` rounds)."""
    window = WINDOWS[name]
    extent = next(a.shape[window.dim] for a in variant.arguments if a.name == name)
    if name not in (variant.layout.get("windows") or ()) or "windowed" not in variant.layers:
        return extent
    return window.covering(needed, extent)


def packed_needed(name: str, starts: torch.Tensor, lengths: torch.Tensor) -> int:
    """A packed prefill's window extents before rounding: all lanes' rows (the packed tokens), the longest lane's
    rows (the segment window), and past every lane's last position (the key window)."""
    if name == PACKED_TOKENS:
        return int(lengths.sum())
    if name == SEGMENT_WINDOW:
        return int(lengths.max())
    return int((starts + lengths).max())


CONSTRAINT_SOURCES = (S.TOKEN_BITMASK, S.LOGIT_BIAS_IDS, S.LOGIT_BIAS_VALUES)
_UNCONSTRAINED: dict[int, weakref.ref] = {}
"""id -> weak reference of each bitmask buffer whose variant's constraint inputs hold the neutral values (zero rows,
ids -1) since their last upload: a round without constrained lanes skips the three uploads (~0.7 MB per round at
capacity 32 and a Qwen vocabulary)."""


def fill_constraints(variant, lanes: list[Lane], buffers: dict | None = None) -> None:
    """The structured-output inputs: each sampling lane's bitmask and bias rows from its request's
    ``LaneConstraints`` (after the lane's matcher accepted every generated token), zero rows and ids -1 for
    every other lane (idle, unconstrained, a prompt chunk that emits nothing, a retiring lane). ``buffers``: where
    inputs are written (``fill_inputs``' staged mirrors, which its one upload carries; default the variant's own)."""
    buffers = variant.buffers if buffers is None else buffers
    names = {source: name for name, source in variant.bindings.items() if source in CONSTRAINT_SOURCES}
    constrained = [(index, lane.state.request.constraints, lane.state.generated) for index, lane in enumerate(lanes)
                   if lane.constrained]
    if len(names) != len(CONSTRAINT_SOURCES):
        if constrained:  # a verify variant, or a core without the feature: the lane would sample unconstrained
            raise RuntimeError(f"{variant.name} takes no structured-output inputs; lane {constrained[0][0]}'s request "
                               "is constrained")
        return
    mask = buffers[names[S.TOKEN_BITMASK]]
    ids, values = buffers[names[S.LOGIT_BIAS_IDS]], buffers[names[S.LOGIT_BIAS_VALUES]]
    neutral = _UNCONSTRAINED.get(id(mask))
    if not constrained and neutral is not None and neutral() is mask:  # NOTE: `is`: tensors compare elementwise
        return
    mask_rows = np.zeros(tuple(mask.shape), dtype=np.int32)
    id_rows = np.full(tuple(ids.shape), -1, dtype=np.int64)
    value_rows = np.zeros(tuple(values.shape), dtype=np.float32)
    fill_mask_rows(mask_rows, constrained)
    for index, constraints, _ in constrained:
        constraints.fill_bias(id_rows[index], value_rows[index])
    mask.copy_(torch.from_numpy(mask_rows))
    ids.copy_(torch.from_numpy(id_rows))
    values.copy_(torch.from_numpy(value_rows))
    if constrained:
        _UNCONSTRAINED.pop(id(mask), None)
    else:
        _UNCONSTRAINED[id(mask)] = weakref.ref(mask)


class Windowed:
    """A variant's ``run(buffers)`` through a graph with windowed inputs (``layout["windows"]``).

    Each call passes, for each window, the smallest prefix that covers the submission, rounded up to the
    window's granule and capped at the declared extent (``catalog.buffers.WINDOWS``):

    - the key window covers every position the submission writes or attends from (the lanes' positions, a
      verify lane's drafts after its input token, a chunk's rows): keys past it are past every row's
      position, so the result is the full window's;
    - the chunk tokens cover the chunk's valid rows: the rows past them are padding, whose cache writes the
      graph drops and whose outputs nothing reads;
    - the sample window is the whole row when any lane samples (a greedy round's tokens are the row's argmax);
    - the transform window is the whole row when any lane has a token bitmask, a logit bias or a penalty other than
      its ``SAMPLING_DEFAULTS`` value: otherwise the transforms are the identity on every column.

    It reads only uploaded inputs, so every tensor-parallel rank derives the same windows from the same
    broadcast inputs.
    """

    def __init__(self, run, bindings: dict[str, S], windows: list[str]):
        self.run, self.windows = run, list(windows)
        by_source = {source: name for name, source in bindings.items()}
        self.positions, self.drafts = by_source.get(S.POSITIONS), by_source.get(S.DRAFT_TOKEN_IDS)
        self.temperature = by_source.get(S.TEMPERATURE)
        self.penalties = {by_source[BUFFERS[name].source]: SAMPLING_DEFAULTS[name] for name in PENALTY_INPUTS
                          if BUFFERS[name].source in by_source}  # buffer -> its neutral value
        self.bitmask, self.bias = by_source.get(S.TOKEN_BITMASK), by_source.get(S.LOGIT_BIAS_IDS)
        self.chunk = (by_source[S.CHUNK_START], by_source[S.CHUNK_LENGTH]) if S.CHUNK_START in by_source else None
        self.segments = (by_source[S.SEGMENT_STARTS], by_source[S.SEGMENT_LENGTHS]) if S.SEGMENT_STARTS in by_source \
            else None

    def needed(self, name: str, buffers: dict[str, torch.Tensor]) -> int:
        """The extent of window ``name`` this submission needs, before rounding."""
        if name == SAMPLE_WINDOW:  # the whole row when any lane samples (idle lanes are greedy)
            samples = bool((buffers[self.temperature] >= GREEDY_TEMPERATURE).any())
            return buffers[name].shape[WINDOWS[name].dim] if samples else 1
        if name == TRANSFORM_WINDOW:  # the whole row when any lane transforms it (idle lanes upload neutral values)
            return buffers[name].shape[WINDOWS[name].dim] if self.transforms(buffers) else 1
        if self.segments is not None:
            return packed_needed(name, *(buffers[input_name] for input_name in self.segments))
        if name == CHUNK_TOKENS:
            return int(buffers[self.chunk[1]].max())
        needed = 1
        if self.positions is not None:
            ahead = buffers[self.drafts].shape[1] if self.drafts is not None else 0
            needed = max(needed, int(buffers[self.positions].max()) + 1 + ahead)
        if self.chunk is not None:
            needed = max(needed, int(buffers[self.chunk[0]].max() + buffers[self.chunk[1]].max()))
        return needed

    def transforms(self, buffers: dict[str, torch.Tensor]) -> bool:
        """Whether any lane's sampling row is transformed: a bitmask or bias entry, or a non-neutral penalty."""
        if any(bool((buffers[name] != neutral).any()) for name, neutral in self.penalties.items()):
            return True
        if self.bitmask is not None and bool((buffers[self.bitmask] != 0).any()):
            return True
        return self.bias is not None and bool((buffers[self.bias] >= 0).any())

    def sizes(self, buffers: dict[str, torch.Tensor]) -> dict[str, int]:
        """Window -> the extent this submission passes."""
        sizes = {}
        for name in self.windows:
            window = WINDOWS[name]
            sizes[name] = window.covering(self.needed(name, buffers), buffers[name].shape[window.dim])
        return sizes

    def __call__(self, buffers: dict[str, torch.Tensor]):
        narrowed = {name: buffers[name].narrow(WINDOWS[name].dim, 0, size) for name, size in self.sizes(buffers).items()
                    if size < buffers[name].shape[WINDOWS[name].dim]}
        return self.run({**buffers, **narrowed} if narrowed else buffers)
