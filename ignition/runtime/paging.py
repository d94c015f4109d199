"""The engine's side of a paged KV pool: its block manager, and whether a prefix hit can resume a request.

A core's paged caches (catalog/geometry.py ``PAGED_STATE``, layouts with a ``kv_blocks`` extent) hold a context's
keys by block, so a request whose context starts with cached blocks can start its prefill after them. Everything
else a core keeps per slot must then be rebuilt for the skipped positions too: ``penalty_counts`` is (its prompt
plane counts the skipped tokens, ``seed_penalty_counts``), and so are the states of cache kinds that do not rewind
(linear attention): they are restored from a snapshot kept at the hit's last block (``resume_prefix``,
ignition/runtime/state_snapshots.py). Sliding-window layers page their own group of blocks (``KVGroups``), whose
hits need the window's blocks. DeepSeek V4's compressed state cannot be resumed, so prefix reuse is refused for such
a core, with one log line at load (its requests still page their blocks), as it is for a linear core whose snapshot
budget holds no snapshot.

A tensor-parallel core's other ranks hold their own ``penalty_counts`` and pools, which graphs change through
broadcast submissions: what rank 0 changes outside a graph (a prefix hit's seeded counts, ``seed_prefix``; a block
moved by the block manager, ``RankPool``) each rank repeats before the next submission
(``RankGroup.replay``, ignition/runtime/parallel/group.py, then ``replay_operations`` on the rank). Snapshots of
states that do not rewind are rank 0's alone, so such a tensor-parallel core is refused. The sliding group moves no
block on a tensor-parallel core (no host tier; its samples do not share blocks), so its pool is not wrapped.
"""

from __future__ import annotations

import logging

import torch

from ignition.catalog.geometry import PAGED_STATE, PENALTY_COUNTS, PROMPT_PLANE
from ignition.runtime.block_manager import BlockManager
from ignition.runtime.kv_groups import KVGroups
from ignition.runtime.state_snapshots import (STATE_SNAPSHOT_MEMORY, StateSnapshots, check_snapshot_memory,
                                              snapshot_bytes, snapshot_states)

log = logging.getLogger("ignition.runtime")


def paged_states() -> set[str]:
    """The state tensors that are pools of blocks (catalog/geometry.py ``PAGED_STATE``, whose layouts have the
    ``kv_blocks`` extent)."""
    return set(PAGED_STATE)


def prefix_reuse_refusal(core, snapshot_memory: int = STATE_SNAPSHOT_MEMORY) -> str | None:
    """Why a prefix hit cannot resume a request of ``core`` (None: it can) when ``snapshot_memory`` host bytes hold
    the snapshots of its states that do not rewind."""
    snapshotted = snapshot_states(core.state)
    if core.group is not None and snapshotted:
        return "tensor-parallel ranks keep their own states, which rank 0's snapshots do not restore"
    per_slot = sorted(name for name in core.state
                      if name not in paged_states() and name != PENALTY_COUNTS and name not in snapshotted)
    if per_slot:
        return f"its layers keep per-slot state ({', '.join(per_slot)}) that a prefix hit cannot resume"
    if snapshotted and snapshot_memory < snapshot_bytes(core.state):
        return (f"--state-snapshot-memory {snapshot_memory} bytes holds no snapshot of its per-slot state "
                f"({', '.join(snapshotted)}: {snapshot_bytes(core.state)} bytes a snapshot)")
    return None


def block_manager_for(core, prefix_caching: bool, snapshot_memory: int = STATE_SNAPSHOT_MEMORY,
                      chunk: int = 1) -> BlockManager | KVGroups | None:
    """The block manager of ``core``'s KV pool (None for a core without paged caches: slots alone then; with
    sliding pools, one a KV-cache group, ``KVGroups``); a core with states that do not rewind gets a store of their
    snapshots of ``snapshot_memory`` bytes, kept at the multiples of the block size and of the prefill ``chunk``
    (ValueError for a budget that is no byte count)."""
    check_snapshot_memory(snapshot_memory)
    pool = core.kv_pool
    if pool is None or not pool.paged:
        return None
    refusal = prefix_reuse_refusal(core, snapshot_memory) if prefix_caching else None
    if refusal is not None:
        log.info("prefix caching is off for %s: %s", core.path.name, refusal)
    reuse = prefix_caching and refusal is None
    states = None
    if reuse and snapshot_states(core.state):
        states = StateSnapshots.for_core(core, snapshot_memory, pool.block_size, chunk)
    full = BlockManager(pool.num_blocks, pool.block_size, prefix_caching=reuse, host_blocks=pool.host_blocks,
                        pool=pool if core.group is None else RankPool(pool, core.group), states=states)
    if pool.window is None:
        return full
    window = BlockManager(pool.window.num_blocks, pool.block_size, prefix_caching=reuse, pool=pool.window)
    return KVGroups(full, window, core.spec.model.sliding_window, pool.window.max_blocks)


def resume_prefix(core, blocks: BlockManager | KVGroups, state, cached: int) -> None:
    """Make ``state``'s slot what prefilling its first ``cached`` context tokens leaves (a prefix hit skips them):
    ``penalty_counts`` reseeded (on every rank, ``seed_prefix``), the states that do not rewind restored from the
    hit's last block's snapshot."""
    seed_prefix(core, state.slot, state.context()[:cached])
    if blocks.states is not None:
        blocks.states.restore(state.block_hashes[cached // blocks.block_size - 1], state.slot)


POOL_MOVES = ("copy_blocks", "to_host", "from_host")
"""``KVPool``'s moves of whole blocks, the ones a block manager makes (runtime/kv_pool.py)."""


class RankPool:
    """Rank 0's ``KVPool`` of a tensor-parallel core, as its block manager sees it: each move of blocks runs here and
    on every other rank, before the next submission (``RankGroup.replay``)."""

    def __init__(self, pool, group):
        self.pool, self.group = pool, group

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._move("copy_blocks", src, dst)

    def to_host(self, device: list[int], host: list[int]) -> None:
        self._move("to_host", device, host)

    def from_host(self, host: list[int], device: list[int]) -> None:
        self._move("from_host", host, device)

    def _move(self, name: str, src: list[int], dst: list[int]) -> None:
        getattr(self.pool, name)(src, dst)
        self.group.replay(name, [int(block) for block in src], [int(block) for block in dst])


def kv_budget(fraction: float, total: int, free: int, weights_bytes: int) -> int:
    """Bytes for the KV pool when this process may use ``fraction`` of a GPU's ``total`` memory (vLLM's
    ``--gpu-memory-utilization``): that share, less what others already use (``total - free``) and the weights.
    ValueError when nothing is left."""
    budget = int(fraction * total) - (total - free) - weights_bytes
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {fraction} allows {int(fraction * total)} of the GPU's {total} "
                         f"bytes; {total - free} are in use already and the weights take {weights_bytes}, which "
                         f"leaves nothing for the KV cache: raise it, or give --kv-cache-memory BYTES")
    return budget


def kv_capacity_tokens(core) -> int | None:
    """Tokens ``core``'s paged KV pool holds for requests (block 0, the null block, excluded); None without one."""
    pool = core.kv_pool
    return pool.capacity_tokens if pool is not None and pool.paged else None


def seed_prefix(core, slot: int, tokens: list[int]) -> None:
    """``seed_penalty_counts`` of ``core``'s ``slot`` for a prefix hit of ``tokens``, on every rank of a
    tensor-parallel core."""
    seed_penalty_counts(core.state, slot, tokens)
    if core.group is not None:
        core.group.replay("seed_penalty_counts", int(slot), [int(token) for token in tokens])


def replay_operations(core, operations: list) -> None:
    """On a tensor-parallel rank other than 0: repeat what rank 0 changed outside a graph, in order (``operations``:
    ``[name, *arguments]`` each, ``RankGroup.replay``): ``seed_penalty_counts`` or one of ``POOL_MOVES``."""
    for name, *arguments in operations:
        if name == "seed_penalty_counts":
            seed_penalty_counts(core.state, *arguments)
        elif name in POOL_MOVES and core.kv_pool is not None:
            getattr(core.kv_pool, name)(*arguments)
        else:
            raise ValueError(f"rank 0 asked for {name!r}; expected seed_penalty_counts or one of {POOL_MOVES} "
                             f"(a core with a KV pool)")


def seed_penalty_counts(state: dict[str, torch.Tensor], slot: int, tokens: list[int]) -> None:
    """Make ``slot``'s ``penalty_counts`` what prefilling ``tokens`` from position 0 leaves: the tokens counted in
    the prompt plane, no emitted token (a prefix hit skips the chunks whose graphs would count them)."""
    counts = state[PENALTY_COUNTS][slot]  # int32 [2, vocab_padded]
    counts.zero_()
    ids = torch.tensor(tokens, dtype=torch.int64, device=counts.device)
    counts[PROMPT_PLANE].index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))


__all__ = ["POOL_MOVES", "RankPool", "block_manager_for", "kv_budget", "kv_capacity_tokens", "paged_states",
           "prefix_reuse_refusal", "replay_operations", "resume_prefix", "seed_penalty_counts", "seed_prefix"]
