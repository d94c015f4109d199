"""The scheduler: the engine's policy over a loaded core. Slots with epochs, admission order, the variant choice.

Each step is one submission: the prefill chunk of one request (or the chunks of several, packed), a mixed
round, or one decode round for up to the largest capacity of running requests, run in the smallest variant
that fits (the core's padding rule). The mechanics of a submission (frames, inputs, replay, readback, the
record-ownership check) are the runner's (ignition.runtime.runner); the scheduler decides what to
submit and what each lane's record means for its request.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from ignition.catalog.abi import TokenEntry, has_payload
from ignition.catalog.buffers import KEY_WINDOW
from ignition.catalog.enums import FinishReason, Operation
from ignition.runtime.bindings import ChunkPlan, Lane, replayed_extent
from ignition.runtime.core import LoadedCore, LoadedVariant
from ignition.runtime.runner import OwnershipError, Runner, Submission
from ignition.runtime.requests import Request, check_admission


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
        self.free_slots = deque(range(self.num_slots))
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.retiring: list[RequestState] = []  # cancelled while running: slot held until a MAINTENANCE record
        self.entry_limit: int | None = None  # undelivered entries at which a request stops being scheduled
        self.finished: dict[str, RequestState] = {}
        self.runner = Runner(core)
        self._ids = itertools.count()
        self.stats = {"verify_rounds": 0, "proposed": 0, "accepted": 0, "mixed_rounds": 0, "packed_rounds": 0}

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
        """Admit a request (AdmissionError before any state changes) and return its id."""
        check_admission(request, self.core.features, self.core.vocab_size, self.max_context)
        request_id = request.request_id or f"req-{next(self._ids)}"
        self.waiting.append(RequestState(request, request_id))
        return request_id

    def _assign_slots(self) -> None:
        while self.waiting and self.free_slots:
            state = self.waiting.popleft()
            state.slot = self.free_slots.popleft()
            self.epochs[state.slot] += 1  # a reused slot gets a new epoch: stale records cannot match
            state.epoch = self.epochs[state.slot]
            self.running.append(state)

    def _finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        state.finish_reason, state.error = reason, error
        if self.drafter is not None:
            self.drafter.release(state.request_id)
        self.running.remove(state)
        self.free_slots.append(state.slot)
        self.finished[state.request_id] = state

    def _backlogged(self, state: RequestState) -> bool:
        """Its reader lags: ``entry_limit`` entries wait undelivered (a round adds at most T more)."""
        return self.entry_limit is not None and len(state.entries) >= self.entry_limit

    def _release_retiring(self, states: list[RequestState]) -> None:
        for state in states:
            self.retiring.remove(state)
            self.free_slots.append(state.slot)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one submission; False when nothing is left to do."""
        self._assign_slots()
        prefilling = [s for s in self.running if s.prefilled < len(s.context())]
        decoding = [s for s in self.running if not s.done and not self._backlogged(s) and s not in prefilling]
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
        variants = self.verify_variants if any(drafts) else self.decode_variants
        largest = variants[-1].capacity
        retiring = list(self.retiring)
        for start in range(0, len(decoding), largest):
            batch = zip(decoding[start:start + largest], drafts[start:start + largest])
            lanes = [Lane(state=s, draft=d) for s, d in batch]
            riders, retiring = retiring[:largest - len(lanes)], retiring[largest - len(lanes):]
            lanes += [Lane(state=s, retire=True) for s in riders]  # exhausted budget: a MAINTENANCE record
            variant = variants[-1] if self.batch_invariant else next(v for v in variants if v.capacity >= len(lanes))
            self._submit(variant, lanes)
        self._release_retiring(retiring)  # no room in this round
        return True

    def _drafts(self, decoding: list[RequestState]) -> list[list[int]]:
        """Each decoding request's proposal (empty without a drafter).

        The rule: a round is a speculative ``verify`` round when at least one lane has a proposal, else an
        ordinary decode round. A proposal never reaches past the request's token budget or a forced token
        (a forced token is emitted alone at position 0 of its own round), so every drafted position can be
        emitted; a lane without a proposal emits exactly what a decode round would.
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
            asks.append((state.request_id, state.request.prompt_ids + state.generated, max(limit, 0)))
        return self.drafter.propose(asks)

    def run(self) -> dict[str, Result]:
        while self.step():
            pass
        return {rid: self.result(rid) for rid in self.finished}

    def generate(self, requests: list[Request]) -> list[Result]:
        ids = [self.submit(r) for r in requests]
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
        self.running.remove(state)
        self.free_slots.append(state.slot)
        state.slot, state.prefilled = -1, 0
        self.waiting.appendleft(state)

    def state(self, request_id: str) -> RequestState:
        """The live state of a waiting, running or finished request (entries grow as it runs)."""
        for state in itertools.chain(self.waiting, self.running):
            if state.request_id == request_id:
                return state
        return self.finished[request_id]

    def cancel(self, request_id: str) -> None:
        """Abort a request (a client disconnect): its slot is freed at once."""
        for state in list(self.waiting):
            if state.request_id == request_id:
                self.waiting.remove(state)
                state.finish_reason = "abort"
                self.finished[request_id] = state
                return
        state = next((s for s in self.running if s.request_id == request_id), None)
        if state is not None:  # the lane rides the next decode round as a records-only MAINTENANCE lane
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
        lanes, finishes = zip(*(self._chunk_lane(state, chunk) for state in states))
        self._submit(variant, list(lanes))
        for finish in finishes:
            finish()
        self.stats["packed_rounds"] += 1
        return True

    @staticmethod
    def _window_of(variant: LoadedVariant, state: RequestState, chunk: int) -> int:
        """The key window a replay passes for ``state``'s next chunk alone. Lanes share one window and the keys'
        extent sets the order in which attention sums a row's values, so only lanes whose serial rounds pass the
        same window are packed together: their rows then sum exactly as the serial rounds do."""
        end = min(state.prefilled + chunk, len(state.context()))
        return replayed_extent(variant, KEY_WINDOW, end) if KEY_WINDOW in variant.buffers else 0

    def _prefill_chunk(self, state: RequestState) -> None:
        variant, chunk = self.prefill, self.chunk
        if state.scoring():  # prompt-logprob requests always take scored prefill, never the ordinary one
            variant = next((v for v in self.scored if v.capacity >= len(state.context()) - state.prefilled),
                           self.scored[-1])
            chunk = variant.capacity
        lane, finish = self._chunk_lane(state, chunk, scored=variant.operation is Operation.SCORED_PREFILL)
        self._submit(variant, [lane])
        finish()

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

    # -- one submission --------------------------------------------------------------------
    def _submit(self, variant: LoadedVariant, lanes: list[Lane]) -> None:
        submission = self.runner.submit(variant, lanes)
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
        state.prefilled = record.sequence_length  # the KV now holds everything before the newest token
        if record.finish_reason is FinishReason.LENGTH or len(state.generated) >= request.max_tokens:
            self._finish(state, "length")


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
