"""Snapshots of the per-slot states a prefix hit must resume: linear attention's convolution and recurrent state.

A cache kind whose state summarises every position it has seen (``CacheKindSpec.rewinds`` False in
catalog/cache_kinds.py: ``linear``) cannot be rebuilt from cached KV blocks, so a prefix hit can resume a request
only at a position where its states were kept. After a round, each ordinary prompt chunk that ends on the snapshot
grid, at a block registered in the prefix cache, has its slot's states copied to host memory, keyed by that block's
hash (vLLM's "align" mode of mamba prefix caching keeps states at block-aligned points the same way). The lookup
(``BlockManager``) then takes the longest cached run of blocks whose last block has a snapshot, and ``restore``
copies it into the new request's slot before the rest of its prefill.

The grid is every position that is a multiple of both ``block_size`` and the prefill chunk. A cold prefill from
position 0 ends a chunk at each of them, so a request resumed there splits the rest of its context as the cold
prefill does: its states, tokens and logprobs are the cold ones (bit for bit under ``--batch-invariant``; the
chunked delta rule's result depends on where chunks start). Not snapshotted, for these reasons:

- decode rounds: a boundary every ``block_size`` tokens of every lane would copy the whole state (tens of MB a lane
  at real width) that often, and a decode step's state comes from the delta rule's recurrent form where a cold
  prefill of the same tokens takes the chunked form, so a resume there could not be bit-identical;
- scored chunks: they are cut to the scored variants' widths, another split than an ordinary prefill's.

The store holds at most ``budget // bytes_per_snapshot`` snapshots (the budget is ``--state-snapshot-memory``),
allocated as they are taken (pinned on CUDA) and evicted least recently used; the block manager drops a snapshot when
its block's hash leaves both tiers (``drop``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ignition.catalog.cache_kinds import CACHE_KINDS, KIND_OF_BUFFER
from ignition.catalog.geometry import STATE_SHAPES

SLOT_EXTENT = "num_slots"
"""The symbol of a per-slot state's layout that counts the slots (catalog/geometry.py ``STATE_SHAPES``)."""

STATE_SNAPSHOT_MEMORY = 1 << 30
"""``--state-snapshot-memory`` when not given: host bytes for state snapshots (allocated only as they are taken)."""


def snapshot_states(names) -> list[str]:
    """The state tensors among ``names`` that a prefix hit resumes from a snapshot: the buffers of every cache kind
    that does not rewind (``CacheKindSpec.rewinds``), in the order given."""
    return [name for name in names if name in KIND_OF_BUFFER and not CACHE_KINDS[KIND_OF_BUFFER[name]].rewinds]


def check_snapshot_memory(budget) -> None:
    """ValueError unless ``budget`` is a byte count (a non-negative int)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"state snapshot memory must be a byte count (a non-negative integer), found {budget!r}")


def _slot_axis(name: str) -> int:
    return STATE_SHAPES[name].index(SLOT_EXTENT)


def snapshot_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes one snapshot of ``state``'s resumable tensors takes (one slot of each)."""
    return sum(state[name].select(_slot_axis(name), 0).numel() * state[name].element_size()
               for name in snapshot_states(state))


class StateSnapshots:
    """Host copies of one slot's resumable states, keyed by the hash of the block their position ends, LRU.

    ``state``: the core's state tensors (name -> tensor); ``budget``: host bytes; ``grid``: the positions that may
    be snapshotted are its multiples (``for_core``); ``pinned``: allocate pinned host memory (a CUDA core)."""

    def __init__(self, state: dict[str, torch.Tensor], budget: int, grid: int, pinned: bool = False):
        check_snapshot_memory(budget)
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
            raise ValueError(f"the snapshot grid must be a positive number of positions, found {grid!r}")
        self.names = snapshot_states(state)
        if not self.names:
            raise ValueError("the core keeps no state that needs snapshots (no cache kind that does not rewind)")
        self.state, self.grid, self.pinned = state, grid, pinned
        self.bytes_per_snapshot = snapshot_bytes(state)
        self.capacity = budget // self.bytes_per_snapshot
        self.entries: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()  # least recently used first
        self.taken = self.restored = 0

    @classmethod
    def for_core(cls, core, budget: int, block_size: int, chunk: int) -> StateSnapshots:
        """The store of ``core``'s resumable states: its grid the multiples of ``block_size`` and of the prefill
        ``chunk``, its host memory pinned when the core runs on CUDA."""
        on_cuda = core.options is not None and core.options.cuda
        return cls(core.state, budget, math.lcm(block_size, chunk), pinned=on_cuda)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Host bytes the snapshots hold."""
        return len(self.entries) * self.bytes_per_snapshot

    def take(self, block_hash: bytes, slot: int) -> None:
        """Keep ``slot``'s states as the state after ``block_hash``'s block (the least recently used snapshot makes
        room; one already kept under that hash is only marked used)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return
        if not self.capacity:
            return
        if len(self.entries) >= self.capacity:  # its host buffers take the new copy
            _, buffers = self.entries.popitem(last=False)
        else:
            buffers = {}
            for name in self.names:
                cells = self.state[name].select(_slot_axis(name), slot)
                buffers[name] = torch.empty(cells.shape, dtype=cells.dtype, pin_memory=self.pinned)
        for name in self.names:
            buffers[name].copy_(self.state[name].select(_slot_axis(name), slot))
        self.entries[block_hash] = buffers
        self.taken += 1

    def restore(self, block_hash: bytes, slot: int) -> None:
        """Make ``slot``'s states the snapshot kept under ``block_hash`` (KeyError when there is none)."""
        buffers = self.entries[block_hash]
        self.entries.move_to_end(block_hash)
        for name in self.names:
            self.state[name].select(_slot_axis(name), slot).copy_(buffers[name])
        self.restored += 1

    def drop(self, block_hash: bytes) -> None:
        """Forget the snapshot kept under ``block_hash``, if any (its block left the cache)."""
        self.entries.pop(block_hash, None)

    def after_round(self, lanes, blocks) -> None:
        """Snapshot the slot of each lane of a finished round whose ordinary prompt chunk ended on the grid at a
        block the prefix cache holds (``blocks``, the BlockManager, registered the round's blocks already)."""
        for lane in lanes:
            chunk, state = lane.chunk, lane.state
            if chunk is None or chunk.targets is not None or state.finish_reason == "error":
                continue
            end = chunk.start + len(chunk.tokens)
            block = end // blocks.block_size - 1
            if end % self.grid or block >= len(state.block_hashes):
                continue
            block_hash = state.block_hashes[block]
            if block_hash in blocks.cached or block_hash in blocks.host_cached:
                self.take(block_hash, state.slot)


__all__ = ["STATE_SNAPSHOT_MEMORY", "SLOT_EXTENT", "StateSnapshots", "check_snapshot_memory", "snapshot_bytes",
           "snapshot_states"]
