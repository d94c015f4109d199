"""The block manager alone: reference counts, the hash chain, prefix lookup, LRU eviction, the host tier, counters.

The pool here is a tensor per tier whose block ``b`` holds, at each position, a value naming the token written
there; a test checks that a cached, copied or restored block really holds its tokens."""

import hashlib
import pickle

import pytest
import torch

from ignition.runtime.block_manager import NULL_BLOCK, ROOT_HASH, BlockManager, hash_block
from ignition.runtime.requests import Request, RequestState

SIZE = 4


class TensorPool:
    """A paged cache of ``[blocks, SIZE]`` values and its host tier, with the KVPool block operations."""

    def __init__(self, num_blocks: int, host_blocks: int = 0):
        self.device = torch.full((num_blocks, SIZE), -1.0)
        self.host = torch.full((max(host_blocks, 1), SIZE), -1.0)
        self.calls = []

    def copy_blocks(self, src, dst):
        self.calls.append(("copy", list(src), list(dst)))
        self.device[dst] = self.device[src]

    def to_host(self, device, host):
        self.calls.append(("to_host", list(device), list(host)))
        self.host[host] = self.device[device]

    def from_host(self, host, device):
        self.calls.append(("from_host", list(host), list(device)))
        self.device[device] = self.host[host]


def make(prompt, salt=None, prompt_logprobs=None, rid="r"):
    return RequestState(Request(list(prompt), cache_salt=salt, prompt_logprobs=prompt_logprobs), rid)


def run_prefill(manager, pool, state):
    """Admit ``state`` and "compute" its context from where the cache ends: write each token into its position."""
    cached = manager.allocate(state)
    context = state.context()
    for position in range(cached, len(context)):
        pool.device[state.block_table[position // SIZE], position % SIZE] = context[position]
    state.prefilled = len(context)
    manager.cache(state, state.request.prompt_ids + state.generated)
    return cached


def held(pool, state, length):
    return [pool.device[state.block_table[p // SIZE], p % SIZE].item() for p in range(length)]


def test_hash_is_vllms_chain_rule():
    expected = hashlib.sha256(pickle.dumps((ROOT_HASH, (1, 2, 3, 4), ("salt",)), protocol=5)).digest()
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], ("salt",)) == expected
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != expected
    assert hash_block(expected, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [1, 2, 3, 4])


def test_allocate_and_free_with_reference_counts():
    manager = BlockManager(8, SIZE, prefix_caching=False)
    assert manager.num_blocks == 7 and manager.capacity_tokens == 28
    state = make(range(10))
    assert manager.allocate(state) == 0
    assert len(state.block_table) == 3 and NULL_BLOCK not in state.block_table
    assert manager.usage() == pytest.approx(3 / 7)
    manager.grow(state, 13)
    assert len(state.block_table) == 4
    assert not manager.may_grow(state, 4 * SIZE + 3 * SIZE + 1) and manager.may_grow(state, 7 * SIZE)
    manager.free(state)
    assert state.block_table == [] and manager.num_free == 7 and manager.usage() == 0.0
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_prefix_hit_is_block_aligned_and_never_the_whole_context():
    pool = TensorPool(16)
    manager = BlockManager(16, SIZE, prefix_caching=True, pool=pool)
    first = make(range(12), rid="a")
    assert run_prefill(manager, pool, first) == 0
    again = make(range(12), rid="b")  # the same 12 tokens: 2 blocks reused, the third recomputed
    assert run_prefill(manager, pool, again) == 8
    assert again.block_table[:2] == first.block_table[:2] and again.block_table[2] != first.block_table[2]
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    longer = make(list(range(12)) + [50, 51, 52], rid="c")
    assert run_prefill(manager, pool, longer) == 12
    assert held(pool, longer, 15) == list(range(12)) + [50, 51, 52]
    diverging = make([0, 1, 2, 3, 9, 9, 9, 9, 9], rid="d")
    assert run_prefill(manager, pool, diverging) == 4
    assert (manager.queries, manager.hits) == (12 + 12 + 15 + 9, 0 + 8 + 12 + 4)


def test_cache_salt_isolates_tenants():
    pool = TensorPool(16)
    manager = BlockManager(16, SIZE, prefix_caching=True, pool=pool)
    run_prefill(manager, pool, make(range(9), salt="tenant-a", rid="a"))
    assert run_prefill(manager, pool, make(range(9), salt="tenant-b", rid="b")) == 0
    assert run_prefill(manager, pool, make(range(9), rid="c")) == 0
    assert run_prefill(manager, pool, make(range(9), salt="tenant-a", rid="d")) == 8


def test_scored_requests_bypass_lookup_but_fill_the_cache():
    pool = TensorPool(16)
    manager = BlockManager(16, SIZE, prefix_caching=True, pool=pool)
    run_prefill(manager, pool, make(range(9), rid="a"))
    scored = make(range(9), prompt_logprobs=0, rid="b")
    assert run_prefill(manager, pool, scored) == 0
    assert (manager.queries, manager.hits) == (9, 0)  # a bypassed lookup is not counted
    manager.free(scored)
    assert run_prefill(manager, pool, make(range(9), rid="c")) == 8


def test_generated_blocks_are_cached_and_reused_after_preemption():
    pool = TensorPool(16)
    manager = BlockManager(16, SIZE, prefix_caching=True, pool=pool)
    state = make(range(6))
    run_prefill(manager, pool, state)
    for token in (60, 61, 62, 63):  # decode: each round writes the newest token's position
        state.generated.append(token)
        position = len(state.context()) - 1
        manager.grow(state, position + 1)
        pool.device[state.block_table[position // SIZE], position % SIZE] = state.context()[position]
        state.prefilled = len(state.context())
        manager.cache(state, state.request.prompt_ids + state.generated)
    assert state.cached_blocks == 2  # positions [0, 9) written: 2 full blocks
    manager.free(state)  # preempted: readmission finds its own blocks
    state.prefilled = 0
    assert manager.allocate(state) == 8
    assert held(pool, state, 8) == [0, 1, 2, 3, 4, 5, 60, 61]


def test_unreferenced_blocks_are_evicted_least_recently_freed_first():
    pool = TensorPool(5)  # 4 usable blocks
    manager = BlockManager(5, SIZE, prefix_caching=True, pool=pool)
    a, b = make(range(5), rid="a"), make(range(100, 105), rid="b")
    run_prefill(manager, pool, a)
    run_prefill(manager, pool, b)
    manager.free(a)
    manager.free(b)  # both prompts' first blocks stay cached, a's freed first
    assert manager.num_free == 4 and manager.usage() == 0.0
    c = make(range(200, 209), rid="c")  # 3 blocks: the 2 uncached ones, then a's cached block is evicted
    assert manager.can_allocate(c)
    run_prefill(manager, pool, c)
    assert manager.blocks[c.block_table[2]].hash is None  # its third block (a's first) was evicted, not cached
    manager.free(c)
    b2 = make(range(100, 105), rid="b2")
    assert run_prefill(manager, pool, b2) == 4  # b's block survived
    manager.free(b2)
    assert run_prefill(manager, pool, make(range(5), rid="a2")) == 0  # a's block is gone
    assert not manager.can_allocate(make(range(300, 321), rid="big"))


def test_host_tier_round_trip_moves_the_data():
    pool = TensorPool(4, host_blocks=2)  # 3 usable device blocks, 2 host blocks
    manager = BlockManager(4, SIZE, prefix_caching=True, host_blocks=2, pool=pool)
    first = make(range(9), rid="a")
    run_prefill(manager, pool, first)
    manager.free(first)
    other = make(range(100, 112), rid="b")  # needs all 3 device blocks: a's 2 cached blocks go to the host
    run_prefill(manager, pool, other)
    assert [c[0] for c in pool.calls] == ["to_host", "to_host"]
    assert len(manager.host_cached) == 2 and not any(b.hash in manager.host_cached for b in manager.blocks[1:])
    pool.device[:] = -7.0  # the device copy is overwritten: only the host tier still holds a's tokens
    manager.free(other)
    again = make(list(range(9)) + [70], rid="c")
    assert manager.allocate(again) == 8
    assert [c[0] for c in pool.calls[2:]] == ["from_host", "to_host"] and manager.host_hits == 2
    assert pool.calls[2][2] == again.block_table[:2]
    assert held(pool, again, 8) == list(range(8))
    # the third block evicted one of b's cached blocks into a host block the round trip had freed
    assert len(manager.host_cached) == 1 and len(manager.host_free) == 1


def test_host_tier_full_drops_its_least_recent_block():
    pool = TensorPool(3, host_blocks=1)
    manager = BlockManager(3, SIZE, prefix_caching=True, host_blocks=1, pool=pool)
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        state = make(range(start, start + 5), rid=rid)
        run_prefill(manager, pool, state)
        manager.free(state)
    other = make(range(300, 308), rid="d")  # evicts c's cached block and takes the free one
    run_prefill(manager, pool, other)
    manager.free(other)
    first_blocks = {start: hash_block(ROOT_HASH, range(start, start + 4)) for start in (0, 100, 200)}
    assert list(manager.host_cached) == [first_blocks[200]]  # a's and b's went to the host and were dropped
    assert run_prefill(manager, pool, make(range(200, 205), rid="c2")) == 4
    assert manager.host_hits == 1


def test_fork_shares_full_blocks_and_copies_the_last():
    pool = TensorPool(16)
    manager = BlockManager(16, SIZE, prefix_caching=True, pool=pool)
    leader = make(range(10), rid="0")
    run_prefill(manager, pool, leader)
    sample = make(range(10), rid="1")
    assert manager.fork(leader, sample, 10)
    assert sample.block_table[:2] == leader.block_table[:2] and sample.block_table[2] != leader.block_table[2]
    assert pool.calls[-1] == ("copy", [leader.block_table[2]], [sample.block_table[2]])
    assert held(pool, sample, 10) == list(range(10))
    aligned = make(range(50, 58), rid="2")  # position 7 ends block 1: the sample's first decode writes it, so it is copied
    run_prefill(manager, pool, aligned)
    twin = make(range(50, 58), rid="3")
    assert manager.fork(aligned, twin, 8)
    assert twin.block_table[0] == aligned.block_table[0] and twin.block_table[1] != aligned.block_table[1]
    manager.free(leader)
    assert all(manager.blocks[b].ref_count == 1 for b in sample.block_table)


def test_allocation_beyond_the_free_blocks_is_refused():
    manager = BlockManager(3, SIZE, prefix_caching=False)
    state = make(range(9))
    assert not manager.can_allocate(state)
    with pytest.raises(RuntimeError, match="needs more KV blocks than are free"):
        manager.allocate(state)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, SIZE, prefix_caching=False)


class Snapshots(set):
    """The hashes whose blocks end with a state snapshot (``StateSnapshots``' ``__contains__`` and ``drop``)."""

    def drop(self, block_hash):
        self.discard(block_hash)


def test_a_hit_ends_at_the_last_cached_block_with_a_state_snapshot():
    pool, states = TensorPool(12), Snapshots()
    manager = BlockManager(12, SIZE, prefix_caching=True, pool=pool, states=states)
    first = make(range(13), rid="a")  # 3 full blocks cached
    run_prefill(manager, pool, first)
    manager.free(first)
    states.update(first.block_hashes[:2])  # the states after positions 4 and 8 were kept, not after 12
    second = make(list(range(13)) + [99], rid="b")
    assert manager.can_allocate(second) and run_prefill(manager, pool, second) == 2 * SIZE
    manager.free(second)
    states.clear()
    assert run_prefill(manager, pool, make(list(range(13)) + [98], rid="c")) == 0
    assert manager.hits == 2 * SIZE


def test_a_snapshot_leaves_when_its_block_leaves_both_tiers():
    pool, states = TensorPool(5, host_blocks=1), Snapshots()  # 4 usable device blocks, 1 host block
    manager = BlockManager(5, SIZE, prefix_caching=True, host_blocks=1, pool=pool, states=states)
    first = make(range(13), rid="a")
    run_prefill(manager, pool, first)
    manager.free(first)
    states.update(first.block_hashes)
    run_prefill(manager, pool, make(range(100, 116), rid="b"))  # all 4 device blocks: a's 3 cached ones evicted
    # the tail went first; the one host block keeps the last evicted (a's first), the other two left both tiers
    assert set(manager.host_cached) == {first.block_hashes[0]} and states == {first.block_hashes[0]}
