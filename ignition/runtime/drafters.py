"""Drafters for speculative decoding: who proposes the S tokens a ``verify.s{S}`` round checks.

Both drafters propose deterministically (the n-gram continuation; the draft core's greedy tokens),
so the target's rejection rule needs no draft probabilities (components/speculative.py), and no
draft probability ever reaches reporting. ``parse_speculative`` reads the CLI/server option; ``mtp:S`` (a
checkpoint's multi-token-prediction layers as the draft) parses and is refused at load (``MTP_REFUSAL``): a core
carries no MTP draft graph family (the layers' forward and greedy draft are the deepseek_v4 recipe's reference,
``recipes/deepseek_v4_mtp.py``).

* ``NgramDrafter`` (prompt lookup): the longest suffix of the request's tokens (``max_ngram``
  down to ``min_ngram`` tokens) that occurred earlier; the tokens after its latest earlier
  occurrence are the proposal.
* ``DraftCoreDrafter``: another core with the same tokenizer, exported by the same recipes,
  proposes with its own prefill and decode variants, greedily, in its own KV slots. Cache cells a
  previous proposal wrote stay valid as long as the request's tokens agree with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ignition.catalog.cache_kinds import CACHE_KINDS
from ignition.catalog.enums import Operation
from ignition.runtime.bindings import ChunkPlan, Lane
from ignition.runtime.requests import Request, RequestState, SamplingParams
from ignition.runtime.runner import FreeSlots, OwnershipError, Runner, smallest_fitting


class SpeculativeError(ValueError):
    """A --speculative option or draft core that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Speculation:
    """What ``--speculative`` asked for: a drafter kind, its draft core (``draft`` only) and S."""

    kind: str  # "ngram" | "draft" | "mtp"
    draft_tokens: int
    draft_core: Path | None = None


MTP_REFUSAL = ("--speculative mtp:{S}: core {core} has no multi-token-prediction draft graphs, and no recipe exports "
               "them (the deepseek_v4 recipe reads a checkpoint's MTP layers into its reference draft only, "
               "recipes/deepseek_v4_mtp.py); use ngram:{S} or draft:CORE:{S}")
"""Why ``mtp:S`` cannot run: the draft graph family and the target's hidden streams it would read are not in cores."""


def parse_speculative(text: str) -> Speculation:
    """``ngram:S``, ``mtp:S`` or ``draft:CORE:S`` (CORE may itself contain ':')."""
    kind, _, rest = text.partition(":")
    core, _, count = rest.rpartition(":")
    usage = f"--speculative {text!r}: expected ngram:S, mtp:S or draft:CORE:S with S a positive integer"
    if kind not in ("ngram", "draft", "mtp") or not count.isdigit() or int(count) < 1:
        raise SpeculativeError(usage)
    if (kind == "draft") == (core == ""):
        raise SpeculativeError(usage)
    return Speculation(kind, int(count), Path(core) if core else None)


def engine_options(speculation: Speculation | None, target_core, load_draft) -> dict:
    """Engine keyword arguments for ``speculation`` (``{}`` for none): the drafter and S.

    ``load_draft(path)`` loads a draft core (the caller's device and trust options). The target core must
    have verify variants for S (checked here, so a bad option fails before any request runs).
    """
    if speculation is None:
        return {}
    if speculation.kind == "mtp":
        raise SpeculativeError(MTP_REFUSAL.format(S=speculation.draft_tokens, core=target_core.path))
    try:
        select_verify_variants(target_core, speculation.draft_tokens)
    except ValueError as exc:
        raise SpeculativeError(str(exc)) from None
    if speculation.kind == "ngram":
        drafter = NgramDrafter()
    elif speculation.draft_core.resolve() == Path(target_core.path).resolve() and target_core.capture is None:
        drafter = DraftCoreDrafter(target_core.replica(), target_core)  # the target drafts for itself: no reload
    else:
        drafter = DraftCoreDrafter(load_draft(speculation.draft_core), target_core)
    return {"drafter": drafter, "draft_tokens": speculation.draft_tokens}


def select_verify_variants(core, draft_tokens: int) -> list:
    """The ``verify.s{S}`` family with the smallest S >= ``draft_tokens``, by capacity; ValueError if none."""
    families: dict[int, list] = {}
    for variant in core.by_operation(Operation.SPECULATIVE_VERIFY):
        families.setdefault(variant.layout["speculative"]["draft_tokens"], []).append(variant)
    fitting = sorted(s for s in families if s >= draft_tokens)
    if draft_tokens < 1 or not fitting:
        raise ValueError(f"core {core.path} has no verify variants for {draft_tokens} draft tokens "
                         f"(it has S = {sorted(families) or 'none'}); export it with --speculative-tokens {draft_tokens}")
    return families[fitting[0]]


class Proposer:
    """The engine's drafter: asks it for each decoding request's proposal, to be checked by ``verify_variants``
    (the core's ``verify.s{S}`` family with the smallest S >= ``draft_tokens``; ``for_core`` selects it)."""

    def __init__(self, drafter, draft_tokens: int, verify_variants: list):
        self.drafter, self.draft_tokens, self.verify_variants = drafter, draft_tokens, verify_variants

    @classmethod
    def for_core(cls, core, drafter, draft_tokens: int) -> "Proposer":
        return cls(drafter, draft_tokens, select_verify_variants(core, draft_tokens))

    def propose(self, decoding: list[RequestState], constrained) -> list[list[int]]:
        """Each decoding request's proposal (maybe empty).

        The rule: a round is a speculative ``verify`` round when at least one lane has a proposal, else an
        ordinary decode round. A proposal never reaches past the request's token budget or a forced token
        (a forced token is emitted alone at position 0 of its own round), so every drafted position can be
        emitted; a lane without a proposal emits exactly what a decode round would. A request for which
        ``constrained(state)`` holds gets no proposal (the scheduler decodes it in an ordinary round).
        """
        asks = []
        for state in decoding:
            generated = len(state.generated)
            limit = min(self.draft_tokens, state.request.max_tokens - generated - 1)
            forced = [index - generated for index in state.request.forced_tokens if index >= generated]
            if forced:
                limit = min(limit, min(forced) - 1)
            if constrained(state):
                limit = 0
            asks.append((state.request_id, state.request.prompt_ids + state.generated, max(limit, 0)))
        return self.drafter.propose(asks)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the tokens' longest recurring suffix."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each ``(request_id, tokens, limit)``: up to ``limit`` proposed tokens (maybe none)."""
        return [self.lookup(tokens, limit) for _, tokens, limit in requests]

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        if limit < 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            suffix = ids[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # starts 0 .. len-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest earlier occurrence
                return [int(t) for t in ids[start:start + limit]]
        return []

    def release(self, request_id: str) -> None:
        """Nothing is held per request."""


class DraftCoreDrafter:
    """Greedy proposals from a second, smaller core of the same tokenizer (its own slots and KV state)."""

    def __init__(self, draft_core, target_core):
        check_draft_core(draft_core, target_core)
        self.core = draft_core
        self.decode_variants = draft_core.by_operation(Operation.DECODE)
        self.prefill = draft_core.by_operation(Operation.PREFILL)[-1]
        self.chunk = next(a.shape[0] for a in self.prefill.arguments if a.name == "chunk_input_ids")
        model = draft_core.spec.model
        self.num_slots = model.num_slots if model.num_slots is not None else self.decode_variants[-1].capacity
        self.max_context = model.max_seq_len
        self.free_slots = FreeSlots(self.num_slots)
        self.epochs = [0] * self.num_slots
        self.states: dict[str, RequestState] = {}  # each request's lane in the draft core
        self.cached: dict[str, list[int]] = {}  # tokens whose cache cells the draft core holds, in order
        self.runner = Runner(draft_core)

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_slots.give(state.slot)
            del self.cached[request_id]

    def _state(self, request_id: str) -> RequestState | None:
        state = self.states.get(request_id)
        if state is None and self.free_slots:  # no free draft slot: this request is not drafted this round
            slot = self.free_slots.take()
            self.epochs[slot] += 1
            state = RequestState(Request([0]), request_id, slot, self.epochs[slot])
            self.states[request_id], self.cached[request_id] = state, []
        return state

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Greedy continuations: each request's missing context is prefilled (its last chunk emits the
        first proposal), then decode rounds over all drafted requests extend every proposal to its limit."""
        proposals: list[list[int]] = [[] for _ in requests]
        drafting: list[tuple[int, RequestState, int]] = []
        for index, (request_id, tokens, limit) in enumerate(requests):
            if self.max_context is not None:
                limit = min(limit, self.max_context - len(tokens))
            state = self._state(request_id) if limit > 0 else None
            if state is None:
                continue
            state.request = Request(list(tokens), max_tokens=limit, sampling=SamplingParams(), ignore_eos=True)
            state.generated = []
            valid = _common_prefix(self.cached[request_id], tokens[:-1])
            if len(tokens) - valid > 1:  # more than the last token is missing: prefill chunks
                self._prefill(state, tokens, valid)
            else:
                self.cached[request_id] = self.cached[request_id][:valid]
            drafting.append((index, state, limit))
        while True:
            lanes = [Lane(state=s) for _, s, limit in drafting if len(s.generated) < limit]
            if not lanes:
                break
            largest = self.decode_variants[-1].capacity
            for start in range(0, len(lanes), largest):
                batch = lanes[start:start + largest]
                variant = smallest_fitting(self.decode_variants, batch)
                for lane in batch:  # the decode consumes the last known token at its position
                    self.cached[lane.state.request_id].append(_last_token(lane.state))
                self._run(variant, batch)
        for index, state, _ in drafting:
            proposals[index] = list(state.generated)
        return proposals

    def _prefill(self, state: RequestState, tokens: list[int], valid: int) -> None:
        start = valid
        while start < len(tokens):
            length = min(self.chunk, len(tokens) - start)
            last = start + length == len(tokens)
            self._run(self.prefill, [Lane(state=state, chunk=ChunkPlan(start, tokens[start:start + length], last))])
            start += length
        self.cached[state.request_id] = list(tokens)

    def _run(self, variant, lanes: list[Lane]) -> None:
        submission = self.runner.submit(variant, lanes)
        for index, lane in enumerate(lanes):
            try:
                record = submission.record(index)
            except OwnershipError as exc:
                raise SpeculativeError(f"draft core {self.core.path}: {exc}") from None
            lane.state.generated += record.emitted


def _last_token(state: RequestState) -> int:
    return state.generated[-1] if state.generated else state.request.prompt_ids[-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def check_draft_core(draft_core, target_core) -> None:
    """A draft core must share the target's vocabulary and tokenizer and have the variants it proposes with."""
    draft, target = draft_core.manifest, target_core.manifest
    if draft["vocab_size"] != target["vocab_size"]:
        raise SpeculativeError(f"draft core {draft_core.path}: vocab_size {draft['vocab_size']} differs from the "
                               f"target's {target['vocab_size']}; a draft core needs the target's tokenizer")
    tokenizer = "tokenizer/tokenizer.json"
    if draft["files"].get(tokenizer) != target["files"].get(tokenizer):
        raise SpeculativeError(f"draft core {draft_core.path}: its tokenizer differs from the target's "
                               f"({tokenizer} sha256 {draft['files'].get(tokenizer)} vs {target['files'].get(tokenizer)})")
    summarised = sorted({kind for kind in draft["model"].get("layer_kinds", ())
                         if kind in CACHE_KINDS and not CACHE_KINDS[kind].rewinds})
    if summarised:
        raise SpeculativeError(f"draft core {draft_core.path}: its {', '.join(summarised)} layers keep a state that "
                               f"summarises the whole context and cannot rewind to the prefix a new context shares; "
                               f"use a draft core of full or sliding attention layers, or ngram:S")
    if not draft_core.by_operation(Operation.DECODE) or not draft_core.by_operation(Operation.PREFILL):
        raise SpeculativeError(f"draft core {draft_core.path}: needs PREFILL and DECODE variants to propose")
