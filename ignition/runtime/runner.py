"""The runner: one submission of a loaded core's variant, from lanes to decoded records.

It does the mechanics and nothing else: the frame a submission writes (frames alternate, so the
host reads one while the next submission writes the other), filling the bound inputs
(ignition.runtime.bindings), the replay, the readback of records and payload
(ignition.runtime.frames), and the record-ownership check. Which requests run, in which variant,
and what their records mean for them is the scheduler's (ignition.runtime.scheduler); a draft
core's drafter (ignition.runtime.drafters) drives its own core through a runner of its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from ignition.catalog.abi import PromptEntry, Record, TokenEntry
from ignition.catalog.enums import Operation, RoundKind
from ignition.catalog.model import admits_slots
from ignition.runtime.bindings import Lane, fill_inputs
from ignition.runtime.frames import FrameReader, PendingFrame

RECORDS_ONLY = (RoundKind.ADMISSION, RoundKind.PROMPT)
"""What a prompt chunk that emits nothing records."""


class OwnershipError(ValueError):
    """A lane's record names another slot, epoch or round kind: stale or foreign; the message says whose."""


def expected_kinds(lane: Lane, operation: Operation) -> tuple[RoundKind, ...]:
    """The round kinds a lane's record may carry in a submission of ``operation``."""
    if lane.chunk is not None and not lane.chunk.emits:
        return RECORDS_ONLY
    return (RoundKind.SPECULATIVE,) if operation is Operation.SPECULATIVE_VERIFY else (RoundKind.SAMPLING,)


@dataclass(slots=True)
class Submission:
    """One replayed submission whose records (and payload, and prompt rows) are on the host."""

    variant: object  # LoadedVariant
    lanes: list[Lane]
    reader: FrameReader
    pending: PendingFrame

    def record(self, index: int) -> Record:
        """Lane ``index``'s record, checked against the lane's slot, epoch and expected round kind."""
        lane, record = self.lanes[index], self.reader.record(index)
        state = lane.state
        expected = expected_kinds(lane, self.variant.operation)
        if (record.slot, record.epoch) != (state.slot, state.epoch) or record.round_kind not in expected:
            raise OwnershipError(f"record of lane {index} belongs to slot {record.slot} epoch {record.epoch} "
                                 f"({record.round_kind.name}), expected slot {state.slot} epoch {state.epoch}")
        return record

    def requested(self, index: int) -> bool:
        return bool(self.pending.request_mask[index])

    def entry(self, index: int, position: int, token: int, natural: int | None, selected: int) -> TokenEntry:
        """Position ``position`` of lane ``index``'s payload; ValueError when missing or inconsistent."""
        return self.reader.entry(index, position, self.pending, token, natural, selected)

    def prompt_entries(self, alternatives: int) -> list[PromptEntry]:
        """The scored prompt rows of this submission's chunk, row 0 first (scored prefill only)."""
        return [self.reader.prompt_entry(row, alternatives) for row in range(len(self.lanes[0].chunk.tokens))]


class FreeSlots:
    """A cache's free slots, the lowest taken first: the running lanes stay in the lowest slots, where a decode variant
    with a slot limit (``layout["slot_limit"]``: its lanes' slots all below it) can serve them."""

    def __init__(self, count: int):
        self._free = list(range(count))  # a heap

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self):
        return iter(sorted(self._free))

    def __contains__(self, slot: int) -> bool:
        return slot in self._free


def smallest_fitting(variants: list, lanes: list[Lane]):
    """The first of ``variants`` (ascending capacity) with room for ``lanes`` whose slot limit admits their slots; the
    widest decode variant has no limit, so a round of at most its capacity always fits."""
    slots = [lane.state.slot for lane in lanes]
    return next(v for v in variants if v.capacity >= len(lanes) and admits_slots(v.layout, slots))


class Runner:
    """Submits lanes to a loaded core's variants and reads the results back. One submission at a time."""

    def __init__(self, core):
        self.core = core
        self.readers = {v.name: FrameReader(v.buffers, core.transfer) for v in core.variants.values()
                        if v.layout.get("records")}
        self.hook: Callable | None = None  # tests and the server: called with (variant, reader, pending) after readback

    def submit(self, variant, lanes: list[Lane]) -> Submission:
        if not admits_slots(variant.layout, [lane.state.slot for lane in lanes]):
            raise ValueError(f"{variant.name} serves slots below {variant.layout['slot_limit']} only, and the lanes hold "
                             f"slots {[lane.state.slot for lane in lanes]}: submit them to a variant that fits "
                             "(runner.smallest_fitting)")
        frame = variant.next_frame
        request_mask, pairs = fill_inputs(variant, lanes, frame, self.core)  # may fail one lane: nothing ran yet
        variant.next_frame ^= 1
        variant.run(variant.buffers)
        owners = [(lane.state.slot, lane.state.epoch) for lane in lanes] + [None] * (variant.lanes - len(lanes))
        pending = PendingFrame(frame, owners, request_mask, pairs)
        reader = self.readers[variant.name]
        scored = variant.operation is Operation.SCORED_PREFILL
        reader.read(variant.buffers, pending, prompt_rows=len(lanes[0].chunk.tokens) if scored else 0)
        if self.hook is not None:
            self.hook(variant, reader, pending)
        return Submission(variant, lanes, reader, pending)


__all__ = ["FreeSlots", "Runner", "Submission", "OwnershipError", "expected_kinds", "smallest_fitting", "RECORDS_ONLY"]
