"""Interpret (ignition/runtime/outputs.py): records become lane updates and finished requests, the token that stopped
each one included, so that the server reads stop reasons from request states and never from frame records."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import torch

from ignition.catalog.abi import RECORD_HEADER_WORDS, RecordField, decode_record
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.runtime.bindings import Lane
from ignition.runtime.constrained import Constraints
from ignition.runtime.frames import PendingFrame
from ignition.runtime.outputs import OutputProcessor
from ignition.runtime.requests import Request, RequestState
from ignition.runtime.runner import Submission
from ignition.serve.engine import AsyncEngine, RequestStream

EPOCH = 3


class Finishing:
    """The part of a Scheduler that interpreting a round calls: ``finish`` records how each request ended."""

    def __init__(self):
        self.constraints = Constraints(eos=None)
        self.ended: dict[str, tuple] = {}

    def finish(self, state, reason, error=None, param=None):
        state.finish_reason, state.error = reason, error
        self.ended[state.request_id] = (reason, error)


def speculative_round(rounds):
    """A submission of one verify round whose lane ``i`` emitted ``rounds[i] = (tokens, finish reason)``."""
    records = torch.zeros((len(rounds), RECORD_HEADER_WORDS + 5), dtype=torch.int64)
    for lane, (emitted, finish) in enumerate(rounds):
        records[lane, [RecordField.SLOT, RecordField.EPOCH, RecordField.ROUND_KIND, RecordField.EMITTED_COUNT,
                       RecordField.FINISH_REASON]] = torch.tensor([lane, EPOCH, RoundKind.SPECULATIVE, len(emitted),
                                                                   finish])
        records[lane, RECORD_HEADER_WORDS:RECORD_HEADER_WORDS + len(emitted)] = torch.tensor(emitted)
    states = [RequestState(Request([1], max_tokens=9, stop_token_ids=[9]), f"r{lane}", slot=lane, epoch=EPOCH,
                           generated=[2]) for lane in range(len(rounds))]
    reader = types.SimpleNamespace(record=lambda lane: decode_record(records[lane].numpy()))
    pending = PendingFrame(0, [(lane, EPOCH) for lane in range(len(rounds))], np.zeros(len(rounds), dtype=bool), 0)
    variant = types.SimpleNamespace(operation=Operation.SPECULATIVE_VERIFY)
    return Submission(variant, [Lane(state=s) for s in states], reader, pending), states


def test_a_multi_token_round_keeps_the_token_that_stopped_each_request():
    """A speculative round emits several tokens: those before a stop are appended, the stop itself has no entry
    and is kept as the request's ``stop_token`` (an EOS ends it ``stop_by_eos``; a ``stop_token_ids`` id does not)."""
    submission, states = speculative_round([((5, 6, 9, 7), FinishReason.NONE),  # stop id 9 mid-round: 7 never taken
                                            ((3, 4), FinishReason.EOS),  # the EOS ends the round
                                            ((8,), FinishReason.EOS),  # a first-position stop
                                            ((1, 2), FinishReason.LENGTH)])  # no stop token
    scheduler = Finishing()
    stats = {"verify_rounds": 0, "proposed": 0, "accepted": 0}
    OutputProcessor(scheduler, stats).interpret(submission)
    assert [s.generated for s in states] == [[2, 5, 6], [2, 3], [2], [2, 1, 2]]
    assert [[e.id for e in s.entries] for s in states] == [[5, 6], [3], [], [1, 2]]
    assert [(s.stop_token, s.stop_by_eos) for s in states] == [(9, False), (4, True), (8, True), (None, False)]
    assert [s.finish_reason for s in states] == ["stop", "stop", "stop", "length"]
    assert scheduler.ended == {s.request_id: (s.finish_reason, None) for s in states}
    assert stats["verify_rounds"] == 1


def test_serve_reads_the_stop_from_the_request_state():
    """The server's last delta carries the state's stop token: AsyncEngine delivers from request states alone."""
    submission, states = speculative_round([((5, 9), FinishReason.NONE), ((4,), FinishReason.EOS)])
    OutputProcessor(Finishing(), {"verify_rounds": 0, "proposed": 0, "accepted": 0}).interpret(submission)

    async def deliver():
        engine = AsyncEngine(types.SimpleNamespace(finished={state.request_id: state for state in states}))
        loop = asyncio.get_running_loop()
        streams = [RequestStream(state.request_id, loop, lambda: None, 4) for state in states]
        for stream, state in zip(streams, states):
            engine._tracked[state.request_id] = types.SimpleNamespace(stream=stream, state=state, prompt_sent=0)
        engine._deliver()
        return [await stream.get() for stream in streams], engine

    deltas, engine = asyncio.run(deliver())
    assert [(d.finish_reason, [e.id for e in d.entries], d.stop_token, d.stop_by_eos) for d in deltas] == \
        [("stop", [5], 9, False), ("stop", [], 4, True)]
    assert engine._tracked == {} and engine.engine.finished == {}
