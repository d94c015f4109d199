"""Prefix caching end to end on a paged tiny Qwen3 core (FP32, blocks of 8 positions).

Every test compares against the same core with ``prefix_caching=False``: a request whose prefix comes from the
cache (device or host tier), a salted one, a scored one beside cached ones, and requests preempted from a pool
too small for all of them get the tokens, logprobs and prompt logprobs they get without the cache. The small pools
are loads of the same core with ``kv_cache_memory`` and ``kv_host_memory`` budgets."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from _prefix_reuse import BLOCK, SHARED, assert_same, budgeted, one_by_one
from _prefix_reuse import request as reuse_request
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request

request = partial(reuse_request, max_tokens=6)


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory):
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("prefix")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 300), root / "ckpt", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=16,
                              max_seq_len=64, block_size=BLOCK, prompt_logprobs=True),
                root / "core")  # one request alone runs decode.c1; 2 to 4 lanes (n=3, preemption's 4) decode.c4
    return root / "core"


@pytest.fixture(scope="module")
def core(core_dir):
    return load_core(core_dir)


@pytest.fixture(scope="module")
def small(core_dir, core):
    """9 blocks: 64 positions for requests, one max_seq_len sequence."""
    return budgeted(core_dir, core, 9)


@pytest.fixture(scope="module")
def small_hosted(core_dir, core):
    return budgeted(core_dir, core, 9, host_blocks=8)


def test_a_shared_prefix_is_reused_and_gives_the_same_results(core):
    requests = [request(SHARED), request(SHARED + [9, 10, 11]), request(SHARED[:20] + [42] * 9)]
    cold = one_by_one(Engine(core, prefix_caching=False), requests)
    engine = Engine(core)
    warm = one_by_one(engine, requests)
    assert_same(warm, cold)
    stats = engine.kv_cache_stats()
    assert stats["prefix_cache_queries"] == 37 + 40 + 29
    # the second finds the first's 4 prompt blocks (and none of its generated ones: 37 + 5 positions, block 5 open)
    assert stats["prefix_cache_hits"] == 0 + 4 * BLOCK + 2 * BLOCK
    assert engine.stats["prompt_tokens_prefilled"] == 37 + (40 - 32) + (29 - 16)
    assert stats["kv_cache_usage_perc"] == 0.0  # nothing running: every block is free or cached


def test_the_whole_prompt_is_never_taken_from_the_cache(core):
    engine = Engine(core)
    prompt = SHARED[:32]  # exactly 4 blocks
    first, again = one_by_one(engine, [request(prompt), request(prompt)])
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 3 * BLOCK  # the last block is recomputed to sample
    assert_same([again], [first])


def test_cache_salt_isolates(core):
    engine = Engine(core)
    one_by_one(engine, [request(SHARED, cache_salt="a")])
    one_by_one(engine, [request(SHARED, cache_salt="b"), request(SHARED)])
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 0
    one_by_one(engine, [request(SHARED, cache_salt="a")])
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 4 * BLOCK


def test_prompt_logprobs_beside_cached_requests(core):
    scored = request(SHARED + [7, 8], prompt_logprobs=2)
    cold = one_by_one(Engine(core, prefix_caching=False), [scored])
    engine = Engine(core)
    results = one_by_one(engine, [request(SHARED), scored, request(SHARED + [7, 8])])
    assert engine.kv_cache_stats()["prefix_cache_queries"] == 37 + 39  # the scored request never looks up
    assert results[1].prompt_entries == cold[0].prompt_entries  # bit-identical: it computed its whole prompt
    assert_same(results[1:2], cold)


def test_eviction_and_the_host_tier_round_trip(core, small, small_hosted):
    requests = [request(SHARED), request([(11 * j) % 280 + 2 for j in range(40)]), request(SHARED + [1])]
    cold = one_by_one(Engine(core, prefix_caching=False), requests)
    # 8 usable blocks: the first request leaves 5 cached; the second takes the 3 free ones and evicts 3 of them,
    # its tail first (vLLM's order), so the third finds only the first 2 of its 4 blocks
    evicting = Engine(small)
    assert_same(one_by_one(evicting, requests), cold)
    assert evicting.kv_cache_stats()["prefix_cache_hits"] == 2 * BLOCK
    engine = Engine(small_hosted)  # the evicted 3 move to the host: 2 come back
    assert_same(one_by_one(engine, requests), cold)
    assert engine.scheduler.blocks.host_hits == 2 and engine.kv_cache_stats()["prefix_cache_hits"] == 4 * BLOCK


def test_preemption_and_readmission_in_a_pool_too_small_for_all(core, small):
    requests = [request(SHARED[:10 + 3 * i] + [i + 1], max_tokens=12, prompt_logprobs=1 if i == 2 else None)
                for i in range(4)]
    expected = Engine(core, prefix_caching=False).generate(requests)
    engine = Engine(small)  # 64 tokens: one request at a time at its longest
    assert small.kv_pool.num_blocks == 9 and engine.kv_capacity_tokens == 64
    assert_same(engine.generate(requests), expected)
    assert engine.stats["preemptions"] > 0
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_samples_share_the_prompt_blocks(core):
    sampled = Request(SHARED, max_tokens=5, n=3, logprobs=1)
    expected = Engine(core, prefix_caching=False).generate([sampled])
    engine = Engine(core)
    assert_same(engine.generate([sampled]), expected)
    assert engine.stats["prompt_copies"] == 2


def test_batch_invariant_results_are_bit_identical(core):
    requests = [request(SHARED), request(SHARED + [9, 10, 11], prompt_logprobs=1), request(SHARED + [12])]
    cold = one_by_one(Engine(core, batch_invariant=True, prefix_caching=False), requests)
    engine = Engine(core, batch_invariant=True)
    warm = one_by_one(engine, requests)
    assert engine.kv_cache_stats()["prefix_cache_hits"] > 0
    for got, want in zip(warm, cold):
        assert got.token_ids == want.token_ids
        assert [(e.id, e.logprob, e.top) for e in got.entries] == [(e.id, e.logprob, e.top) for e in want.entries]
        assert got.prompt_entries == want.prompt_entries
