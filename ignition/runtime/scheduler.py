"""The scheduler: the engine's policy over a loaded core. Slots with epochs, admission order, the variant choice.

Each step is one submission: the prefill chunk of one request (or the chunks of several, packed), a mixed
round, or one decode round for up to the largest capacity of running requests, run in the smallest variant
that fits (the core's padding rule). The mechanics of a submission (frames, inputs, replay, readback, the
record-ownership check) are the runner's (ignition.runtime.runner); the scheduler decides what to
submit and what each lane's record means for its request. A request for ``n`` samples is a group
(ignition/runtime/samples.py): admitted together, its prompt prefilled once by its first sample and
copied into the others' slots (the "sample groups" methods). A request with ``constraints`` (structured output and
the sampling controls, ignition/runtime/constraints.py) has its bitmask and bias rows written before every
submission that samples for it, advances its grammar over every emitted token, and never rides a speculative
verify round (the "constraints" methods).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from ignition.catalog.abi import TokenEntry, has_payload
from ignition.catalog.buffers import KEY_WINDOW, SEGMENT_WINDOW, WINDOWS
from ignition.catalog.enums import FinishReason, Operation
from ignition.runtime.bindings import ChunkPlan, Lane, replayed_extent
from ignition.runtime.constraints import ConstraintError
from ignition.runtime.core import LoadedCore, LoadedVariant
from ignition.runtime.grammar import GrammarViolation
from ignition.runtime.runner import FreeSlots, OwnershipError, Runner, Submission, smallest_fitting
from ignition.runtime.requests import AdmissionError, Request, check_admission
from ignition.runtime.samples import PromptCopier, SampleGroup, sample_requests


@dataclass(slots=True)
class RequestState:
    request: Request
    request_id: str
    slot: int = -1
    epoch: int = 0
    prefilled: int = 0  # context tokens already in the KV state
    generated: list[int] = field(default_factory=list)
    prompt_entries: list[dict | None] = field(default_factory=list)  # published prompt scores, position 0 first
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    group: SampleGroup | None = None  # a sample of an n > 1 request (ignition/runtime/samples.py)
    prompt_source: RequestState | None = None  # the sibling whose slot will hold the prompt state to copy
    grammar_ended: bool = False  # finished "stop" because its grammar is complete: the EOS it forces next is implied
    error_param: str | None = None  # the request field an "error" finish is due to (its constraints): a client error

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def context(self) -> list[int]:
        """Tokens the KV state must hold before the next decode: the prompt, then all but the last generated."""
        return self.request.prompt_ids + self.generated[:-1]

    def scoring(self) -> bool:
        return self.request.prompt_logprobs is not None and len(self.prompt_entries) < len(self.request.prompt_ids)


@dataclass(slots=True)
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    entries: list[TokenEntry]
    finish_reason: str
    error: str | None
    prompt_entries: list[dict | None] | None = None


class Engine:
    """Runs requests through a loaded core. Not thread-safe; one submission at a time."""

    def __init__(self, core: LoadedCore, batch_invariant: bool = False, drafter=None, draft_tokens: int = 0,
                 mixed: bool = True, packed: bool = True):
        """``batch_invariant``: every decode round replays the largest-capacity variant, so a request's
        tokens and logprob words are bit-identical however it is co-batched (see docs/api.md).
        ``drafter`` (ignition.runtime.drafters) proposes up to ``draft_tokens`` tokens per request for the
        core's ``verify.s{S}`` variants (the smallest S >= draft_tokens); see ``_drafts``. ``mixed``: use the
        core's ``mixed`` variants when the rule of ``_mixed_round`` allows (False: always serial rounds).
        ``packed``: use the core's ``packed`` variant when the rule of ``_packed_prefill`` allows (False: one
        prompt chunk per round)."""
        self.core = core
        self.batch_invariant = batch_invariant
        self.drafter, self.draft_tokens = drafter, draft_tokens
        self.verify_variants = select_verify_variants(core, draft_tokens) if drafter is not None else []
        self.decode_variants = core.by_operation(Operation.DECODE)
        prefill = core.by_operation(Operation.PREFILL)
        if not self.decode_variants or not prefill:
            raise ValueError(f"core {core.path} needs PREFILL and DECODE variants to generate")
        self.prefill = prefill[-1]
        self.scored = core.by_operation(Operation.SCORED_PREFILL)
        self.mixed_variants = core.by_operation(Operation.MIXED) if mixed else []
        self.packed_variants = core.by_operation(Operation.PACKED_PREFILL) if packed else []
        self.chunk = next(a.shape[0] for a in self.prefill.arguments if a.name == "chunk_input_ids")
        model = core.manifest["model"]
        self.num_slots = model.get("num_slots", self.decode_variants[-1].capacity)
        self.max_context = model.get("max_seq_len")
        self.epochs = [0] * self.num_slots
        self.free_slots = FreeSlots(self.num_slots)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.retiring: list[RequestState] = []  # cancelled while running: slot held until a MAINTENANCE record
        self.entry_limit: int | None = None  # undelivered entries at which a request stops being scheduled
        self.finished: dict[str, RequestState] = {}
        self.runner = Runner(core)
        self._ids = itertools.count()
        self.stats = {"verify_rounds": 0, "proposed": 0, "accepted": 0, "mixed_rounds": 0,
                      "prefill_chunks": 0, "prompt_tokens_prefilled": 0, "prompt_copies": 0, "packed_rounds": 0}
        self.groups: dict[str, SampleGroup] = {}  # n > 1 requests by id, until every sample finished
        self.copier = PromptCopier(core)

    @property
    def readers(self):
        """Each variant's frame reader (the runner's)."""
        return self.runner.readers

    @property
    def decode_hook(self):
        """Called with (variant, reader, pending) once a frame is read back, before its lanes are decoded."""
        return self.runner.hook

    @decode_hook.setter
    def decode_hook(self, hook) -> None:
        self.runner.hook = hook

    # -- admission -------------------------------------------------------------------------
    def submit(self, request: Request) -> str:
        """Admit a request (AdmissionError before any state changes) and return its id; an ``n > 1`` request's
        id names its group (``samples`` lists the samples' ids)."""
        check_admission(request, self.core.features, self.core.vocab_size, self.max_context)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request.n > 1:
            return self._submit_group(request, request_id)
        self.waiting.append(RequestState(request, request_id))
        return request_id

    def _assign_slots(self) -> None:
        while self.waiting and self.free_slots:
            group = self.waiting[0].group
            if group is not None and not group.admitted:  # first come, first served: later requests wait too
                if not self._admit_group(group):
                    break
                continue
            self._take_slot(self.waiting.popleft())

    def _take_slot(self, state: RequestState) -> None:
        state.slot = self.free_slots.take()
        self.epochs[state.slot] += 1  # a reused slot gets a new epoch: stale records cannot match
        state.epoch = self.epochs[state.slot]
        self.running.append(state)
        self._prefetch_mask(state)  # its first row fills while its prompt is prefilled

    def _finish(self, state: RequestState, reason: str, error: str | None = None, param: str | None = None) -> None:
        state.finish_reason, state.error, state.error_param = reason, error, param
        if self.drafter is not None:
            self.drafter.release(state.request_id)
        self.running.remove(state)
        self.free_slots.give(state.slot)
        self.finished[state.request_id] = state

    def _backlogged(self, state: RequestState) -> bool:
        """Its reader lags: ``entry_limit`` entries wait undelivered (a round adds at most T more)."""
        return self.entry_limit is not None and len(state.entries) >= self.entry_limit

    def _release_retiring(self, states: list[RequestState]) -> None:
        for state in states:
            self.retiring.remove(state)
            self.free_slots.give(state.slot)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one submission; False when nothing is left to do."""
        self._forget_groups()
        self._assign_slots()
        ready = [s for s in self.running if s.prompt_source is None]  # not a sample waiting for its prompt state
        prefilling = [s for s in ready if s.prefilled < len(s.context())]
        decoding = [s for s in ready if not s.done and not self._backlogged(s) and s not in prefilling]
        if prefilling and self._mixed_round(prefilling[0], decoding):
            return True
        if prefilling and self._packed_prefill(prefilling):
            return True
        if prefilling:
            self._prefill_chunk(prefilling[0])
            return True
        if not decoding:  # no round to ride along with: nothing is in flight, free cancelled lanes' slots directly
            freed = bool(self.retiring)
            self._release_retiring(list(self.retiring))
            return freed and bool(self.waiting)
        drafts = self._drafts(decoding)
        retiring = list(self.retiring)
        if any(drafts):  # constrained requests never ride a verify round (its graphs take no mask): decode apart
            masked = [s for s in decoding if self._constrained(s)]
            plain = [(s, d) for s, d in zip(decoding, drafts) if not self._constrained(s)]
            retiring = self._rounds(self.verify_variants, plain, retiring)
            retiring = self._rounds(self.decode_variants, [(s, []) for s in masked], retiring)
        else:
            retiring = self._rounds(self.decode_variants, list(zip(decoding, drafts)), retiring)
        self._release_retiring(retiring)  # no room in this round
        return True

    def _rounds(self, variants: list[LoadedVariant], planned: list[tuple[RequestState, list[int]]],
                retiring: list[RequestState]) -> list[RequestState]:
        """Submit ``planned`` (request, draft) lanes in rounds of the largest capacity, cancelled lanes riding where
        there is room; the cancelled lanes left without a round."""
        largest = variants[-1].capacity
        for start in range(0, len(planned), largest):
            lanes = [Lane(state=s, draft=d) for s, d in planned[start:start + largest]]
            riders, retiring = retiring[:largest - len(lanes)], retiring[largest - len(lanes):]
            lanes += [Lane(state=s, retire=True) for s in riders]  # exhausted budget: a MAINTENANCE record
            variant = variants[-1] if self.batch_invariant else smallest_fitting(variants, lanes)
            self._submit(variant, lanes)
        return retiring

    def _drafts(self, decoding: list[RequestState]) -> list[list[int]]:
        """Each decoding request's proposal (empty without a drafter).

        The rule: a round is a speculative ``verify`` round when at least one lane has a proposal, else an
        ordinary decode round. A proposal never reaches past the request's token budget or a forced token
        (a forced token is emitted alone at position 0 of its own round), so every drafted position can be
        emitted; a lane without a proposal emits exactly what a decode round would. A constrained request gets
        no proposal (``step`` decodes it in an ordinary round).
        """
        if self.drafter is None:
            return [[] for _ in decoding]
        asks = []
        for state in decoding:
            generated = len(state.generated)
            limit = min(self.draft_tokens, state.request.max_tokens - generated - 1)
            forced = [index - generated for index in state.request.forced_tokens if index >= generated]
            if forced:
                limit = min(limit, min(forced) - 1)
            if self._constrained(state):
                limit = 0
            asks.append((state.request_id, state.request.prompt_ids + state.generated, max(limit, 0)))
        return self.drafter.propose(asks)

    def run(self) -> dict[str, Result]:
        while self.step():
            pass
        return {rid: self.result(rid) for rid in self.finished}

    def generate(self, requests: list[Request]) -> list[Result]:
        """One result per request, in order; an ``n > 1`` request gives its samples' results, in index order."""
        ids = [sample for r in requests for sample in self.samples(self.submit(r))]
        self.run()
        return [self.result(rid) for rid in ids]

    def result(self, request_id: str) -> Result:
        s = self.finished[request_id]
        return Result(request_id, list(s.request.prompt_ids), list(s.generated), list(s.entries),
                      s.finish_reason, s.error, s.prompt_entries if s.request.prompt_logprobs is not None else None)

    def preempt(self, request_id: str) -> None:
        """Free a running request's slot; it is readmitted later and re-prefills its context.

        The prompt end and the published score position are kept: readmission finishes any
        remaining prompt scores and never publishes a position twice.
        """
        state = next(s for s in self.running if s.request_id == request_id)
        self._hand_over_prompt(state)
        self.running.remove(state)
        self.free_slots.give(state.slot)
        state.slot, state.prefilled, state.prompt_source = -1, 0, None
        self.waiting.appendleft(state)

    def state(self, request_id: str) -> RequestState:
        """The live state of a waiting, running or finished request (entries grow as it runs)."""
        for state in itertools.chain(self.waiting, self.running):
            if state.request_id == request_id:
                return state
        return self.finished[request_id]

    def cancel(self, request_id: str) -> None:
        """Abort a request (a client disconnect): its slot is freed at once. A group's id aborts every sample."""
        if request_id in self.groups:  # the samples waiting for the prompt first: the prompt is then not handed over
            for member in reversed(self.groups[request_id].members):
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
            self._finish(state, "abort")
            return
        if state is not None:  # the lane rides the next decode round as a records-only MAINTENANCE lane
            self._hand_over_prompt(state)
            state.finish_reason = "abort"
            if self.drafter is not None:
                self.drafter.release(request_id)
            self.running.remove(state)
            self.finished[request_id] = state
            self.retiring.append(state)

    def _mixed_round(self, prompting: RequestState, decoding: list[RequestState]) -> bool:
        """The rule: a round is mixed when the core has a mixed variant with room for every decoding request plus
        the next prompt chunk's lane, there is at least one decoding request, the prompt request does not score
        its prompt (scored requests never enter the prompt role), the engine has no drafter (speculative engines
        schedule prompt chunks serially) and no cancelled lane waits for a round. The chunk and one decode round
        then run in one submission; otherwise the prompt chunk runs alone (serial) and decode waits."""
        if not self.mixed_variants or not decoding or prompting.scoring() or self.retiring or self.drafter:
            return False
        fitting = [v for v in self.mixed_variants if v.capacity >= len(decoding) + 1]
        if not fitting:
            return False
        variant = self.mixed_variants[-1] if self.batch_invariant else fitting[0]
        lane, finish = self._chunk_lane(prompting, self.chunk)
        self._submit(variant, [Lane(state=s) for s in decoding] + [lane])
        finish()
        self._share_prompt(prompting)
        self.stats["mixed_rounds"] += 1
        return True

    def _packed_prefill(self, prefilling: list[RequestState]) -> bool:
        """The rule: when the core has a packed variant and the first request with prompt left (the lead) does not
        score it, the next chunks of the lead and of the following requests with prompt left that do not score it
        and whose chunk's key window is the lead's (``_window_of``), up to the variant's capacity, run in one
        ``packed`` submission, each cut as the serial round cuts it (at most C rows, the chunk limit), if there
        are at least two of them (one in batch-invariant mode, so that a request's rounds never depend on
        whether others waited with it). Otherwise the lead's chunk runs alone (``_prefill_chunk``; scored
        requests always do). Each lane's record, tokens and logprobs are the ones its serial round writes."""
        if not self.packed_variants or prefilling[0].scoring():
            return False
        variant = self.packed_variants[-1]
        chunk = variant.layout["packed"]["segment_rows"]
        window = self._window_of(variant, prefilling[0], chunk)
        states = [state for state in prefilling
                  if not state.scoring() and self._window_of(variant, state, chunk) == window][:variant.capacity]
        if len(states) < (1 if self.batch_invariant else 2):
            return False
        if not self.batch_invariant and not _packing_pays(variant, [_chunk_end(s, chunk) - s.prefilled
                                                                    for s in states]):
            return False
        lanes, finishes = zip(*(self._chunk_lane(state, chunk) for state in states))
        self._submit(variant, list(lanes))
        for state, finish in zip(states, finishes):
            finish()
            self._share_prompt(state)
        self.stats["packed_rounds"] += 1
        return True

    @staticmethod
    def _window_of(variant: LoadedVariant, state: RequestState, chunk: int) -> int:
        """The key window a replay passes for ``state``'s next chunk alone. Lanes share one window and the keys'
        extent sets the order in which attention sums a row's values, so only lanes whose serial rounds pass the
        same window are packed together: their rows then sum exactly as the serial rounds do."""
        return replayed_extent(variant, KEY_WINDOW, _chunk_end(state, chunk)) if KEY_WINDOW in variant.buffers else 0

    def _prefill_chunk(self, state: RequestState) -> None:
        variant, chunk = self.prefill, self.chunk
        if state.scoring():  # prompt-logprob requests always take scored prefill, never the ordinary one
            variant = next((v for v in self.scored if v.capacity >= len(state.context()) - state.prefilled),
                           self.scored[-1])
            chunk = variant.capacity
        lane, finish = self._chunk_lane(state, chunk, scored=variant.operation is Operation.SCORED_PREFILL)
        self._submit(variant, [lane])
        finish()
        self._share_prompt(state)

    def _chunk_lane(self, state: RequestState, chunk: int, scored: bool = False):
        """The lane of ``state``'s next prompt chunk (at most ``chunk`` rows), and what to do once it was decoded."""
        context, prompt = state.context(), state.request.prompt_ids
        start = state.prefilled
        length = min(chunk, len(context) - start)
        last = start + length == len(context)
        emits = last and not state.generated and state.request.max_tokens > 0
        targets = None
        if scored:
            targets = [prompt[p] if p < len(prompt) else -1 for p in range(start + 1, start + length + 1)]
        lane = Lane(state=state, chunk=ChunkPlan(start, context[start:start + length], emits, targets))

        def finish():
            state.prefilled = max(state.prefilled, start + length)
            if last and not emits and not state.generated and not state.done:
                self._finish(state, "length")
        return lane, finish

    def _publish_prompt_rows(self, submission: Submission) -> None:
        """Decode this chunk's prompt rows (already read back) in order; published positions are skipped."""
        state, plan = submission.lanes[0].state, submission.lanes[0].chunk
        if not state.prompt_entries:
            state.prompt_entries.append(None)  # position 0 has no score
        prompt = state.request.prompt_ids
        for j, entry in enumerate(submission.prompt_entries(state.request.prompt_logprobs)):
            position = plan.start + j + 1
            if position != len(state.prompt_entries) or position >= len(prompt):
                continue
            if entry.id != prompt[position]:
                raise ValueError(f"prompt row {position} scores token {entry.id}, expected {prompt[position]}")
            state.prompt_entries.append(entry.as_json())

    # -- sample groups (n > 1; ignition/runtime/samples.py) ----------------------------------
    def _submit_group(self, request: Request, group_id: str) -> str:
        if request.n > self.num_slots:
            raise AdmissionError(f"n = {request.n} samples of one prompt decode together, one slot each, and this "
                                 f"core has {self.num_slots} slots", "n")
        if group_id in self.groups:
            raise AdmissionError(f"request id {group_id!r} is already running", "request_id")
        group = SampleGroup(group_id)
        group.members = [RequestState(sample, sample.request_id, group=group)
                         for sample in sample_requests(request, group_id)]
        self.waiting.extend(group.members)
        self.groups[group_id] = group
        return group_id

    def samples(self, request_id: str) -> list[str]:
        """The ids of a request's samples, in index order, while any runs: a group's, else the request's own id."""
        group = self.groups.get(request_id)
        return [member.request_id for member in group.members] if group is not None else [request_id]

    def _admit_group(self, group: SampleGroup) -> bool:
        """Give each of ``group``'s waiting samples a slot, all at once (False, nothing taken, while fewer slots
        are free). The first prefills the prompt; the others wait for its state (``_share_prompt``)."""
        members = list(itertools.takewhile(lambda state: state.group is group, self.waiting))
        if len(members) > len(self.free_slots):
            return False
        for state in members:
            self.waiting.popleft()
            self._take_slot(state)
        group.admitted = True
        if self.copier.shared:
            for state in members[1:]:
                state.prompt_source = members[0]
        return True

    def _share_prompt(self, leader: RequestState) -> None:
        """Once ``leader``'s prompt is in its slot (right after the submission that completed it, before any
        other), copy its prompt state into the slots of the samples waiting for it; they decode from there."""
        waiting = [s for s in leader.group.members if s.prompt_source is leader] if leader.group else []
        prompt = leader.request.prompt_ids
        if not waiting or (leader.error is None and leader.prefilled < len(prompt)):
            return
        for state in waiting:
            state.prompt_source = None
            if leader.error is not None:  # the prompt failed: so does every sample that shares it
                self._finish(state, "error", leader.error)
                continue
            state.prompt_entries = list(leader.prompt_entries)  # prompt scores are computed once, reported by all
            if state.request.max_tokens == 0:
                self._finish(state, "length")
                continue
            self.copier.copy(leader.slot, state.slot, len(prompt))
            state.prefilled = len(prompt)  # the first decode lane recomputes position L - 1 in its own slot
            self.stats["prompt_copies"] += 1

    def _hand_over_prompt(self, state: RequestState) -> None:
        """``state`` leaves before its prompt state was shared: the first sample waiting for it prefills the
        prompt in its own slot instead, for the others."""
        waiting = [s for s in state.group.members if s.prompt_source is state] if state.group else []
        if waiting:
            waiting[0].prompt_source = None
            for other in waiting[1:]:
                other.prompt_source = waiting[0]

    def _forget_groups(self) -> None:
        for group_id in [g for g, group in self.groups.items() if all(s.done for s in group.members)]:
            del self.groups[group_id]

    # -- one submission --------------------------------------------------------------------
    def _submit(self, variant: LoadedVariant, lanes: list[Lane]) -> None:
        for lane in lanes:
            if lane.chunk is not None:
                self.stats["prefill_chunks"] += 1
                self.stats["prompt_tokens_prefilled"] += len(lane.chunk.tokens)
        try:
            submission = self.runner.submit(variant, lanes)
        except (ConstraintError, GrammarViolation) as exc:
            if getattr(exc, "lane", None) is None:
                raise
            self._resubmit_without(variant, lanes, exc)
            return
        if variant.operation is Operation.SCORED_PREFILL:
            try:
                self._publish_prompt_rows(submission)
            except ValueError as exc:
                self._finish(lanes[0].state, "error", str(exc))
                return
        speculative = variant.operation is Operation.SPECULATIVE_VERIFY
        self.stats["verify_rounds"] += speculative
        for index, lane in enumerate(lanes):
            self._decode_lane(submission, index, lane)

    def _decode_lane(self, submission: Submission, index: int, lane: Lane) -> None:
        state, request = lane.state, lane.state.request
        if lane.retire:  # a cancelled request's lane: records only; its slot is free once the record is read
            self._release_retiring([state])
            return
        # The graph already gates the reduction on slot, epoch and emission (components/commit.py); the runner's
        # check asserts the same facts and fails only this request if a record is stale or foreign.
        try:
            record = submission.record(index)
        except OwnershipError as exc:
            self._finish(state, "error", str(exc))
            return
        if lane.chunk is not None and not lane.chunk.emits:
            return  # ADMISSION or PROMPT: positions come from record emission (none here), never from payload
        self.stats["proposed"] += len(lane.draft)
        self.stats["accepted"] += min(len(lane.draft), max(len(record.emitted) - 1, 0))
        for position, token in enumerate(record.emitted):
            if record.forced[position]:
                entry = TokenEntry(token, None, forced=True)
            elif request.wants_logprobs and not has_payload(record, position, submission.requested(index)):
                self._finish(state, "error", f"missing logprob payload for lane {index} position {position}")
                return
            elif request.wants_logprobs:
                try:
                    entry = submission.entry(index, position, token, request.logprobs,
                                             len(request.logprob_token_ids or ()))
                except ValueError as exc:
                    self._finish(state, "error", str(exc))
                    return  # an error suppresses this request's later tokens in the frame
            else:
                entry = TokenEntry(token, None)
            if token in request.stop_token_ids:
                self._finish(state, "stop")  # a token-id stop has no entry
                return
            if record.finish_reason is FinishReason.EOS and position == len(record.emitted) - 1:
                self._finish(state, "stop")  # a terminating EOS has no entry
                return
            state.generated.append(token)
            state.entries.append(entry)
            if not self._advance_grammar(state, token):
                return
        state.prefilled = record.sequence_length  # the KV now holds everything before the newest token
        if record.finish_reason is FinishReason.LENGTH or len(state.generated) >= request.max_tokens:
            self._finish(state, "length")
        else:
            self._prefetch_mask(state)  # the next row fills while the other lanes and the next round are prepared


    # -- constraints (structured output and sampling controls; ignition/runtime/constraints.py) --------
    @staticmethod
    def _constrained(state: RequestState) -> bool:
        constraints = state.request.constraints
        return constraints is not None and bool(constraints.fields)

    @staticmethod
    def _prefetch_mask(state: RequestState) -> None:
        """Start filling the grammar's next bitmask row in the background (``GrammarMatcher.prefetch``)."""
        constraints = state.request.constraints
        if constraints is not None and constraints.grammar is not None:
            constraints.grammar.prefetch()

    def _advance_grammar(self, state: RequestState, token: int) -> bool:
        """Advance ``state``'s grammar over an emitted token (forced ones too); False once that finished it: "error"
        on a token the grammar refuses, "stop" when the grammar is complete.

        A complete grammar allows only EOS next, so vLLM samples that EOS in one more step and counts it
        (``check_stop``, vllm/v1/core/sched/utils.py); the request ends here instead, one step earlier, with
        ``grammar_ended`` set so the server counts and lists the EOS as if it had been sampled (the same output,
        usage and ``token_ids``). With fewer than ``min_tokens`` tokens that EOS would be masked: the request
        fails as the next fill would (``ConstraintConflict``). With ``ignore_eos`` it simply ends "stop"."""
        constraints = state.request.constraints
        grammar = constraints.grammar if constraints is not None else None
        if grammar is None:
            return True
        try:
            grammar.accept(token)
        except GrammarViolation as exc:  # e.g. bytes the grammar needs that no token of this tokenizer produces
            self._finish(state, "error", str(exc), grammar.spec.param)
            return False
        if not grammar.stopped:
            return True
        if not state.request.ignore_eos:  # (with ignore_eos vLLM would emit that EOS until max_tokens)
            if len(state.generated) < constraints.min_tokens:
                self._finish(state, "error", f"the {grammar.spec.param} constraint is complete after "
                                             f"{len(state.generated)} tokens, before min_tokens = "
                                             f"{constraints.min_tokens}: nothing is allowed next", "min_tokens")
                return False
            state.grammar_ended = True
        self._finish(state, "stop")
        return False

    def _resubmit_without(self, variant: LoadedVariant, lanes: list[Lane], exc: Exception) -> None:
        """Filling the inputs failed for one lane (its constraints allow no token, or its grammar is in error):
        nothing ran; fail that lane's request and submit the others."""
        failed = lanes[exc.lane]
        fields = failed.state.request.constraints.fields
        self._finish(failed.state, "error", str(exc), getattr(exc, "param", None) or fields[0])
        rest = [lane for lane in lanes if lane is not failed]
        if not rest:
            return
        if variant.operation is Operation.MIXED and all(lane.chunk is None for lane in rest):
            variant = self.decode_variants[-1] if self.batch_invariant else \
                smallest_fitting(self.decode_variants, rest)
        self._submit(variant, rest)


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


def select_verify_variants(core: LoadedCore, draft_tokens: int) -> list[LoadedVariant]:
    """The ``verify.s{S}`` family with the smallest S >= ``draft_tokens``, by capacity; ValueError if none."""
    families: dict[int, list[LoadedVariant]] = {}
    for variant in core.by_operation(Operation.SPECULATIVE_VERIFY):
        families.setdefault(variant.layout["speculative"]["draft_tokens"], []).append(variant)
    fitting = sorted(s for s in families if s >= draft_tokens)
    if draft_tokens < 1 or not fitting:
        raise ValueError(f"core {core.path} has no verify variants for {draft_tokens} draft tokens "
                         f"(it has S = {sorted(families) or 'none'}); export it with --speculative-tokens {draft_tokens}")
    return families[fitting[0]]


__all__ = ["Engine", "Result", "select_verify_variants"]
