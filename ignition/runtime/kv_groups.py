"""Two KV-cache groups: the full layers' blocks and the sliding layers' own, which leave as the window moves on.

vLLM's hybrid allocator gives each attention kind a group with its own block table; so does a core with sliding
pools (catalog/geometry.py ``WINDOW_PAGED_STATE``): the full layers' blocks stay ``RequestState.block_table``
(a ``BlockManager`` with prefix caching and the host tier, as for any paged core), the sliding layers' are
``RequestState.window_table`` in a ``BlockManager`` of the sliding pools (``KVPool.window``), which the graphs read
through ``window_block_tables``.

- **Growth and release.** Before each round a lane's window table grows to the positions the round writes, and
  the blocks wholly below ``first - W + 1`` (``first``: the round's first row of the lane) become the null block:
  every later row is at ``first`` or after (a verify round's rejected rows are rewritten later, never read below
  their window; catalog/cache_kinds.py), so no row reads them again. A request therefore holds at most
  ``window_read_blocks(window_cells)`` sliding blocks, whatever its context (``KVPool.window`` is sized by it).
- **Admission** needs the full group's blocks of the whole context (as before) and the sliding group's blocks of one
  window; **preemption** frees both tables, readmission starts again from the prefix lookup.
- **Prefix reuse.** Both groups hash their full blocks by the same chain (``RequestState.block_hashes``). A hit of
  ``h`` blocks starts the prefill at ``h * block_size``, whose first row reads the positions from ``h * block_size -
  W + 1``: it is usable only when the sliding group still caches the blocks covering ``[h * block_size - W + 1,
  h * block_size)`` (and the full group ``[0, h * block_size)``, the ordinary lookup); otherwise the longest shorter
  run that is, vLLM's ``SlidingWindowManager`` rule. A released block is registered first, so it stays cached until
  its memory is needed. The sliding group has no host tier: a hit brought back from the host still needs the
  window's blocks on the device.
"""

from __future__ import annotations

from ignition.runtime.block_manager import BlockManager


class WindowView:
    """A request as the sliding group's ``BlockManager`` sees it: its ``window_table`` as the block table, the
    request's hash chain and everything else its own."""

    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state

    def __getattr__(self, name: str):
        return getattr(self.state, name)

    block_table = property(lambda self: self.state.window_table,
                           lambda self, table: setattr(self.state, "window_table", table))
    cached_blocks = property(lambda self: self.state.window_cached_blocks,
                             lambda self, count: setattr(self.state, "window_cached_blocks", count))
    block_hashes = property(lambda self: self.state.block_hashes,
                            lambda self, hashes: setattr(self.state, "block_hashes", hashes))


class KVGroups:
    """The full group's ``BlockManager`` (``full``) and the sliding group's (``window``) behind the one interface the
    scheduler and the sample groups use (``BlockManager``'s); ``sliding_window``: ``W``."""

    def __init__(self, full: BlockManager, window: BlockManager, sliding_window: int, window_blocks: int):
        self.full, self.window, self.sliding_window = full, window, sliding_window
        self.window_blocks = window_blocks  # the most sliding blocks one request holds (KVPool.window.max_blocks)

    # -- what callers read: the full group's pool and counters ------------------------------
    block_size = property(lambda self: self.full.block_size)
    num_blocks = property(lambda self: self.full.num_blocks)
    capacity_tokens = property(lambda self: self.full.capacity_tokens)
    prefix_caching = property(lambda self: self.full.prefix_caching)
    queries = property(lambda self: self.full.queries)
    hits = property(lambda self: self.full.hits)
    host_hits = property(lambda self: self.full.host_hits)
    states = property(lambda self: self.full.states)  # linear-state snapshots (none on a sliding core)

    def blocks_for(self, positions: int) -> int:
        return self.full.blocks_for(positions)

    def usage(self) -> float:
        """The fraction of both groups' blocks requests hold."""
        total = self.full.num_blocks + self.window.num_blocks
        return 1.0 - (self.full.num_free + self.window.num_free) / total

    # -- admission --------------------------------------------------------------------------
    def _hit_blocks(self, state) -> int:
        """The longest cached run of ``state``'s context both groups can resume (the module's note)."""
        found = self.full.cached_run(state)
        size, hashes = self.block_size, state.block_hashes
        for count in range(found, 0, -1):
            if self.window.holds(hashes[self._window_start(count * size):count]):
                return count
        return 0

    def _window_start(self, position: int) -> int:
        """The first block a row at ``position`` reads."""
        return max(position - self.sliding_window + 1, 0) // self.block_size

    def can_allocate(self, state, extra_blocks: int = 0) -> bool:
        """Whether ``allocate(state)`` succeeds with ``extra_blocks`` more of the full group free; the sliding group
        must have one window's blocks free."""
        count = self._hit_blocks(state)
        pinned = state.block_hashes[self._window_start(count * self.block_size):count]
        evictable = sum(self.window.cached[block_hash] in self.window.evictable for block_hash in pinned)
        return self.full.can_allocate(state, extra_blocks, limit=count) and \
            self.window.num_free - evictable >= self.window_blocks

    def allocate(self, state) -> int:
        """Both groups' blocks for ``state``: the full group's whole context after the usable cached run, the
        sliding group's cached window before it (grown round by round, ``grow``); the cached context tokens."""
        count = self._hit_blocks(state)
        cached = self.full.allocate(state, limit=count)
        view = WindowView(state)
        if count:
            self.window.adopt(view, self._window_start(count * self.block_size), count)
        return cached

    def fork(self, source, target, length: int) -> bool:
        """``BlockManager.fork`` in both groups (the sliding group shares what ``source`` still holds of the window);
        False, nothing changed, when either has no block for the copy."""
        if not self.full.fork(source, target, length):
            return False
        if not self.window.fork(WindowView(source), WindowView(target), length):
            self.full.free(target)
            return False
        return True

    # -- each round -------------------------------------------------------------------------
    def may_grow(self, state, positions: int, first: int | None = None) -> bool:
        """Whether both tables can cover ``state``'s first ``positions`` positions, once the sliding blocks that the
        window of a round starting at ``first`` has left are released (``release``)."""
        if first is not None:
            self.release(state, first)
        return self.full.may_grow(state, positions) and self.window.may_grow(WindowView(state), positions)

    def grow(self, state, positions: int, first: int | None = None) -> None:
        if first is not None:
            self.release(state, first)
        self.full.grow(state, positions)
        self.window.grow(WindowView(state), positions)

    def release(self, state, first: int) -> None:
        """Release ``state``'s sliding blocks below the window of a row at ``first`` (cached first, when they hold
        written tokens: ``cache`` ran after the round that wrote them)."""
        self.window.release(WindowView(state), first - self.sliding_window + 1)

    def cache(self, state, tokens: list[int]) -> None:
        self.full.cache(state, tokens)
        self.window.cache(WindowView(state), tokens)

    def free(self, state) -> None:
        self.full.free(state)
        self.window.free(WindowView(state))


def window_tables_of(lanes) -> dict[int, list[int]]:
    """Each lane's slot -> its sliding blocks (``window_block_tables``' rows; the null block where released; none
    for a draft core's lane, which ``KVPool.slot_layout`` then gives its slot's ring of blocks)."""
    return {lane.state.slot: lane.state.window_table for lane in lanes}


__all__ = ["KVGroups", "WindowView", "window_tables_of"]
