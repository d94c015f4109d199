"""Prefix reuse on a linear-attention core: Qwen3.5's per-slot states resumed from snapshots at block boundaries.

A tiny qwen3_5 checkpoint (examples/make_tiny_qwen3_5.py: three Gated DeltaNet layers, one full-attention layer) is
exported once, FP32, with blocks of 8 positions and 8-row prompt chunks, so every multiple of 8 is on the snapshot
grid. Every test compares against the same core with ``prefix_caching=False``: a request resumed from a snapshot,
one whose snapshot was evicted (a shorter hit or none), one whose blocks left the cache, and requests preempted from
a pool too small for all of them get the tokens, logprobs and prompt logprobs they get without the cache."""

from __future__ import annotations

import importlib.util
import logging
from functools import partial
from pathlib import Path

import pytest
import torch

from _prefix_reuse import BLOCK, SHARED, assert_same, budgeted, one_by_one
from _prefix_reuse import request as reuse_request
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.paging import prefix_reuse_refusal
from ignition.runtime.requests import Request, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen3_5.py"
CHUNK = BLOCK  # every chunk ends on the snapshot grid
request = partial(reuse_request, max_tokens=3)


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path_factory.mktemp("snapshots")
    module.make_checkpoint(root / "ckpt")
    export_core(ExportOptions(recipe="qwen3_5", checkpoint=root / "ckpt", capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=64, block_size=BLOCK, prompt_logprobs=True, packed_prefill=False),
                root / "core")  # packed chunks are a serial chunk's bit for bit (tests/test_qwen3_5.py)
    return root / "core"


@pytest.fixture(scope="module")
def core(core_dir):
    return load_core(core_dir, device="cpu")


@pytest.fixture(scope="module")
def per_snapshot(core) -> int:
    """Bytes of one slot's conv and recurrent state, from the core's own tensors."""
    return sum(core.state[name][:, 0].numel() * core.state[name].element_size()
               for name in ("conv_state", "recurrent_state"))


@pytest.fixture(scope="module")
def small(core_dir, core):
    """9 blocks: 64 positions for requests, one max_seq_len sequence."""
    return budgeted(core_dir, core, 9)


@pytest.fixture(scope="module")
def cold(core):
    """Each request's result alone without prefix caching (computed once a request)."""
    engine, results = Engine(core, prefix_caching=False), {}

    def run(requests: list[Request]):
        for r in requests:
            if repr(r) not in results:
                results[repr(r)] = engine.generate([r])[0]
        return [results[repr(r)] for r in requests]
    return run


def test_a_shared_prefix_resumes_the_linear_state_from_a_snapshot(core, cold, per_snapshot):
    penalised = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)  # the reseeded prompt counts matter
    requests = [request(SHARED), request(SHARED + [9, 10, 11]), request(SHARED[:20] + [42] * 9, sampling=penalised)]
    engine = Engine(core)
    assert_same(one_by_one(engine, requests), cold(requests))
    stats, states = engine.kv_cache_stats(), engine.scheduler.blocks.states
    assert stats["prefix_cache_queries"] == 37 + 40 + 29
    assert stats["prefix_cache_hits"] == 0 + 4 * BLOCK + 2 * BLOCK  # resumed at 32 and 16
    assert engine.stats["prompt_tokens_prefilled"] == 37 + (40 - 32) + (29 - 16)
    # the first's chunks end on the grid at 8, 16, 24 and 32 (not 37); the second's at 40; the third's at 24
    assert (states.taken, states.restored, len(states)) == (6, 2, 6)
    assert stats["state_snapshot_bytes"] == 6 * per_snapshot == 6 * states.bytes_per_snapshot


def test_batch_invariant_results_are_bit_identical(core):
    requests = [request(SHARED), request(SHARED + [9, 10, 11], prompt_logprobs=1), request(SHARED + [12])]
    cold = one_by_one(Engine(core, batch_invariant=True, prefix_caching=False), requests)
    engine = Engine(core, batch_invariant=True)
    warm = one_by_one(engine, requests)
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 4 * BLOCK  # the scored request never looks up
    for got, want in zip(warm, cold):
        assert got.token_ids == want.token_ids
        assert [(e.id, e.logprob, e.top) for e in got.entries] == [(e.id, e.logprob, e.top) for e in want.entries]
        assert got.prompt_entries == want.prompt_entries


def test_an_evicted_snapshot_falls_back_to_a_shorter_hit_or_a_prefill(core, cold, per_snapshot, caplog):
    requests = [request(SHARED), request(SHARED[:20] + [42] * 9), request(SHARED[:26] + [7] * 6)]
    engine = Engine(core, state_snapshot_memory=2 * per_snapshot + per_snapshot // 2)  # room for 2
    assert_same(one_by_one(engine, requests), cold(requests))
    # the first keeps 24 and 32: the second's 16 has its blocks but no snapshot, so it prefills from 0 (taking
    # 8, 16 and its own 24); the third's blocks reach 24, whose snapshot went: it resumes at 16
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 0 + 0 + 2 * BLOCK
    assert len(engine.scheduler.blocks.states) == 2
    assert prefix_reuse_refusal(core) is None
    assert prefix_reuse_refusal(core, per_snapshot - 1) == (
        f"--state-snapshot-memory {per_snapshot - 1} bytes holds no snapshot of its per-slot state (conv_state, "
        f"recurrent_state: {per_snapshot} bytes a snapshot)")
    with caplog.at_level(logging.INFO, logger="ignition.runtime"):
        none = Engine(core, state_snapshot_memory=per_snapshot - 1)
    assert "prefix caching is off" in caplog.text and not none.scheduler.blocks.prefix_caching
    assert none.scheduler.blocks.states is None


def test_snapshots_leave_with_their_blocks_and_come_back_from_the_host_tier(core_dir, core, cold, small):
    requests = [request(SHARED), request([(11 * j) % 280 + 2 for j in range(40)]), request(SHARED + [1])]
    # 8 usable blocks: the first leaves 4 cached; the second (6 blocks) evicts the last 2 (and their snapshots at 24
    # and 32), so the third resumes at 16
    evicting = Engine(small)
    assert_same(one_by_one(evicting, requests), cold(requests))
    assert evicting.kv_cache_stats()["prefix_cache_hits"] == 2 * BLOCK
    hosted = Engine(budgeted(core_dir, core, 9, host_blocks=8))  # the evicted blocks keep their snapshots
    assert_same(one_by_one(hosted, requests), cold(requests))
    assert hosted.scheduler.blocks.host_hits == 2 and hosted.kv_cache_stats()["prefix_cache_hits"] == 4 * BLOCK


def test_preemption_and_readmission_in_a_pool_too_small_for_all(core, cold, small):
    requests = [request(SHARED[:24 + 4 * i] + [i + 1], max_tokens=6, prompt_logprobs=1 if i == 1 else None)
                for i in range(3)]
    expected = cold(requests)
    engine = Engine(small)  # 64 tokens: no two of them at their longest (31 to 39 positions)
    assert_same(engine.generate(requests), expected)
    assert engine.stats["preemptions"] > 0
    blocks = engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks
    assert set(blocks.states.entries) <= set(blocks.cached)


def test_state_snapshot_memory_is_a_byte_count(core):
    for budget in (-1, 1.5, True):
        with pytest.raises(ValueError, match="state snapshot memory must be a byte count"):
            Engine(core, state_snapshot_memory=budget)


def test_a_restored_snapshot_is_the_slot_state_it_copied(core):
    from ignition.runtime.state_snapshots import StateSnapshots

    state = {name: torch.randn(core.state[name].shape).to(core.state[name].dtype)
             for name in ("conv_state", "recurrent_state")}
    store = StateSnapshots(state, 10 ** 9, BLOCK)
    kept = {name: tensor[:, 1].clone() for name, tensor in state.items()}
    store.take(b"h", 1)
    for tensor in state.values():
        tensor[:, 1].zero_()
    store.restore(b"h", 0)
    for name, tensor in state.items():
        assert torch.equal(tensor[:, 0], kept[name])
