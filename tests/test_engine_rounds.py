"""Records-only rounds and bounded entries in the loader's engine.

Admission and maintenance rounds write records only; readers decide what is meaningful from
record emission, never from payload contents. A lagging reader bounds the entries a request
accumulates (the specification's bounded token and output queues).
"""

from __future__ import annotations

import asyncio

import pytest

from ignition.catalog.abi import RecordField
from ignition.catalog.enums import RoundKind
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from ignition.serve.engine import AsyncEngine


@pytest.fixture(scope="module")
def core(toy_core):
    return load_core(toy_core)


def recording(engine: Engine) -> list:
    """(variant name, lane records, request mask) of every submission."""
    seen = []
    engine.decode_hook = lambda variant, reader, pending: seen.append(
        (variant.name, [reader.record(i) for i in range(variant.lanes)], pending.request_mask.copy()))
    return seen


def test_admission_round_is_records_only(core):
    engine = Engine(core)
    seen = recording(engine)
    (result,) = engine.generate([Request([3, 4, 5], max_tokens=0, logprobs=2)])
    assert (result.token_ids, result.entries, result.finish_reason) == ([], [], "length")
    ((name, (record,), mask),) = seen
    assert name.startswith("prefill") and record.round_kind is RoundKind.ADMISSION and record.emitted == ()
    assert not mask.any() and engine.readers[name].payload_copies == 0


def test_reader_uses_record_emission_not_the_plan(core):
    """A records-only round whose record claims an emitted token fails its request: the host trusts records."""
    engine = Engine(core)

    def forge(variant, reader, pending):
        reader.records_host[0, RecordField.ROUND_KIND] = int(RoundKind.SAMPLING)
        reader.records_host[0, RecordField.EMITTED_COUNT] = 1
    engine.decode_hook = forge
    (result,) = engine.generate([Request([3, 4, 5], max_tokens=0)])
    assert result.finish_reason == "error" and "SAMPLING" in result.error and result.token_ids == []


def test_cancelled_lane_retires_through_a_maintenance_record(core):
    engine = Engine(core)
    seen = recording(engine)
    a, b = engine.submit(Request([1], max_tokens=50, logprobs=2)), engine.submit(Request([2], max_tokens=50, logprobs=2))
    while len(engine.state(a).generated) < 3 or len(engine.state(b).generated) < 3:
        engine.step()
    slot, epoch, tokens = engine.state(a).slot, engine.state(a).epoch, list(engine.state(a).generated)
    engine.cancel(a)
    assert engine.state(a).finish_reason == "abort" and slot not in engine.free_slots  # held until retired
    seen.clear()
    engine.step()
    ((name, records, mask),) = seen
    retired = next(r for r in records if r.slot == slot)
    assert (retired.epoch, retired.round_kind, retired.emitted) == (epoch, RoundKind.MAINTENANCE, ())
    assert [r.round_kind for r in records].count(RoundKind.SAMPLING) == 1 and mask.sum() == 1
    assert slot in engine.free_slots and engine.state(a).generated == tokens  # stale payload never decoded
    engine.run()
    assert engine.result(b).finish_reason == "length" and len(engine.result(b).token_ids) == 50


def test_cancel_with_nothing_else_running_frees_the_slot_without_a_round(core):
    engine = Engine(core)
    seen = recording(engine)
    rid = engine.submit(Request([1], max_tokens=50))
    while len(engine.state(rid).generated) < 2:
        engine.step()
    engine.cancel(rid)
    seen.clear()
    assert engine.step() is False and seen == [] and sorted(engine.free_slots) == list(range(engine.num_slots))


def test_lagging_reader_bounds_the_coalesced_entries(core):
    engine = Engine(core)
    (expected,) = Engine(core).generate([Request([9], max_tokens=20, logprobs=1)])
    engine.entry_limit = 3
    rid = engine.submit(Request([9], max_tokens=20, logprobs=1))
    delivered = []
    while True:
        while engine.step():
            assert len(engine.state(rid).entries) <= 3 + core.token_capacity - 1
        state = engine.state(rid)
        if state.done and not state.entries:
            break
        assert state.done or len(state.entries) == 3  # paused, not finished, slot held
        delivered += state.entries
        state.entries = []  # the reader drains
    assert [e.id for e in delivered] == expected.token_ids
    assert [e.logprob for e in delivered] == [e.logprob for e in expected.entries]


def test_async_engine_holds_at_most_entry_limit_for_a_slow_reader(core):
    async def run():
        engine = AsyncEngine(Engine(core), queue_capacity=1, entry_limit=4)
        engine.start()
        try:
            stream = await engine.submit(Request([9], max_tokens=40, request_id="slow"))
            state = engine._tracked["slow"].state
            for _ in range(50):  # nobody reads: the engine pauses the request instead of growing its entries
                await asyncio.sleep(0.01)
                assert len(state.entries) <= 4 + core.token_capacity - 1
            assert state.finish_reason is None and stream.queue.qsize() == 1
            received, finish = [], None
            while finish is None:
                delta = await stream.get()
                received += delta.entries
                finish = delta.finish_reason
            return received, finish
        finally:
            engine.stop()

    received, finish = asyncio.run(run())
    (expected,) = Engine(core).generate([Request([9], max_tokens=40)])
    assert (finish, [e.id for e in received]) == ("length", expected.token_ids)


def test_a_submission_whose_handler_left_before_admission_is_dropped(core):
    """The handler is cancelled while its submit command waits in the queue (a client that hung up): the engine
    thread must skip the request, not admit it and then fail to report it to a future that is already cancelled
    (which killed the engine thread)."""
    engine = AsyncEngine(Engine(core))  # not started: this thread plays the engine thread, so the order is fixed

    async def leave_while_queued():
        task = asyncio.ensure_future(engine.submit(Request([9], max_tokens=4, request_id="gone")))
        await asyncio.sleep(0)  # the submit command is queued and the handler awaits its admission
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_while_queued())
    engine._apply_commands()  # the submit, then the handler's cancel
    assert engine._tracked == {} and not engine.engine.waiting and not engine.engine.running
    assert engine.engine.free_slots and len(engine.engine.free_slots) == engine.engine.num_slots
    (result,) = engine.engine.generate([Request([9], max_tokens=2)])  # the engine still serves
    assert len(result.token_ids) == 2
