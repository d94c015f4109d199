"""Blocks of the paged KV pool: who holds which, which are cached, and the prefix lookup.

The pool (``KVPool``, ignition/runtime/kv_pool.py) holds ``num_blocks`` blocks of ``block_size`` positions. Each
running request owns a block table (``RequestState.block_table``): entry ``i`` is the block of its positions
``[i * block_size, (i + 1) * block_size)``. Blocks carry reference counts, so that the samples of one prompt and the
requests that share a cached prefix read the same blocks.

Prefix caching (vLLM's automatic prefix caching, sized as nano-vllm's ``block_manager.py``): a block whose
positions are all written is hashed in a chain, sha256 over (the parent block's hash, the block's token ids, extra
keys), the first block's extra keys holding the request's ``cache_salt`` (vLLM's ``hash_block_tokens``), so blocks
are shared only by requests with the same salt and the same tokens up to and including the block. A request's
lookup walks its context's chain and reuses the longest run of cached blocks: block-aligned and never the whole
context, since the last context token must be computed to sample from. A request that scores its prompt
(``prompt_logprobs``) never reads the cache; it still writes it.

A block whose last reference goes is kept, still cached, until its memory is needed: then the least recently freed
cached block is evicted, moving to the host tier when that has room (``pool.to_host``). The lookup checks the
device blocks, then the host tier (``pool.from_host`` brings a hit back) before anything is recomputed.

A core whose layers keep a state that cannot be rebuilt from KV blocks (linear attention) gives the manager its
``states`` (``StateSnapshots``, ignition/runtime/state_snapshots.py): a hit then ends at the last block of the cached
run that has a state snapshot, and a hash that leaves both tiers takes its snapshot with it.

Block 0 is never handed out: a lane's table entries past its live blocks are 0, so writes the graph makes there
(padding rows, a cancelled lane's records-only round) land in a block nobody reads.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict, deque
from dataclasses import dataclass

from ignition.catalog.geometry import NULL_BLOCK

ROOT_HASH = hashlib.sha256(b"ignition prefix cache").digest()
"""The parent hash of a context's first block."""


def hash_block(parent: bytes, token_ids, extra_keys: tuple = ()) -> bytes:
    """sha256 over (parent hash, the block's token ids, extra keys): vLLM's ``hash_block_tokens`` rule."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), tuple(extra_keys)), protocol=5)).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the cache


class BlockManager:
    """Allocation, reference counts, the hash chain, LRU eviction and the host tier of one paged KV pool.

    ``pool`` moves block contents (``copy_blocks``, ``to_host``, ``from_host``); it may be None only without a
    host tier and without copies (tests of the bookkeeping alone). ``states``: the state snapshots a hit must end
    at (None: every cached block can end one). Not thread-safe."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool, host_blocks: int = 0, pool=None,
                 states=None):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a paged KV pool needs at least 2 blocks of at least 1 position (block 0 is the "
                             f"null block), got {num_blocks} blocks of {block_size}")
        self.block_size, self.prefix_caching, self.pool, self.states = block_size, prefix_caching, pool, states
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(1, num_blocks))  # unreferenced, not cached: taken first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recent first
        self.cached: dict[bytes, int] = {}  # hash -> device block
        self.host_blocks = host_blocks if prefix_caching else 0
        self.host_cached: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, least recent first
        self.host_free: list[int] = list(range(self.host_blocks))
        self.queries = self.hits = 0  # prefix-cache lookups, in tokens (vLLM's prefix_cache_queries / _hits)
        self.host_hits = 0  # blocks brought back from the host tier

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks a request can hold (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and unreferenced cached ones."""
        return len(self.free_ids) + len(self.evictable)

    def usage(self) -> float:
        """The fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``: cached free blocks are free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # -- the hash chain ---------------------------------------------------------------------
    def _chain(self, state, tokens: list[int], count: int) -> list[bytes]:
        """The hashes of ``state``'s first ``count`` full blocks of ``tokens`` (kept on the state: a chain only
        grows)."""
        hashes = state.block_hashes
        size = self.block_size
        while len(hashes) < count:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            salt = state.request.cache_salt
            extra = (salt,) if i == 0 and salt is not None else ()
            hashes.append(hash_block(parent, tokens[i * size:(i + 1) * size], extra))
        return hashes[:count]

    def _lookup(self, state) -> list[tuple[str, int]]:
        """The cached run of ``state``'s context: ("device", block) or ("host", host block) per block, in order."""
        if not self.prefix_caching or state.request.prompt_logprobs is not None:
            return []
        context = state.context()
        found = []
        for block_hash in self._chain(state, context, (len(context) - 1) // self.block_size):
            if block_hash in self.cached:
                found.append(("device", self.cached[block_hash]))
            elif block_hash in self.host_cached:
                found.append(("host", self.host_cached[block_hash]))
            else:
                break
        if self.states is not None:  # a hit resumes the layers' state, so it ends where a snapshot was kept
            while found and state.block_hashes[len(found) - 1] not in self.states:
                found.pop()
        return found

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, state, extra_blocks: int = 0) -> bool:
        """Whether ``allocate(state)`` succeeds with ``extra_blocks`` more free (the samples of a group)."""
        found = self._lookup(state)
        pinned = [b for tier, b in found if tier == "device"]
        needed = self.blocks_for(len(state.context())) - len(pinned) + extra_blocks
        return needed <= self.num_free - sum(b in self.evictable for b in pinned)

    def allocate(self, state) -> int:
        """Give ``state`` the blocks of its whole context, the cached run first; the number of context tokens the
        cache holds (``state.prefilled`` starts there). Counts the lookup as vLLM does: its context's tokens
        queried, the cached ones hit. RuntimeError when the blocks are not there (``can_allocate`` first)."""
        if state.block_table:
            raise RuntimeError(f"request {state.request_id} already holds {len(state.block_table)} blocks")
        if not self.can_allocate(state):
            raise RuntimeError(f"request {state.request_id} needs more KV blocks than are free ({self.num_free})")
        found = self._lookup(state)
        for tier, block in found:  # pinned first: nothing below may evict them
            if tier == "device":
                self._ref(block)
        hashes = state.block_hashes
        host_hits = [(i, self.host_cached.pop(hashes[i])) for i, (tier, _) in enumerate(found) if tier == "host"]
        table = [block if tier == "device" else NULL_BLOCK for tier, block in found]
        moves = []
        for i, host_block in host_hits:
            table[i] = self._take()
            moves.append((host_block, table[i]))
        if moves:
            self.pool.from_host([h for h, _ in moves], [d for _, d in moves])
            for (i, _), (host_block, block) in zip(host_hits, moves):
                self._register(block, hashes[i])
                self.host_free.append(host_block)
            self.host_hits += len(moves)
        state.block_table = table
        state.cached_blocks = len(table)
        self.grow(state, len(state.context()))
        if self.prefix_caching and state.request.prompt_logprobs is None:
            self.queries += len(state.context())
            self.hits += len(found) * self.block_size
        return len(found) * self.block_size

    def may_grow(self, state, positions: int) -> bool:
        """Whether ``state``'s table can cover its first ``positions`` positions."""
        return self.blocks_for(positions) - len(state.block_table) <= self.num_free

    def grow(self, state, positions: int) -> None:
        """Extend ``state``'s table to cover its first ``positions`` positions (``may_grow`` first)."""
        needed = self.blocks_for(positions) - len(state.block_table)
        if needed > self.num_free:
            raise RuntimeError(f"request {state.request_id} needs {needed} more KV blocks, {self.num_free} are free")
        state.block_table.extend(self._take() for _ in range(needed))

    def fork(self, source, target, length: int) -> bool:
        """Make ``target`` (a sample of ``source``'s prompt) hold ``source``'s KV for positions ``[0, length)``:
        the blocks wholly below position ``length - 1`` shared by reference, the block holding ``length - 1`` (which
        ``target``'s first decode writes again) copied (``pool.copy_blocks``). False, nothing changed, when no block
        is free for the copy."""
        shared = (length - 1) // self.block_size
        if target.block_table or not self.num_free:
            return False
        for block in source.block_table[:shared]:
            self._ref(block)
        copy = self._take()
        self.pool.copy_blocks([source.block_table[shared]], [copy])
        target.block_table = source.block_table[:shared] + [copy]
        target.block_hashes = list(source.block_hashes[:shared])
        target.cached_blocks = min(source.cached_blocks, shared)
        return True

    def cache(self, state, tokens: list[int]) -> None:
        """Register ``state``'s full blocks whose positions are all written (below ``state.prefilled``; ``tokens``
        its prompt and generated tokens) in the cache. A block whose hash is cached already stays private."""
        if not self.prefix_caching:
            return
        full = min(state.prefilled // self.block_size, len(state.block_table))
        if full <= state.cached_blocks:
            return
        hashes = self._chain(state, tokens, full)
        for i in range(state.cached_blocks, full):
            block = self.blocks[state.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                self._register(block.block_id, hashes[i])
        state.cached_blocks = full

    def free(self, state) -> None:
        """Drop ``state``'s references; its tail blocks become the first evicted (vLLM's order)."""
        for block_id in reversed(state.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_ids.append(block_id)
                else:
                    self.evictable[block_id] = None
        state.block_table, state.cached_blocks = [], 0

    # -- blocks -----------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)
        self.blocks[block_id].ref_count += 1

    def _register(self, block_id: int, block_hash: bytes) -> None:
        self.blocks[block_id].hash = block_hash
        self.cached[block_hash] = block_id

    def _take(self) -> int:
        """A block for new positions: a free one, else the least recently freed cached one, evicted (to the host
        tier where there is room)."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            self._evict(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        block_hash, block.hash = block.hash, None
        del self.cached[block_hash]
        if self.host_blocks and block_hash not in self.host_cached:
            if not self.host_free and self.host_cached:
                dropped_hash, dropped = self.host_cached.popitem(last=False)
                self.host_free.append(dropped)
                self._forget(dropped_hash)
            if self.host_free:
                host_block = self.host_free.pop()
                self.pool.to_host([block.block_id], [host_block])
                self.host_cached[block_hash] = host_block
        self._forget(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        """A hash that left both tiers takes its state snapshot with it."""
        if self.states is not None and block_hash not in self.cached and block_hash not in self.host_cached:
            self.states.drop(block_hash)


__all__ = ["Block", "BlockManager", "NULL_BLOCK", "ROOT_HASH", "hash_block"]
