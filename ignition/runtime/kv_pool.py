"""The paged KV pool of a loaded core: how many blocks its paged caches hold, and the moves of whole blocks.

A core's paged caches (``catalog.geometry.PAGED_STATE``: ``[full_layers, kv_blocks, block_size, ...]``) declare
``kv_blocks`` at its upper bound (``model.kv_blocks``: every slot at ``max_seq_len``), a dynamic extent of every
graph. The load sizes the pool from ``LoadOptions.kv_cache_memory`` (bytes for every paged tensor together; None:
the upper bound), refusing a budget below one sequence (``max_blocks`` blocks). A host tier of
``LoadOptions.kv_host_memory`` bytes holds evicted blocks (pinned on CUDA; a separate tensor on the CPU, so the path
runs everywhere). The graphs address the pool through ``block_tables`` (``fill_block_tables``): row ``s`` lists slot
``s``'s blocks, in position order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ignition.catalog.geometry import PAGED_DIM, PAGED_STATE, max_blocks, usable_blocks


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


def _block_bytes(decl) -> int:
    """Bytes of one block of ``decl`` (a paged state declaration): every extent but kv_blocks."""
    numel = 1
    for axis, extent in enumerate(decl.shape):
        numel *= 1 if axis == PAGED_DIM else extent
    return numel * torch.empty((), dtype=getattr(torch, decl.dtype)).element_size()


def plan_pool(model, state_decls: list, kv_cache_memory: int | None = None, kv_host_memory: int = 0) -> PoolSize:
    """The pool for a core whose manifest ``model`` (``catalog.manifest.ModelShape``) and state declarations are
    given.

    ``kv_cache_memory``: bytes for the device pool (every paged tensor), None for the declared upper bound; a budget
    past the bound is capped at it. KVPoolError when it cannot hold one sequence of ``max_seq_len`` positions besides
    the null block."""
    paged = [decl for decl in state_decls if decl.name in PAGED_STATE]
    if not paged:
        return PoolSize(paged=False, num_blocks=0, block_size=0, bytes_per_block=0, max_blocks=0, declared_blocks=0)
    block_size, declared = model.block_size, model.kv_blocks
    per_sequence = max_blocks(model.max_seq_len, block_size)
    bytes_per_block = sum(_block_bytes(decl) for decl in paged)
    num_blocks = declared
    if kv_cache_memory is not None:
        if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int) or kv_cache_memory < 0:
            raise KVPoolError(f"kv_cache_memory must be a byte count (a non-negative integer), "
                              f"found {kv_cache_memory!r}")
        num_blocks = min(declared, kv_cache_memory // bytes_per_block)
        if usable_blocks(num_blocks) < per_sequence:
            raise KVPoolError(
                f"kv_cache_memory {kv_cache_memory} bytes holds {num_blocks} KV blocks of {bytes_per_block} bytes; "
                f"one sequence of max_seq_len {model.max_seq_len} positions needs {per_sequence} and the null block "
                f"({(per_sequence + 1) * bytes_per_block} bytes)")
    if isinstance(kv_host_memory, bool) or not isinstance(kv_host_memory, int) or kv_host_memory < 0:
        raise KVPoolError(f"kv_host_memory must be a byte count (a non-negative integer), found {kv_host_memory!r}")
    return PoolSize(paged=True, num_blocks=num_blocks, block_size=block_size, bytes_per_block=bytes_per_block,
                    max_blocks=per_sequence, declared_blocks=declared, host_blocks=kv_host_memory // bytes_per_block)


def pool_shape(decl, size: PoolSize) -> list[int]:
    """The shape to allocate for state declaration ``decl``: a paged cache at the pool's block count."""
    if decl.name not in PAGED_STATE or not size.paged:
        return list(decl.shape)
    return [size.num_blocks if axis == PAGED_DIM else extent for axis, extent in enumerate(decl.shape)]


@dataclass(slots=True)
class KVPool:
    """The paged caches of a loaded core (``tensors``: name -> ``[layers, num_blocks, block_size, ...]``, the core's
    state tensors themselves) and their host tier."""

    size: PoolSize
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [layers, host_blocks, block_size, ...]

    @classmethod
    def build(cls, size: PoolSize, state: dict[str, torch.Tensor], on_cuda: bool = False) -> KVPool:
        """The pool over the core's allocated ``state``; ``on_cuda``: the load's device is a GPU (the host tier is
        then pinned, for asynchronous copies)."""
        tensors = {name: tensor for name, tensor in state.items() if name in PAGED_STATE} if size.paged else {}
        host = {}
        if size.host_blocks:
            for name, tensor in tensors.items():
                shape = list(tensor.shape)
                shape[PAGED_DIM] = size.host_blocks
                host[name] = torch.zeros(shape, dtype=tensor.dtype, pin_memory=on_cuda)
        return cls(size, tensors, host)

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
        """Slot ``slot``'s blocks when every slot owns ``width`` consecutive ones (a request without a table)."""
        if (slot + 1) * width > self.num_blocks:
            raise RuntimeError(f"slot {slot} has no block table and the pool of {self.num_blocks} blocks is below its "
                               f"declared {self.size.declared_blocks}: the scheduler must assign the slot's blocks")
        return list(range(slot * width, (slot + 1) * width))


__all__ = ["KVPool", "KVPoolError", "PoolSize", "plan_pool", "pool_shape"]
