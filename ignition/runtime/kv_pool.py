"""The paged KV pool of a loaded core: how many blocks its paged caches hold, and the moves of whole blocks.

A core's paged caches (``catalog.geometry.PAGED_STATE``: ``[full_layers, kv_blocks, block_size, ...]``) declare
``kv_blocks`` at its upper bound (``model.kv_blocks``: every slot at ``max_seq_len``), a dynamic extent of every
graph. The load sizes the pool from ``LoadOptions.kv_cache_memory`` (bytes for every paged tensor together; None:
the upper bound), refusing a budget below one sequence (``max_blocks`` blocks). A host tier of
``LoadOptions.kv_host_memory`` bytes holds evicted blocks (pinned on CUDA; a separate tensor on the CPU, so the path
runs everywhere). The graphs address the pool through ``block_tables`` (``fill_block_tables``): row ``s`` lists slot
``s``'s blocks, in position order. The sliding layers' pools (``WINDOW_PAGED_STATE``) are a group of their own,
``KVPool.window``, at their declared ``model.window_kv_blocks`` (every slot's window; no host tier), addressed through
``window_block_tables``; a budget pays for them first and the full layers' pool takes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ignition.catalog.geometry import (NULL_BLOCK, PAGED_DIM, PAGED_STATE, WINDOW_PAGED_STATE, max_blocks,
                                       usable_blocks, window_read_blocks)


class KVPoolError(ValueError):
    """A KV memory budget that cannot hold what the core needs."""


@dataclass(frozen=True, slots=True)
class PoolSize:
    """The pool's extents, decided before the state is allocated (``plan_pool``)."""

    paged: bool  # the core has paged caches (False: a toy core, DeepSeek V4: every cache per slot)
    num_blocks: int  # device blocks (0 without paged caches)
    block_size: int
    bytes_per_block: int  # one block of every paged tensor, every layer
    max_blocks: int  # blocks one sequence of max_seq_len positions takes (a block table row)
    declared_blocks: int  # the core's upper bound, model.kv_blocks
    host_blocks: int = 0
    window: PoolSize | None = None  # the sliding layers' pools (WINDOW_PAGED_STATE), a KV-cache group of their own
    ring: bool = False  # a sliding group: a slot without a table cycles over its own max_blocks blocks (slot_layout)


def _block_bytes(decl) -> int:
    """Bytes of one block of ``decl`` (a paged state declaration): every extent but kv_blocks."""
    numel = 1
    for axis, extent in enumerate(decl.shape):
        numel *= 1 if axis == PAGED_DIM else extent
    return numel * torch.empty((), dtype=getattr(torch, decl.dtype)).element_size()


def window_pool(model, decls: list) -> PoolSize | None:
    """The sliding layers' pools (``WINDOW_PAGED_STATE`` in ``decls``), None without them: their declared
    ``model.window_kv_blocks`` (``catalog.geometry.window_blocks_bound``: every slot's window at once, since the
    runtime releases the blocks every later row's window has left, runtime/kv_groups.py)."""
    window = [decl for decl in decls if decl.name in WINDOW_PAGED_STATE]
    if not window:
        return None
    per_sequence = min(window_read_blocks(model.window_cells, model.block_size),
                       max_blocks(model.max_seq_len, model.block_size))
    return PoolSize(paged=True, num_blocks=model.window_kv_blocks, block_size=model.block_size,
                    bytes_per_block=sum(_block_bytes(decl) for decl in window), max_blocks=per_sequence,
                    declared_blocks=model.window_kv_blocks, ring=True)


def plan_pool(model, state_decls: list, kv_cache_memory: int | None = None, kv_host_memory: int = 0) -> PoolSize:
    """The pool for a core whose manifest ``model`` (``catalog.manifest.ModelShape``) and state declarations are
    given.

    ``kv_cache_memory``: bytes for the device pools (every paged tensor), None for the declared upper bound; a
    budget past the bound is capped at it. The sliding layers' pools take what every slot's window needs first
    (``window_pool``), the full layers' the rest. KVPoolError when it cannot hold one sequence of ``max_seq_len``
    positions besides the null block."""
    paged = [decl for decl in state_decls if decl.name in PAGED_STATE]
    if not paged:
        return PoolSize(paged=False, num_blocks=0, block_size=0, bytes_per_block=0, max_blocks=0, declared_blocks=0)
    block_size, declared = model.block_size, model.kv_blocks
    window = window_pool(model, paged)
    window_bytes = 0 if window is None else window.num_blocks * window.bytes_per_block
    per_sequence = max_blocks(model.max_seq_len, block_size)
    bytes_per_block = sum(_block_bytes(decl) for decl in paged if decl.name not in WINDOW_PAGED_STATE)
    num_blocks = declared
    if kv_cache_memory is not None:
        if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int) or kv_cache_memory < 0:
            raise KVPoolError(f"kv_cache_memory must be a byte count (a non-negative integer), "
                              f"found {kv_cache_memory!r}")
        rest = kv_cache_memory - window_bytes  # a core of sliding layers alone has no full pool (0 bytes a block)
        num_blocks = min(declared, max(rest, 0) // bytes_per_block) if bytes_per_block else declared
        if rest < 0 or usable_blocks(num_blocks) < per_sequence:
            windows = "" if window is None else f" besides the sliding pools' {window_bytes} bytes"
            raise KVPoolError(
                f"kv_cache_memory {kv_cache_memory} bytes holds {num_blocks} KV blocks of {bytes_per_block} bytes"
                f"{windows}; one sequence of max_seq_len {model.max_seq_len} positions needs {per_sequence} and the "
                f"null block ({(per_sequence + 1) * bytes_per_block + window_bytes} bytes)")
    if isinstance(kv_host_memory, bool) or not isinstance(kv_host_memory, int) or kv_host_memory < 0:
        raise KVPoolError(f"kv_host_memory must be a byte count (a non-negative integer), found {kv_host_memory!r}")
    host_blocks = kv_host_memory // bytes_per_block if bytes_per_block else 0
    return PoolSize(paged=True, num_blocks=num_blocks, block_size=block_size, bytes_per_block=bytes_per_block,
                    max_blocks=per_sequence, declared_blocks=declared, host_blocks=host_blocks, window=window)


def pool_shape(decl, size: PoolSize) -> list[int]:
    """The shape to allocate for state declaration ``decl``: a full layers' pool at the pool's block count (the
    sliding layers' pools at their declared one)."""
    if decl.name not in PAGED_STATE or decl.name in WINDOW_PAGED_STATE or not size.paged:
        return list(decl.shape)
    return [size.num_blocks if axis == PAGED_DIM else extent for axis, extent in enumerate(decl.shape)]


@dataclass(slots=True)
class KVPool:
    """The paged caches of a loaded core (``tensors``: name -> ``[layers, num_blocks, block_size, ...]``, the core's
    state tensors themselves) and their host tier."""

    size: PoolSize
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [layers, host_blocks, block_size, ...]
    window: KVPool | None = None  # the sliding layers' pools, their own group of blocks (no host tier)

    @classmethod
    def build(cls, size: PoolSize, state: dict[str, torch.Tensor], on_cuda: bool = False) -> KVPool:
        """The pool over the core's allocated ``state``; ``on_cuda``: the load's device is a GPU (the host tier is
        then pinned, for asynchronous copies)."""
        window = None
        if size.window is not None:
            window = cls(size.window, {name: state[name] for name in WINDOW_PAGED_STATE if name in state})
        tensors = {name: tensor for name, tensor in state.items()
                   if name in PAGED_STATE and name not in WINDOW_PAGED_STATE} if size.paged else {}
        host = {}
        if size.host_blocks:
            for name, tensor in tensors.items():
                shape = list(tensor.shape)
                shape[PAGED_DIM] = size.host_blocks
                host[name] = torch.zeros(shape, dtype=tensor.dtype, pin_memory=on_cuda)
        return cls(size, tensors, host, window)

    paged = property(lambda self: self.size.paged)
    num_blocks = property(lambda self: self.size.num_blocks)
    block_size = property(lambda self: self.size.block_size)
    bytes_per_block = property(lambda self: self.size.bytes_per_block)
    host_blocks = property(lambda self: self.size.host_blocks)
    max_blocks = property(lambda self: self.size.max_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Positions the device pool holds for requests: every block but the null one (``catalog.geometry.NULL_BLOCK``)."""
        return usable_blocks(self.num_blocks) * self.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device block ``src[i]`` to device block ``dst[i]``, every paged tensor, every layer."""
        self._move(self.tensors, src, self.tensors, dst, self.num_blocks, self.num_blocks)

    def to_host(self, device: list[int], host: list[int]) -> None:
        """Device blocks ``device[i]`` to host blocks ``host[i]``."""
        self._move(self.tensors, device, self.host, host, self.num_blocks, self.host_blocks)

    def from_host(self, host: list[int], device: list[int]) -> None:
        """Host blocks ``host[i]`` back to device blocks ``device[i]``."""
        self._move(self.host, host, self.tensors, device, self.host_blocks, self.num_blocks)

    @staticmethod
    def _move(source: dict, src: list[int], target: dict, dst: list[int], src_blocks: int, dst_blocks: int) -> None:
        if len(src) != len(dst):
            raise ValueError(f"KVPool: {len(src)} source blocks for {len(dst)} destinations")
        if not src:
            return
        if min(src) < 0 or max(src) >= src_blocks or min(dst) < 0 or max(dst) >= dst_blocks:
            raise ValueError(f"KVPool: block ids out of range (sources {src} of {src_blocks}, destinations {dst} of "
                             f"{dst_blocks})")
        for name, tensor in target.items():
            rows = source[name].index_select(PAGED_DIM, torch.tensor(src, device=source[name].device))
            tensor.index_copy_(PAGED_DIM, torch.tensor(dst, device=tensor.device), rows.to(tensor.device))

    def fill_block_tables(self, target: torch.Tensor, tables: dict[int, list[int]]) -> None:
        """``target`` (int32 ``[num_slots, max_blocks]``) holds each slot's table of ``tables`` (slot -> its blocks,
        in position order), zeros elsewhere. A slot given no blocks gets the slot layout (its ``max_blocks`` blocks
        from ``slot * max_blocks``), which a pool at its declared upper bound holds."""
        target.zero_()
        for slot, blocks in tables.items():
            if not blocks:
                blocks = self.slot_layout(slot, target.shape[1])
            if len(blocks) > target.shape[1] or min(blocks) < 0 or max(blocks) >= self.num_blocks:
                raise RuntimeError(f"slot {slot}: a block table of {len(blocks)} blocks in [0, {self.num_blocks}) "
                                   f"expected, at most {target.shape[1]}; found {blocks}")
            target[slot, :len(blocks)] = torch.tensor(blocks, dtype=target.dtype)

    def slot_layout(self, slot: int, width: int) -> list[int]:
        """Slot ``slot``'s blocks when every slot owns ``width`` consecutive ones (a request without a table: a draft
        core's lanes). The sliding pools' (``PoolSize.ring``): the slot owns the ``max_blocks`` blocks after the null
        block's and its predecessors', cycled over the table (block ``i`` of the sequence in its ``i mod
        max_blocks``-th): a step's window spans at most ``max_blocks`` consecutive blocks, so none of them is
        overwritten while read, and a draft rewinds by fewer positions than a step's rows."""
        if self.size.ring:
            per = self.max_blocks
            return [NULL_BLOCK + 1 + slot * per + i % per for i in range(width)]
        if (slot + 1) * width > self.num_blocks:
            raise RuntimeError(f"slot {slot} has no block table and the pool of {self.num_blocks} blocks is below its "
                               f"declared {self.size.declared_blocks}: the scheduler must assign the slot's blocks")
        return list(range(slot * width, (slot + 1) * width))


__all__ = ["KVPool", "KVPoolError", "PoolSize", "plan_pool", "pool_shape"]
