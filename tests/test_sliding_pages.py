"""Sliding-window layers' own pools of blocks (recipes/window_pages.py, runtime/kv_groups.py): each row reads exactly
its window through a table whose released entries are the null block, and the sliding group's bookkeeping (release,
fork, free, the prefix hit that needs the window's blocks)."""

from __future__ import annotations

import pytest
import torch

from ignition.catalog.cache_kinds import window_cells
from ignition.catalog.geometry import NULL_BLOCK, window_blocks_bound, window_read_blocks
from ignition.recipes.layers import Rows
from ignition.recipes.window_pages import window_keys, window_mask
from ignition.runtime.block_manager import BlockManager
from ignition.runtime.kv_groups import KVGroups, WindowView
from ignition.runtime.requests import Request, RequestState


@pytest.mark.parametrize("ring", [False, True])
def test_each_row_sees_exactly_its_window_through_released_tables(ring):
    """Chunked steps and verify rounds whose rejected rows are rewritten later, a table releasing every block wholly
    below the step's first row's window (its entries then the null block, whose cells hold -1), or (``ring``: a draft
    core's lane, ``KVPool.slot_layout``) cycling over the slot's ``window_read_blocks`` blocks: every row's visible
    keys are the cells of exactly the positions (p - W, p], never a released or overwritten block."""
    for window, rows, block in ((3, 1, 2), (4, 5, 2), (8, 8, 16), (5, 2, 4), (6, 3, 1)):
        cells = window_cells(window, rows, 1000)
        per, blocks = window_read_blocks(cells, block), 64
        pool = torch.full((blocks * block,), -1)  # each cell holds the position written there; the null block -1
        width = 48 // block + 2
        table = torch.tensor([[1 + i % per for i in range(width)] if ring else [NULL_BLOCK] * width],
                             dtype=torch.int32)
        free = list(range(1, blocks))
        start = 0
        while start < 40:
            step = torch.arange(start, start + rows)
            for index in range(0 if ring else (start - window + 1) // block):  # release: the null block instead
                if table[0, index] != NULL_BLOCK:
                    free.append(int(table[0, index]))
                    pool[int(table[0, index]) * block:(int(table[0, index]) + 1) * block] = -1
                    table[0, index] = NULL_BLOCK
            for index in range(start // block, (start + rows - 1) // block + 1):  # grow to the step's end
                if table[0, index] == NULL_BLOCK:
                    table[0, index] = free.pop(0)
            assert ring or int((table != NULL_BLOCK).sum()) <= per, (window, rows, block, start)
            for p in step.tolist():  # every row writes before any reads
                pool[int(table[0, p // block]) * block + p % block] = p
            rows_of_step = Rows.prefill(rows, torch.tensor([start]), torch.tensor([rows]), torch.tensor([0]),
                                        window_tables=table)
            keys, where = window_keys(rows_of_step, torch.tensor([[start]]), torch.tensor([0]), window, cells,
                                      blocks, block)
            hidden = window_mask(keys, step.view(1, -1), window, 1, torch.bool)[0, 0]  # [R, K]
            for row, position in enumerate(step.tolist()):
                seen = sorted(pool[where[~hidden[row]]].tolist())
                assert seen == list(range(max(0, position - window + 1), position + 1)), (window, rows, position)
            start += 1 if rows > 1 and start % 3 == 0 else rows  # a verify round accepting one row


def test_the_sliding_pools_hold_every_slots_window():
    """window_kv_blocks: every slot's window (its read blocks, or a whole sequence's when fewer) and the null block."""
    assert window_read_blocks(15, 16) == 2 and window_read_blocks(17, 16) == 2 and window_read_blocks(18, 16) == 3
    assert window_read_blocks(1, 16) == 1 and window_read_blocks(767, 16) == 49
    assert window_blocks_bound(2, 15, 64, 16) == 5 and window_blocks_bound(1, 15, 16, 16) == 2
    assert window_blocks_bound(32, 767, 32768, 16) == 32 * 49 + 1  # Gemma-3-1B's window: not max_seq_len's 2048


class Moves:
    """A pool that records block copies (``BlockManager.fork``)."""

    def __init__(self):
        self.copies = []

    def copy_blocks(self, src, dst):
        self.copies.append((list(src), list(dst)))


def groups(full_blocks=20, window_blocks=7, caching=True, window=8, block=4) -> KVGroups:
    full = BlockManager(full_blocks, block, prefix_caching=caching, pool=Moves())
    sliding = BlockManager(window_blocks, block, prefix_caching=caching, pool=Moves())
    return KVGroups(full, sliding, window, window_read_blocks(window_cells(window, 4, 64), block))


def state(prompt, rid="r") -> RequestState:
    return RequestState(Request(list(prompt)), rid)


def run(kv: KVGroups, s: RequestState, chunk: int = 4) -> None:
    """Prefill ``s``'s context in chunks as the scheduler does: release and grow before each round, cache after."""
    while s.prefilled < len(s.context()):
        end = min(s.prefilled + chunk, len(s.context()))
        assert kv.may_grow(s, end, s.prefilled)
        kv.grow(s, end, s.prefilled)
        s.prefilled = end
        kv.cache(s, s.request.prompt_ids)


def live(table) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


def test_a_long_request_holds_a_bounded_window_while_its_full_blocks_grow():
    kv = groups()
    s = state(range(1, 41))
    assert kv.can_allocate(s) and kv.allocate(s) == 0
    assert s.window_table == [] and len(s.block_table) == 10
    run(kv, s)
    assert len(s.window_table) == 10 and s.window_table[:7] == [NULL_BLOCK] * 7  # below 36 - 8 + 1 = 29: released
    assert len(live(s.window_table)) <= -(-(8 + 4) // 4) + 1
    assert kv.window.num_free == kv.window.num_blocks - len(live(s.window_table))
    kv.free(s)
    assert s.window_table == [] and kv.window.num_free == kv.window.num_blocks
    assert kv.full.num_free == kv.full.num_blocks and kv.usage() == 0.0


def test_a_fork_shares_the_live_window_and_skips_released_entries():
    kv = groups()
    leader, sample = state(range(1, 23), "a"), state(range(1, 23), "b")
    kv.allocate(leader)
    run(kv, leader)
    assert kv.fork(leader, sample, 22)
    shared = (22 - 1) // 4
    assert sample.window_table[:shared] == leader.window_table[:shared] and NULL_BLOCK in sample.window_table
    assert sample.window_table[shared] not in leader.window_table  # the block the sample's first decode rewrites
    for block in live(sample.window_table[:shared]):
        assert kv.window.blocks[block].ref_count == 2
    kv.free(leader)
    kv.free(sample)
    assert kv.window.num_free == kv.window.num_blocks and kv.window.blocks[NULL_BLOCK].ref_count == 0


def test_a_prefix_hit_needs_the_windows_blocks():
    """A hit at block boundary h resumes only where the sliding group still caches the blocks of [h*bs - W + 1,
    h*bs); otherwise the longest shorter run that does (vLLM's SlidingWindowManager)."""
    kv = groups()
    prompt = list(range(1, 30))  # 7 full blocks of 4 and one token
    first = state(prompt, "first")
    kv.allocate(first)
    run(kv, first)
    kv.free(first)
    again = state(prompt + [99], "again")
    assert kv.allocate(again) == 7 * 4  # blocks 5 and 6 hold positions 20-27, the window of a row at 28
    assert again.window_table[:5] == [NULL_BLOCK] * 5 and len(live(again.window_table)) == 2
    assert again.window_cached_blocks == 7
    kv.free(again)
    hashes = WindowView(again).block_hashes
    evicted = kv.window.cached.pop(hashes[5])  # the window's older block leaves the sliding group's cache
    kv.window.blocks[evicted].hash = None
    kv.window.evictable.pop(evicted)
    kv.window.free_ids.append(evicted)
    later = state(prompt + [98], "later")
    assert kv.allocate(later) == 5 * 4  # h = 7 and h = 6 need block 5; h = 5 needs blocks 3 and 4, still cached
    assert later.window_table == [NULL_BLOCK] * 3 + [kv.window.cached[hashes[3]], kv.window.cached[hashes[4]]]
    assert len(later.block_table) == 8 and kv.full.hits == 7 * 4 + 5 * 4


def test_without_prefix_caching_released_blocks_are_free_at_once():
    kv = groups(caching=False)
    s = state(range(1, 41))
    kv.allocate(s)
    run(kv, s)
    assert kv.window.evictable == {} and kv.window.num_free == kv.window.num_blocks - len(live(s.window_table))
