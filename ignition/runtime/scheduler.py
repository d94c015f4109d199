"""Schedule: the engine's policy over a loaded core. Slots with epochs, admission order, the variant choice.

Each step, ``Scheduler.schedule`` decides what runs and returns it as plain data, one ``ScheduledRound`` per
submission: the prefill chunk of one request (or the chunks of several, packed), a mixed round, or decode rounds
for the running requests, each in the smallest variant that fits (the core's padding rule). The runner
(ignition/runtime/runner.py) submits a round; the output processor (ignition/runtime/outputs.py) turns its records
into lane updates and finished requests. A request for ``n`` samples is a group (``SampleGroups``,
ignition/runtime/samples.py); a request with ``constraints`` (``Constraints``, ignition/runtime/constrained.py)
never rides a speculative verify round; the drafter's proposals come from a ``Proposer``
(ignition/runtime/drafters.py). All three work on the one lane-state type, ``RequestState``.

On a core with a paged KV pool, a ``BlockManager`` (ignition/runtime/block_manager.py) holds each running request's
blocks: a request is admitted when a slot and the blocks of its context are free, a prefix hit starts its prefill
at the cached length, and before each round every lane's table grows to the positions the round writes; when blocks
run out, the most recently admitted running request is preempted (``preempt``) and readmitted later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ignition.catalog.buffers import KEY_WINDOW, SEGMENT_WINDOW, WINDOWS
from ignition.catalog.enums import Operation
from ignition.runtime.bindings import ChunkPlan, Lane, replayed_extent
from ignition.runtime.constrained import Constraints
from ignition.runtime.core import LoadedCore, LoadedVariant
from ignition.runtime.paging import block_manager_for, resume_prefix
from ignition.runtime.requests import RequestState
from ignition.runtime.runner import FreeSlots, smallest_fitting
from ignition.runtime.samples import SampleGroups
from ignition.runtime.state_snapshots import STATE_SNAPSHOT_MEMORY


@dataclass(slots=True)
class ScheduledRound:
    """One submission: the variant it replays and its lanes, in lane order (a lane names its request's state, its
    prompt chunk if any, its draft, and whether it retires a cancelled request)."""

    variant: LoadedVariant
    lanes: list[Lane]

    @property
    def chunk_rows(self) -> list[tuple[int, int, int]]:
        """``(lane, start, end)`` for each lane carrying a prompt chunk: the context positions ``[start, end)``."""
        return [(index, lane.chunk.start, lane.chunk.start + len(lane.chunk.tokens))
                for index, lane in enumerate(self.lanes) if lane.chunk is not None]

    @property
    def constraint_rows(self) -> list[int]:
        """The lanes whose bitmask and logit-bias rows carry their request's constraints."""
        return [index for index, lane in enumerate(self.lanes) if lane.constrained]


class Scheduler:
    """Admission order, slots and the choice of each round. Not thread-safe."""

    def __init__(self, core: LoadedCore, stats: dict, *, batch_invariant: bool = False, proposer=None,
                 constraints: Constraints, mixed: bool = True, packed: bool = True, prefix_caching: bool = True,
                 snapshot_memory: int = STATE_SNAPSHOT_MEMORY):
        self.core, self.stats = core, stats
        self.batch_invariant = batch_invariant
        self.proposer = proposer  # drafters.Proposer, or None: no speculative rounds
        self.constraints = constraints
        self.decode_variants = core.by_operation(Operation.DECODE)
        prefill = core.by_operation(Operation.PREFILL)
        if not self.decode_variants or not prefill:
            raise ValueError(f"core {core.path} needs PREFILL and DECODE variants to generate")
        self.prefill = prefill[-1]
        self.scored = core.by_operation(Operation.SCORED_PREFILL)
        self.mixed_variants = core.by_operation(Operation.MIXED) if mixed else []
        self.packed_variants = core.by_operation(Operation.PACKED_PREFILL) if packed else []
        self.chunk = next(a.shape[0] for a in self.prefill.arguments if a.name == "chunk_input_ids")
        num_slots = core.spec.model.num_slots
        self.num_slots = num_slots if num_slots is not None else self.decode_variants[-1].capacity
        self.epochs = [0] * self.num_slots
        self.free_slots = FreeSlots(self.num_slots)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.retiring: list[RequestState] = []  # cancelled while running: slot held until a MAINTENANCE record
        self.finished: dict[str, RequestState] = {}
        self.entry_limit: int | None = None  # undelivered entries at which a request stops being scheduled
        self.blocks = block_manager_for(core, prefix_caching, snapshot_memory, self.chunk)  # None: no paged caches
        self.groups = SampleGroups(core, self.num_slots, stats, self.blocks)  # n > 1 requests
        if self.blocks is not None:  # the positions a block table can hold
            self.max_positions = min(self.blocks.capacity_tokens, core.spec.model.max_seq_len or 1 << 62)

    # -- admission and slots ---------------------------------------------------------------
    def add(self, states: list[RequestState]) -> None:
        """Queue admitted requests (a group's samples together, sample 0 first)."""
        self.waiting.extend(states)

    def _assign_slots(self) -> None:
        while self.waiting and self.free_slots:
            group = self.waiting[0].group
            if group is not None and not group.admitted:  # first come, first served: later requests wait too
                if not self.groups.admit(self.waiting, len(self.free_slots), self._take_slot):
                    break
                continue
            if self.blocks is not None and not self.blocks.can_allocate(self.waiting[0]):
                break
            self._take_slot(self.waiting.popleft())

    def _take_slot(self, state: RequestState) -> None:
        state.slot = self.free_slots.take()
        self.epochs[state.slot] += 1  # a reused slot gets a new epoch: stale records cannot match
        state.epoch = self.epochs[state.slot]
        self.running.append(state)
        if self.blocks is not None and state.prompt_source is None:  # a waiting sample's blocks come from its leader
            cached = self.blocks.allocate(state)
            if cached:  # its prefill starts after the cached blocks
                state.prefilled = cached
                resume_prefix(self.core, self.blocks, state, cached)
        self.constraints.prefetch(state)  # its first row fills while its prompt is prefilled

    def _free_blocks(self, state: RequestState) -> None:
        """Cache ``state``'s written full blocks (not a failed request's: nothing it wrote is trusted), then drop its
        references."""
        if self.blocks is not None:
            if state.finish_reason != "error":
                self._cache(state)
            self.blocks.free(state)

    def cache_blocks(self, lanes: list[Lane]) -> None:
        """After a round: register the full blocks its lanes' requests have written in the prefix cache (and
        snapshot the states a later hit resumes)."""
        if self.blocks is not None:
            for lane in lanes:
                if lane.state.block_table:
                    self._cache(lane.state)
            if self.blocks.states is not None:
                self.blocks.states.after_round(lanes, self.blocks)

    def _cache(self, state: RequestState) -> None:
        """Register the full blocks of ``state``'s written tokens (its prompt and every generated token)."""
        self.blocks.cache(state, state.request.prompt_ids + state.generated)

    def finish(self, state: RequestState, reason: str, error: str | None = None, param: str | None = None) -> None:
        """End a running request: its slot is free for the next admission."""
        state.finish_reason, state.error, state.error_param = reason, error, param
        if self.proposer is not None:
            self.proposer.release(state.request_id)
        self.running.remove(state)
        self.free_slots.give(state.slot)
        self._free_blocks(state)
        self.finished[state.request_id] = state

    def release_retiring(self, states: list[RequestState]) -> None:
        """Free the slots of cancelled requests whose lanes need no record (any more)."""
        for state in states:
            self.retiring.remove(state)
            self.free_slots.give(state.slot)
            self._free_blocks(state)

    def release_idle(self) -> bool:
        """With no round to ride along with, nothing is in flight: free the cancelled lanes' slots directly; True
        when that lets a waiting request in."""
        freed = bool(self.retiring)
        self.release_retiring(list(self.retiring))
        return freed and bool(self.waiting)

    def _backlogged(self, state: RequestState) -> bool:
        """Its reader lags: ``entry_limit`` entries wait undelivered (a round adds at most T more)."""
        return self.entry_limit is not None and len(state.entries) >= self.entry_limit

    def preempt(self, request_id: str) -> None:
        """Free a running request's slot; it is readmitted later and re-prefills its context.

        The prompt end and the published score position are kept: readmission finishes any
        remaining prompt scores and never publishes a position twice.
        """
        state = next(s for s in self.running if s.request_id == request_id)
        self.groups.hand_over(state)
        self.running.remove(state)
        self.free_slots.give(state.slot)
        self._free_blocks(state)
        state.slot, state.prefilled, state.prompt_source = -1, 0, None
        self.waiting.appendleft(state)
        self.stats["preemptions"] += 1

    def cancel(self, request_id: str) -> None:
        """Abort a request (a client disconnect): its slot is freed at once. A group's id aborts every sample."""
        group = self.groups.by_id.get(request_id)
        if group is not None:  # the samples waiting for the prompt first: the prompt is then not handed over
            for member in reversed(group.members):
                if not member.done:
                    self.cancel(member.request_id)
            return
        for state in list(self.waiting):
            if state.request_id == request_id:
                self.waiting.remove(state)
                state.finish_reason = "abort"
                self.finished[request_id] = state
                return
        state = next((s for s in self.running if s.request_id == request_id), None)
        if state is not None and state.prompt_source is not None:  # a sample that never ran: nothing in flight
            self.finish(state, "abort")
            return
        if state is not None:  # the lane rides the next decode round as a records-only MAINTENANCE lane
            self.groups.hand_over(state)
            state.finish_reason = "abort"
            if self.proposer is not None:
                self.proposer.release(request_id)
            self.running.remove(state)
            self.finished[request_id] = state
            self.retiring.append(state)

    # -- the step's rounds -----------------------------------------------------------------
    def schedule(self) -> list[ScheduledRound]:
        """This step's submissions, in order (none when nothing runs: then ``release_idle``). A step with prompt left
        is one round: mixed, packed or one chunk; otherwise it decodes every running request, in rounds of the
        largest capacity (a verify family when the drafter proposes), cancelled lanes riding where there is room."""
        self.groups.forget()
        self._assign_slots()
        planned = {key: self.stats[key] for key in ("mixed_rounds", "packed_rounds")}
        while True:
            rounds = self._plan()
            if self.blocks is None or self._reserve(rounds):
                return rounds
            self.stats.update(planned)  # a preemption: those rounds never run

    def _reserve(self, rounds: list[ScheduledRound]) -> bool:
        """Grow every lane's block table to the positions its round writes; when the blocks run out, preempt the
        most recently admitted running request that holds blocks (False: plan the step again without it)."""
        for round in rounds:
            for lane in round.lanes:
                if lane.retire:
                    continue
                end = min(_written_end(lane), self.max_positions)  # draft rows past the end write block 0
                if not self.blocks.may_grow(lane.state, end):
                    victim = next((s for s in reversed(self.running) if s.block_table), lane.state)
                    self.preempt(victim.request_id)
                    return False
                self.blocks.grow(lane.state, end)
        return True

    def _plan(self) -> list[ScheduledRound]:
        """This step's rounds over the running requests (``schedule``)."""
        ready = [s for s in self.running if s.prompt_source is None]  # not a sample waiting for its prompt state
        prefilling = [s for s in ready if s.prefilled < len(s.context())]
        decoding = [s for s in ready if not s.done and not self._backlogged(s) and s not in prefilling]
        if prefilling:
            return [self._mixed_round(prefilling[0], decoding) or self._packed_prefill(prefilling)
                    or self._prefill_chunk(prefilling[0])]
        if not decoding:
            return []
        drafts = self._drafts(decoding)
        rounds: list[ScheduledRound] = []
        retiring = list(self.retiring)
        if any(drafts):  # constrained requests never ride a verify round (its graphs take no mask): decode apart
            masked = [s for s in decoding if self.constraints.applies(s)]
            plain = [(s, d) for s, d in zip(decoding, drafts) if not self.constraints.applies(s)]
            retiring = self._rounds(self.proposer.verify_variants, plain, retiring, rounds)
            retiring = self._rounds(self.decode_variants, [(s, []) for s in masked], retiring, rounds)
        else:
            retiring = self._rounds(self.decode_variants, list(zip(decoding, drafts)), retiring, rounds)
        self.release_retiring(retiring)  # no room in this step's rounds: nothing of theirs is in flight
        return rounds

    def _rounds(self, variants: list[LoadedVariant], planned: list[tuple[RequestState, list[int]]],
                retiring: list[RequestState], rounds: list[ScheduledRound]) -> list[RequestState]:
        """Append the rounds of ``planned`` (request, draft) lanes of the largest capacity, cancelled lanes riding
        where there is room; the cancelled lanes left without a round."""
        largest = variants[-1].capacity
        for start in range(0, len(planned), largest):
            lanes = [Lane(state=s, draft=d) for s, d in planned[start:start + largest]]
            riders, retiring = retiring[:largest - len(lanes)], retiring[largest - len(lanes):]
            lanes += [Lane(state=s, retire=True) for s in riders]  # exhausted budget: a MAINTENANCE record
            rounds.append(ScheduledRound(self._fitting(variants, lanes), lanes))
        return retiring

    def _fitting(self, variants: list[LoadedVariant], lanes: list[Lane]) -> LoadedVariant:
        return variants[-1] if self.batch_invariant else smallest_fitting(variants, lanes)

    def _drafts(self, decoding: list[RequestState]) -> list[list[int]]:
        """Each decoding request's proposal (``Proposer.propose``; empty without a drafter)."""
        if self.proposer is None:
            return [[] for _ in decoding]
        return self.proposer.propose(decoding, self.constraints.applies)

    def without(self, round: ScheduledRound, failed: Lane) -> ScheduledRound | None:
        """``round`` less a lane whose inputs could not be filled (nothing ran): a mixed round left without its
        prompt chunk becomes a decode round; None when no lane is left."""
        rest = [lane for lane in round.lanes if lane is not failed]
        if not rest:
            return None
        variant = round.variant
        if variant.operation is Operation.MIXED and all(lane.chunk is None for lane in rest):
            variant = self._fitting(self.decode_variants, rest)
        return ScheduledRound(variant, rest)

    def _mixed_round(self, prompting: RequestState, decoding: list[RequestState]) -> ScheduledRound | None:
        """The rule: a round is mixed when the core has a mixed variant with room for every decoding request plus
        the next prompt chunk's lane, there is at least one decoding request, the prompt request does not score
        its prompt (scored requests never enter the prompt role), the engine has no drafter (speculative engines
        schedule prompt chunks serially) and no cancelled lane waits for a round. The chunk and one decode round
        then run in one submission; otherwise the prompt chunk runs alone (serial) and decode waits."""
        if not self.mixed_variants or not decoding or prompting.scoring() or self.retiring or self.proposer:
            return None
        fitting = [v for v in self.mixed_variants if v.capacity >= len(decoding) + 1]
        if not fitting:
            return None
        variant = self.mixed_variants[-1] if self.batch_invariant else fitting[0]
        self.stats["mixed_rounds"] += 1
        return ScheduledRound(variant, [Lane(state=s) for s in decoding] + [_chunk_lane(prompting, self.chunk)])

    def _packed_prefill(self, prefilling: list[RequestState]) -> ScheduledRound | None:
        """The rule: when the core has a packed variant and the first request with prompt left (the lead) does not
        score it, the next chunks of the lead and of the following requests with prompt left that do not score it
        and whose chunk's key window is the lead's (``_window_of``), up to the variant's capacity, run in one
        ``packed`` submission, each cut as the serial round cuts it (at most C rows, the chunk limit), if there
        are at least two of them (one in batch-invariant mode, so that a request's rounds never depend on
        whether others waited with it). Otherwise the lead's chunk runs alone (``_prefill_chunk``; scored
        requests always do). Each lane's record, tokens and logprobs are the ones its serial round writes."""
        if not self.packed_variants or prefilling[0].scoring():
            return None
        variant = self.packed_variants[-1]
        chunk = variant.layout["packed"]["segment_rows"]
        window = self._window_of(variant, prefilling[0], chunk)
        states = [state for state in prefilling
                  if not state.scoring() and self._window_of(variant, state, chunk) == window][:variant.capacity]
        if len(states) < (1 if self.batch_invariant else 2):
            return None
        if not self.batch_invariant and not _packing_pays(variant, [_chunk_end(s, chunk) - s.prefilled
                                                                    for s in states]):
            return None
        self.stats["packed_rounds"] += 1
        return ScheduledRound(variant, [_chunk_lane(state, chunk) for state in states])

    @staticmethod
    def _window_of(variant: LoadedVariant, state: RequestState, chunk: int) -> int:
        """The key window a replay passes for ``state``'s next chunk alone. Lanes share one window and the keys'
        extent sets the order in which attention sums a row's values, so only lanes whose serial rounds pass the
        same window are packed together: their rows then sum exactly as the serial rounds do."""
        return replayed_extent(variant, KEY_WINDOW, _chunk_end(state, chunk)) if KEY_WINDOW in variant.buffers else 0

    def _prefill_chunk(self, state: RequestState) -> ScheduledRound:
        """One prompt chunk alone; a request that scores its prompt always takes scored prefill (the smallest
        variant that holds the rest of its context, else the largest), never the ordinary one."""
        variant, chunk = self.prefill, self.chunk
        if state.scoring():
            variant = next((v for v in self.scored if v.capacity >= len(state.context()) - state.prefilled),
                           self.scored[-1])
            chunk = variant.capacity
        return ScheduledRound(variant, [_chunk_lane(state, chunk, scored=variant.operation is Operation.SCORED_PREFILL)])


def _chunk_lane(state: RequestState, chunk: int, scored: bool = False) -> Lane:
    """The lane of ``state``'s next prompt chunk (at most ``chunk`` rows); a scored chunk's targets are the prompt
    tokens after each row (-1 past the prompt)."""
    context, prompt = state.context(), state.request.prompt_ids
    start = state.prefilled
    length = min(chunk, len(context) - start)
    emits = start + length == len(context) and not state.generated and state.request.max_tokens > 0
    targets = None
    if scored:
        targets = [prompt[p] if p < len(prompt) else -1 for p in range(start + 1, start + length + 1)]
    return Lane(state=state, chunk=ChunkPlan(start, context[start:start + length], emits, targets))


def _written_end(lane: Lane) -> int:
    """The position after the last one ``lane``'s round writes: its chunk's end, else its input token's position
    (bindings.py: the newest token's, or the last prompt token's for a sample whose prompt was copied) plus one
    and its draft."""
    if lane.chunk is not None:
        return lane.chunk.start + len(lane.chunk.tokens)
    state = lane.state
    return len(state.request.prompt_ids) + max(len(state.generated), 1) + len(lane.draft)


def _chunk_end(state: RequestState, chunk: int) -> int:
    """The position after ``state``'s next prompt chunk of at most ``chunk`` rows."""
    return min(state.prefilled + chunk, len(state.context()))


PACKED_SHORT_ROWS = 64
"""A packed round whose longest chunk has at most this many rows always pays: per-round overhead dominates."""
PACKED_MAX_PADDING = 2
"""Otherwise a packed round runs only when its attention's padded rows (every lane of the variant at the longest
chunk's extent, idle lanes included) are at most this many times the chunks' rows."""


def _packing_pays(variant: LoadedVariant, rows: list[int]) -> bool:
    """Whether one packed round of chunks of ``rows`` rows beats their serial rounds. The packed graph attends for
    every lane of its capacity over the longest chunk's extent (rounded to its window's granule), so 8 chunks of
    256 rows in a 32-lane variant (before PACKED_LANES capped the default variant at 8) attend over 4x the rows
    and copy 4x the key windows; at Qwen3-0.6B's shape that
    round ran 60 s against 42 s serially (8 x 512 prompts), while 8 x 64 ran 7.3 s against 8.4 s."""
    extent = WINDOWS[SEGMENT_WINDOW].covering(max(rows))
    return extent <= PACKED_SHORT_ROWS or variant.capacity * extent <= PACKED_MAX_PADDING * sum(rows)


__all__ = ["ScheduledRound", "Scheduler"]
