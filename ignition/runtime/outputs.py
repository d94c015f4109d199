"""Interpret: a submitted round's records become lane updates and finished requests.

For each lane, the record is checked against the lane's slot and epoch (``Submission.record``), its emitted tokens
become entries (their logprob payload decoded where the request asked for it), and the request ends where the
contract says: a ``stop_token_ids`` token or a terminating EOS (no entry; the token is kept as the state's
``stop_token`` so that a server counts it as vLLM does), its grammar complete or refusing a token, its budget spent,
or an error in its own record or payload (which fails that request only). A scored prefill's prompt rows are
published in order; a prompt chunk's lane moves its request's prefilled position, and a sample group's leader
shares its prompt state once it is complete. Nobody above the runtime decodes a frame record.
"""

from __future__ import annotations

from dataclasses import dataclass

from ignition.catalog.abi import TokenEntry, has_payload
from ignition.catalog.enums import FinishReason, Operation
from ignition.runtime.bindings import Lane
from ignition.runtime.requests import RequestState
from ignition.runtime.runner import OwnershipError, Submission


@dataclass(slots=True)
class Result:
    """A finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    entries: list[TokenEntry]
    finish_reason: str
    error: str | None
    prompt_entries: list[dict | None] | None = None

    @classmethod
    def of(cls, state: RequestState) -> "Result":
        return cls(state.request_id, list(state.request.prompt_ids), list(state.generated), list(state.entries),
                   state.finish_reason, state.error,
                   state.prompt_entries if state.request.prompt_logprobs is not None else None)


class OutputProcessor:
    """Applies submitted rounds to the scheduler's request states (``scheduler.finish`` ends a request)."""

    def __init__(self, scheduler, stats: dict):
        self.scheduler, self.stats = scheduler, stats
        self.constraints = scheduler.constraints

    def interpret(self, submission: Submission) -> None:
        """Every lane of one submission whose records (and payload, and prompt rows) are on the host."""
        lanes = submission.lanes
        if submission.variant.operation is Operation.SCORED_PREFILL:
            try:
                self._publish_prompt_rows(submission)
            except ValueError as exc:
                self.scheduler.finish(lanes[0].state, "error", str(exc))
                return
        self.stats["verify_rounds"] += submission.variant.operation is Operation.SPECULATIVE_VERIFY
        for index, lane in enumerate(lanes):
            self._decode_lane(submission, index, lane)

    def complete_chunks(self, lanes: list[Lane]) -> None:
        """After a round (submitted whole or less a lane that failed): each prompt chunk's request has its context
        up to the chunk's end in its slot; one whose prompt is complete and that may generate nothing ends
        "length"; a group's leader then shares its prompt state (or its failure) with the samples waiting for it."""
        for lane in lanes:
            if lane.chunk is None:
                continue
            state, end = lane.state, lane.chunk.start + len(lane.chunk.tokens)
            last = end == len(state.context())  # a chunk that emits nothing left the context as it was
            state.prefilled = max(state.prefilled, end)
            if last and not lane.chunk.emits and not state.generated and not state.done:
                self.scheduler.finish(state, "length")
            self.scheduler.groups.share_prompt(state, self.scheduler.finish)

    def _decode_lane(self, submission: Submission, index: int, lane: Lane) -> None:
        state, request = lane.state, lane.state.request
        if lane.retire:  # a cancelled request's lane: records only; its slot is free once the record is read
            self.scheduler.release_retiring([state])
            return
        # The graph already gates the reduction on slot, epoch and emission (components/commit.py); the runner's
        # check asserts the same facts and fails only this request if a record is stale or foreign.
        try:
            record = submission.record(index)
        except OwnershipError as exc:
            self.scheduler.finish(state, "error", str(exc))
            return
        if lane.chunk is not None and not lane.chunk.emits:
            return  # ADMISSION or PROMPT: positions come from record emission (none here), never from payload
        self.stats["proposed"] += len(lane.draft)
        self.stats["accepted"] += min(len(lane.draft), max(len(record.emitted) - 1, 0))
        last = len(record.emitted) - 1
        for position, token in enumerate(record.emitted):
            if record.forced[position]:
                entry = TokenEntry(token, None, forced=True)
            elif request.wants_logprobs and not has_payload(record, position, submission.requested(index)):
                self.scheduler.finish(state, "error", f"missing logprob payload for lane {index} position {position}")
                return
            elif request.wants_logprobs:
                try:
                    entry = submission.entry(index, position, token, request.logprobs,
                                             len(request.logprob_token_ids or ()))
                except ValueError as exc:
                    self.scheduler.finish(state, "error", str(exc))
                    return  # an error suppresses this request's later tokens in the frame
            else:
                entry = TokenEntry(token, None)
            eos = record.finish_reason is FinishReason.EOS and position == last
            if eos or token in request.stop_token_ids:  # a terminating EOS or a token-id stop has no entry
                state.stop_token, state.stop_by_eos = token, eos
                self.scheduler.finish(state, "stop")
                return
            state.generated.append(token)
            state.entries.append(entry)
            ended = self.constraints.advance(state, token)
            if ended is not None:
                self.scheduler.finish(state, *ended)
                return
        state.prefilled = record.sequence_length  # the KV now holds everything before the newest token
        if record.finish_reason is FinishReason.LENGTH or len(state.generated) >= request.max_tokens:
            self.scheduler.finish(state, "length")
        else:
            self.constraints.prefetch(state)  # the next row fills while the other lanes and the next round are prepared

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


__all__ = ["OutputProcessor", "Result"]
