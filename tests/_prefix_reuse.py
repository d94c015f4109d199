"""Prefix reuse against a cold run, shared by tests/test_prefix_caching.py (a paged Qwen3 core) and
tests/test_state_snapshots.py (a Qwen3.5 core whose linear-attention states resume from snapshots).

Both export with blocks of ``BLOCK`` positions and compare every cached run with the same core's results without
prefix caching: the tokens and alternatives equal, logprobs within ``TOLERANCE``, prompt logprobs identical.
"""

from __future__ import annotations

import math

from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.options import LoadOptions
from ignition.runtime.requests import Request

BLOCK = 8
SHARED = [(5 * j + 3) % 280 + 1 for j in range(37)]  # 4 full blocks and 5 tokens
TOLERANCE = 2e-5
"""FP32: a cached block's keys come from another chunk split than a cold prefill's, and a re-prefilled generated
token takes the chunked delta rule where its decode took the recurrent one (Qwen3.5's linear layers)."""


def budgeted(core_dir, core, blocks: int, host_blocks: int = 0):
    """The core loaded with a pool of ``blocks`` device blocks (block 0 included) and ``host_blocks`` host blocks."""
    per_block = core.kv_pool.bytes_per_block
    return load_core(core_dir, LoadOptions.create("cpu", kv_cache_memory=blocks * per_block,
                                                  kv_host_memory=host_blocks * per_block))


def request(prompt, max_tokens: int, **fields) -> Request:
    """Greedy, 2 alternatives a token, past any EOS."""
    return Request(list(prompt), max_tokens=max_tokens, logprobs=2, ignore_eos=True, **fields)


def assert_same(results, expected) -> None:
    for got, want in zip(results, expected, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
        for a, b in zip(got.entries, want.entries, strict=True):
            assert a.id == b.id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert math.isclose(a.logprob, b.logprob, abs_tol=TOLERANCE)
        if want.prompt_entries is not None:  # scored requests compute their whole prompt: the same words
            assert got.prompt_entries == want.prompt_entries


def one_by_one(engine: Engine, requests: list[Request]):
    """Each request alone, in order; after each, every state snapshot's block (a core with per-slot states) is still
    cached, on the device or the host."""
    results = []
    for r in requests:
        results.append(engine.generate([r])[0])
        blocks = engine.scheduler.blocks
        if blocks.states is not None:
            assert set(blocks.states.entries) <= set(blocks.cached) | set(blocks.host_cached)
    return results
