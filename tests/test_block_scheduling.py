"""Admission by free blocks and preemption when they run out, on the toy core.

The toy core keeps its KV per slot, so a block manager laid over it (prefix caching off) changes only which
requests run when: with a pool too small for every request at once, requests wait for blocks, running ones are
preempted and readmitted, and every request still gets exactly the tokens, logprobs and prompt logprobs it gets
with blocks to spare (the readmission rules of ``Scheduler.preempt``)."""

from __future__ import annotations

import pytest

from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.block_manager import BlockManager
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request, SamplingParams


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """A toy core that scores prompts, with 4 slots and prompt chunks of 8 rows."""
    out = tmp_path_factory.mktemp("blocks") / "toy"
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), chunk_limit=8, prompt_logprobs=True), out)
    return load_core(out)


def engine_with_blocks(core, monkeypatch, num_blocks: int, block_size: int = 4) -> Engine:
    monkeypatch.setattr("ignition.runtime.scheduler.block_manager_for",
                        lambda core, prefix_caching, *sizes: BlockManager(num_blocks, block_size, prefix_caching=False))
    return Engine(core)


def requests() -> list[Request]:
    return [Request([1 + i, 2, 3 + i, 4, 5], max_tokens=12, logprobs=2, prompt_logprobs=1 if i % 2 else None)
            for i in range(5)]


def outcome(results):
    return [(r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries], r.prompt_entries, r.finish_reason)
            for r in results]


def test_a_pool_too_small_for_all_requests_preempts_and_readmits_exactly(core, monkeypatch):
    expected = outcome(Engine(core).generate(requests()))
    roomy = engine_with_blocks(core, monkeypatch, 64)
    assert outcome(roomy.generate(requests())) == expected and roomy.stats["preemptions"] == 0
    tight = engine_with_blocks(core, monkeypatch, 9)  # 8 blocks of 4: one request needs 5 at its end
    admitted = []
    tight.decode_hook = lambda variant, reader, pending: admitted.append(len(tight.running))
    assert outcome(tight.generate(requests())) == expected
    assert tight.stats["preemptions"] > 0
    blocks = tight.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.usage() == 0.0  # every block came back
    assert all(block.ref_count == 0 for block in blocks.blocks)
    assert max(admitted) < len(requests())  # never all at once: admission waited for blocks


def test_admission_waits_for_blocks_not_only_slots(core, monkeypatch):
    engine = engine_with_blocks(core, monkeypatch, 4)  # 3 blocks of 4
    first = engine.submit(Request([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2))  # 3 blocks for its context
    second = engine.submit(Request([9, 8], max_tokens=2))
    engine.step()
    assert [s.request_id for s in engine.running] == [first] and [s.request_id for s in engine.waiting] == [second]
    assert len(engine.state(first).block_table) == 3
    engine.run()
    assert engine.result(first).finish_reason == engine.result(second).finish_reason == "length"


def test_the_kv_capacity_bounds_the_context(core, monkeypatch):
    engine = engine_with_blocks(core, monkeypatch, 5)  # 16 tokens
    assert engine.max_context == 16 and engine.kv_capacity_tokens == 16
    with pytest.raises(ValueError, match="exceeds the KV cache's capacity|exceeds the core's context of 16"):
        engine.check(Request([1] * 10, max_tokens=7))
    monkeypatch.setattr("ignition.runtime.scheduler.block_manager_for",
                        lambda core, prefix_caching, *sizes: BlockManager(5, 4, prefix_caching=False))
    with pytest.raises(ValueError, match=r"max_context 17 exceeds the core's context of 16 tokens \(the KV cache's "
                                         r"capacity: 4 blocks of 4\)"):
        Engine(core, max_context=17)


def test_samples_share_the_leaders_blocks(core, monkeypatch):
    expected = outcome(Engine(core).generate([Request([5, 6, 7, 8, 9, 10], max_tokens=6, n=3, logprobs=1,
                                                      sampling=_seeded())]))
    engine = engine_with_blocks(core, monkeypatch, 32)
    copies = []
    engine.scheduler.blocks.pool = type("Pool", (), {"copy_blocks": lambda self, s, d: copies.append((s, d))})()
    results = engine.generate([Request([5, 6, 7, 8, 9, 10], max_tokens=6, n=3, logprobs=1, sampling=_seeded())])
    assert outcome(results) == expected
    assert len(copies) == 2 and engine.stats["prompt_copies"] == 2  # one block copied per sharing sample


def _seeded():
    return SamplingParams(temperature=0.8, seed=11)
