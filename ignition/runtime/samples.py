"""Sample groups: a request for ``n`` samples of one prompt, whose prompt is prefilled once.

A group's samples are ordinary requests (``Request`` with ``n == 1``), one per slot, admitted
together: the group waits at the head of the queue until it has a free slot for every sample
(``SampleGroups.admit``), so no sample ever waits for a slot whose prompt state must come from
a sibling that may already be gone. The first sample (the *leader*) prefills the prompt as any
request does, scored prefill and its emitted first token included. Right after the submission that
completes the prompt, ``PromptCopier`` copies the prompt-token counts of ``penalty_counts`` from the
leader's slot into each sibling's slot (its emitted-token counts start at zero). Each sibling then decodes its first
token from the last prompt position: its first decode lane has input token ``prompt[-1]`` at
position ``L - 1``, generated count 0, so the lane recomputes that cell in its own slot and samples
with RNG offset 0, exactly where an ``n = 1`` request's emitting prefill samples. The samples share the leader's
full prompt blocks of the paged KV pool by reference, and only the block holding position ``L - 1`` is copied
(``BlockManager.fork``).

Seeds follow vLLM v1 (``ParentRequest._get_child_sampling_params``, vllm/v1/engine/parallel_sampling.py):
sample ``i`` of a seeded request gets ``seed + i`` (wrapped into int64), so sample ``i`` reproduces an
``n = 1`` request with that seed; an unseeded sample draws from its own request id. Sample ids are
vLLM's child ids, ``f"{index}_{request_id}"``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from ignition.catalog.geometry import OUTPUT_PLANE, PAGED_STATE, PENALTY_COUNTS, PROMPT_PLANE, STATE_SHAPES
from ignition.runtime.requests import AdmissionError, RequestState

_INT64 = 1 << 64


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a group's samples, in index order (vLLM's child request ids)."""
    return [f"{index}_{request_id}" for index in range(n)]


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed: ``seed + index`` wrapped into int64 (vLLM v1), None for an unseeded request."""
    if seed is None:
        return None
    return (seed + index + (1 << 63)) % _INT64 - (1 << 63)


def sample_requests(request, request_id: str) -> list:
    """One ``n = 1`` request per sample, each with its own id and seed."""
    return [dataclasses.replace(request, n=1, request_id=sample_id,
                                sampling=dataclasses.replace(request.sampling,
                                                             seed=sample_seed(request.sampling.seed, index)),
                                constraints=request.constraints and request.constraints.fork())  # own grammar state
            for index, sample_id in enumerate(sample_ids(request_id, request.n))]


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The samples of one request, in index order; ``admitted`` once every one holds a slot."""

    group_id: str
    members: list = field(default_factory=list)  # RequestState, sample 0 first
    admitted: bool = False


class PromptCopier:
    """Copies a prompt's state rows from one slot to another, between submissions (plain tensor copies on the
    core's device, in stream order with the replays).

    ``shared`` is False where the copy cannot be made and each sample then prefills its own prompt: a state
    tensor that is neither a pool of blocks (``catalog.geometry.PAGED_STATE``, whose blocks the samples share,
    ``BlockManager.fork``) nor ``penalty_counts`` (a per-slot ring or recurrent state),
    or a tensor-parallel core (each rank holds its own state shard and replays only broadcast submissions,
    ignition/runtime/parallel/group.py).
    """

    def __init__(self, core):
        self.state: dict[str, torch.Tensor] = core.state
        layouts = {name: STATE_SHAPES.get(name) for name in self.state}
        self.shared = core.group is None and all(
            layout is not None and (name in PAGED_STATE or name == PENALTY_COUNTS)
            for name, layout in layouts.items())

    def copy(self, source: int, target: int, length: int) -> None:
        """Make slot ``target`` hold what slot ``source`` holds for prompt positions ``[0, length)``: the prompt
        plane of ``penalty_counts`` (the pools' blocks are shared, not copied)."""
        counts = self.state.get(PENALTY_COUNTS)  # [num_slots, planes, vocab]; none in a stateless (toy) core
        if counts is not None:
            counts[target, PROMPT_PLANE].copy_(counts[source, PROMPT_PLANE])
            counts[target, OUTPUT_PLANE].zero_()


class SampleGroups:
    """The engine's ``n > 1`` requests, by id, until every sample finished: admitted together, the prompt prefilled
    by the first sample (the leader) and copied into the others' slots."""

    def __init__(self, core, num_slots: int, stats: dict, blocks=None):
        self.num_slots, self.stats = num_slots, stats
        self.blocks = blocks  # BlockManager of a paged core (None: slots alone)
        self.by_id: dict[str, SampleGroup] = {}
        self.copier = PromptCopier(core)

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, request, group_id: str) -> list[RequestState]:
        """The states of a new group's samples, sample 0 first (AdmissionError before anything is kept)."""
        if request.n > self.num_slots:
            raise AdmissionError(f"n = {request.n} samples of one prompt decode together, one slot each, and this "
                                 f"core has {self.num_slots} slots", "n")
        if group_id in self.by_id:
            raise AdmissionError(f"request id {group_id!r} is already running", "request_id")
        group = SampleGroup(group_id)
        group.members = [RequestState(sample, sample.request_id, group=group)
                         for sample in sample_requests(request, group_id)]
        self.by_id[group_id] = group
        return group.members

    def samples(self, request_id: str) -> list[str]:
        """The ids of a request's samples, in index order, while any runs: a group's, else the request's own id."""
        group = self.by_id.get(request_id)
        return [member.request_id for member in group.members] if group is not None else [request_id]

    def admit(self, waiting, free_slots: int, take_slot) -> bool:
        """Give each of the group at the head of ``waiting`` a slot (``take_slot``), all at once (False, nothing
        taken, while fewer than its samples are ``free_slots`` or, on a paged core, its blocks are not free). The
        first prefills the prompt; the others wait for its state (``share_prompt``)."""
        group = waiting[0].group
        members = list(itertools.takewhile(lambda state: state.group is group, waiting))
        if len(members) > free_slots:
            return False
        if self.blocks is not None:  # a sharing sample needs the one block it copies; another, its own context's
            each = 1 if self.copier.shared else self.blocks.blocks_for(len(members[0].context()))
            if not self.blocks.can_allocate(members[0], each * (len(members) - 1)):
                return False
        if self.copier.shared:
            for state in members[1:]:
                state.prompt_source = members[0]
        for state in members:
            waiting.popleft()
            take_slot(state)
        group.admitted = True
        return True

    def share_prompt(self, leader: RequestState, finish) -> None:
        """Once ``leader``'s prompt is in its slot (right after the submission that completed it, before any
        other), copy its prompt state into the slots of the samples waiting for it; they decode from there. A sample
        that cannot decode ends through ``finish(state, reason, error)``."""
        waiting = [s for s in leader.group.members if s.prompt_source is leader] if leader.group else []
        prompt = leader.request.prompt_ids
        if not waiting or (leader.error is None and leader.prefilled < len(prompt)):
            return
        for state in waiting:
            state.prompt_source = None
            if leader.error is not None:  # the prompt failed: so does every sample that shares it
                finish(state, "error", leader.error)
                continue
            state.prompt_entries = list(leader.prompt_entries)  # prompt scores are computed once, reported by all
            if state.request.max_tokens == 0:
                finish(state, "length")
                continue
            if self.blocks is not None and not self.blocks.fork(leader, state, len(prompt)):
                continue  # no block free for the copy: this sample prefills the prompt itself
            self.copier.copy(leader.slot, state.slot, len(prompt))
            state.prefilled = len(prompt)  # the first decode lane recomputes position L - 1 in its own slot
            self.stats["prompt_copies"] += 1

    @staticmethod
    def hand_over(state: RequestState) -> None:
        """``state`` leaves before its prompt state was shared: the first sample waiting for it prefills the
        prompt in its own slot instead, for the others."""
        waiting = [s for s in state.group.members if s.prompt_source is state] if state.group else []
        if waiting:
            waiting[0].prompt_source = None
            for other in waiting[1:]:
                other.prompt_source = waiting[0]

    def forget(self) -> None:
        """Drop the groups whose samples all finished."""
        for group_id in [g for g, group in self.by_id.items() if all(s.done for s in group.members)]:
            del self.by_id[group_id]


__all__ = ["SampleGroup", "SampleGroups", "PromptCopier", "sample_ids", "sample_seed", "sample_requests"]
