"""The engine: requests in, results out, one step at a time over a loaded core.

Each step has three parts, as vLLM v1's ``EngineCore.step`` and nano-vllm's ``LLMEngine.step`` do:

1. **schedule** (ignition/runtime/scheduler.py): ``Scheduler.schedule`` chooses the step's rounds, plain data
   (``ScheduledRound``: the variant, its lanes, their chunk and constraint rows);
2. **submit** (ignition/runtime/runner.py): ``Runner.submit`` fills a round's inputs, replays the variant and reads
   its frame back;
3. **interpret** (ignition/runtime/outputs.py): ``OutputProcessor`` turns the records into lane updates and
   finished requests, the token that stopped each one included.
"""

from __future__ import annotations

import itertools

from ignition.runtime.constrained import Constraints
from ignition.runtime.constraints import ConstraintError
from ignition.runtime.core import LoadedCore
from ignition.runtime.drafters import Proposer
from ignition.runtime.grammar import GrammarViolation
from ignition.runtime.outputs import OutputProcessor, Result
from ignition.runtime.requests import AdmissionError, Request, RequestState, check_admission
from ignition.runtime.runner import Runner
from ignition.runtime.scheduler import ScheduledRound, Scheduler
from ignition.runtime.state_snapshots import STATE_SNAPSHOT_MEMORY


class ContextError(ValueError):
    """A ``max_context`` beyond the core's own context; ``context`` is the core's, ``source`` where it comes from
    (``model.max_seq_len``, or the KV cache's capacity)."""

    def __init__(self, max_context: int, context: int, source: str = "model.max_seq_len"):
        super().__init__(f"max_context {max_context} exceeds the core's context of {context} tokens ({source})")
        self.context, self.source = context, source


class Engine:
    """Runs requests through a loaded core. Not thread-safe; one submission at a time."""

    def __init__(self, core: LoadedCore, batch_invariant: bool = False, drafter=None, draft_tokens: int = 0,
                 mixed: bool = True, packed: bool = True, max_context: int | None = None, prefix_caching: bool = True,
                 state_snapshot_memory: int = STATE_SNAPSHOT_MEMORY):
        """``batch_invariant``: every decode round replays the largest-capacity variant, so a request's
        tokens and logprob words are bit-identical however it is co-batched (see docs/serving.md, "Engine options").
        ``drafter`` (ignition.runtime.drafters) proposes up to ``draft_tokens`` tokens per request for the
        core's ``verify.s{S}`` variants (the smallest S >= draft_tokens). ``mixed``: use the core's ``mixed``
        variants when the rule of ``Scheduler._mixed_round`` allows (False: always serial rounds). ``packed``: use
        the core's ``packed`` variant when the rule of ``Scheduler._packed_prefill`` allows (False: one prompt chunk
        per round). ``max_context``: the context admission checks prompt + max_tokens against (default the core's
        ``model.max_seq_len``, or the KV cache's capacity in tokens when that is smaller; ContextError above
        either). ``prefix_caching``: on a core with a paged KV pool, requests
        reuse the cached blocks of earlier requests' equal prefixes (ignition/runtime/block_manager.py).
        ``state_snapshot_memory``: host bytes for the snapshots of linear-attention states a prefix hit resumes
        (ignition/runtime/state_snapshots.py; a budget below one snapshot turns prefix reuse off for such a core)."""
        self.core = core
        context = core.spec.model.max_seq_len
        if max_context is not None and context is not None and max_context > context:
            raise ContextError(max_context, context)
        self.stats = {"verify_rounds": 0, "proposed": 0, "accepted": 0, "mixed_rounds": 0,
                      "prefill_chunks": 0, "prompt_tokens_prefilled": 0, "prompt_copies": 0, "packed_rounds": 0,
                      "preemptions": 0}
        proposer = Proposer.for_core(core, drafter, draft_tokens) if drafter is not None else None
        self.scheduler = Scheduler(core, self.stats, batch_invariant=batch_invariant, proposer=proposer,
                                   constraints=Constraints(core.spec.eos_token_id), mixed=mixed,
                                   packed=packed, prefix_caching=prefix_caching,
                                   snapshot_memory=state_snapshot_memory)
        blocks = self.scheduler.blocks
        if blocks is not None and max_context is not None and max_context > blocks.capacity_tokens:
            raise ContextError(max_context, blocks.capacity_tokens, f"the KV cache's capacity: {blocks.num_blocks} "
                                                                    f"blocks of {blocks.block_size}")
        if blocks is not None:  # one request never holds more than the whole pool
            context = blocks.capacity_tokens if context is None else min(context, blocks.capacity_tokens)
        self.max_context = max_context if max_context is not None else context
        self.runner = Runner(core)
        self.outputs = OutputProcessor(self.scheduler, self.stats)
        self._ids = itertools.count()

    # -- requests --------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """The admission check (AdmissionError naming the field): the request against the core and this engine's
        context and slots."""
        check_admission(request, self.core.spec, self.max_context)

    def submit(self, request: Request, *, checked: bool = False) -> str:
        """Admit a request (AdmissionError before any state changes) and return its id; an ``n > 1`` request's
        id names its group (``samples`` lists the samples' ids). ``checked``: the caller already ran ``check`` on
        it (the server checks every prompt of a request before it submits any), so it is not checked again."""
        if not checked:
            self.check(request)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request.n > 1:
            self.scheduler.add(self.scheduler.groups.add(request, request_id))
        else:
            self.scheduler.add([RequestState(request, request_id)])
        return request_id

    def samples(self, request_id: str) -> list[str]:
        """The ids of a request's samples, in index order, while any runs: a group's, else the request's own id."""
        return self.scheduler.groups.samples(request_id)

    def state(self, request_id: str) -> RequestState:
        """The live state of a waiting, running or finished request (entries grow as it runs)."""
        for state in itertools.chain(self.scheduler.waiting, self.scheduler.running):
            if state.request_id == request_id:
                return state
        return self.scheduler.finished[request_id]

    def cancel(self, request_id: str) -> None:
        """Abort a request (a client disconnect): its slot is freed at once. A group's id aborts every sample."""
        self.scheduler.cancel(request_id)

    def preempt(self, request_id: str) -> None:
        """Free a running request's slot; it is readmitted later and re-prefills its context."""
        self.scheduler.preempt(request_id)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step (schedule, submit, interpret); False when nothing is left to do."""
        rounds = self.scheduler.schedule()
        if not rounds:
            return self.scheduler.release_idle()
        self.execute(rounds)
        return True

    def execute(self, rounds: list[ScheduledRound]) -> None:
        """Submit and interpret the rounds ``Scheduler.schedule`` chose, in order (each exactly once)."""
        for round in rounds:
            self._execute(round)
            self.outputs.complete_chunks(round.lanes)
            self.scheduler.cache_blocks(round.lanes)

    def _execute(self, round: ScheduledRound) -> None:
        """Submit ``round`` and interpret its records. Filling the inputs may fail for one lane (its constraints allow
        no token, or its grammar is in error): nothing ran, so that lane's request fails and the others run."""
        for lane in round.lanes:
            if lane.chunk is not None:
                self.stats["prefill_chunks"] += 1
                self.stats["prompt_tokens_prefilled"] += len(lane.chunk.tokens)
        try:
            submission = self.runner.submit(round.variant, round.lanes)
        except (ConstraintError, GrammarViolation) as exc:
            if getattr(exc, "lane", None) is None:
                raise
            failed = round.lanes[exc.lane]
            fields = failed.state.request.constraints.fields
            self.scheduler.finish(failed.state, "error", str(exc), getattr(exc, "param", None) or fields[0])
            rest = self.scheduler.without(round, failed)
            if rest is not None:
                self._execute(rest)
            return
        self.outputs.interpret(submission)

    def run(self) -> dict[str, Result]:
        while self.step():
            pass
        return {rid: self.result(rid) for rid in self.scheduler.finished}

    def generate(self, requests: list[Request]) -> list[Result]:
        """One result per request, in order; an ``n > 1`` request gives its samples' results, in index order."""
        ids = [sample for r in requests for sample in self.samples(self.submit(r))]
        self.run()
        return [self.result(rid) for rid in ids]

    def result(self, request_id: str) -> Result:
        return Result.of(self.scheduler.finished[request_id])

    # -- the scheduler's and runner's state, as callers read it ----------------------------
    def kv_cache_stats(self) -> dict:
        """The paged KV cache's counters as vLLM names them: prefix-cache queries and hits in tokens, and the
        fraction of blocks requests hold (all 0 for a core without a paged pool); ``state_snapshot_bytes``: the
        host bytes the linear-attention state snapshots hold (0 for a core without them)."""
        blocks = self.scheduler.blocks
        if blocks is None:
            return {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "kv_cache_usage_perc": 0.0,
                    "state_snapshot_bytes": 0}
        return {"prefix_cache_queries": blocks.queries, "prefix_cache_hits": blocks.hits,
                "kv_cache_usage_perc": blocks.usage(),
                "state_snapshot_bytes": blocks.states.nbytes if blocks.states is not None else 0}

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the paged KV pool holds (None: a core without one)."""
        return self.scheduler.blocks.capacity_tokens if self.scheduler.blocks is not None else None

    @property
    def num_slots(self) -> int:
        return self.scheduler.num_slots

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[RequestState]:
        return self.scheduler.running

    @property
    def retiring(self) -> list[RequestState]:
        return self.scheduler.retiring

    @property
    def finished(self) -> dict[str, RequestState]:
        return self.scheduler.finished

    @property
    def free_slots(self):
        return self.scheduler.free_slots

    @property
    def epochs(self) -> list[int]:
        return self.scheduler.epochs

    @property
    def groups(self):
        return self.scheduler.groups

    @property
    def entry_limit(self) -> int | None:
        """Undelivered entries at which a request stops being scheduled (None: no limit)."""
        return self.scheduler.entry_limit

    @entry_limit.setter
    def entry_limit(self, limit: int | None) -> None:
        self.scheduler.entry_limit = limit

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


__all__ = ["AdmissionError", "ContextError", "Engine", "Result"]
