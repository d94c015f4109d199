"""The engine's side of a paged KV pool: its block manager, and whether a prefix hit can resume a request.

A core's paged caches (catalog/geometry.py ``PAGED_STATE``, layouts with a ``kv_blocks`` extent) hold a context's
keys by block, so a request whose context starts with cached blocks can start its prefill after them. Everything
else a core keeps per slot must then be rebuilt for the skipped positions too: ``penalty_counts`` is (its prompt
plane counts the skipped tokens, ``seed_penalty_counts``); linear-attention states and DeepSeek V4's compressed
state are not, so prefix reuse is refused for such a core, with one log line at load (its requests still page their
blocks). Sliding-window layers page their own group of blocks (``KVGroups``), whose hits need the window's blocks. A tensor-parallel core's ranks hold their own ``penalty_counts`` shards,
which only broadcast submissions change, so it is refused too.
"""

from __future__ import annotations

import logging

import torch

from ignition.catalog.geometry import PAGED_STATE, PENALTY_COUNTS, PROMPT_PLANE
from ignition.runtime.block_manager import BlockManager
from ignition.runtime.kv_groups import KVGroups

log = logging.getLogger("ignition.runtime")


def paged_states() -> set[str]:
    """The state tensors that are pools of blocks (catalog/geometry.py ``PAGED_STATE``, whose layouts have the
    ``kv_blocks`` extent)."""
    return set(PAGED_STATE)


def prefix_reuse_refusal(core) -> str | None:
    """Why a prefix hit cannot resume a request of ``core`` (None: it can)."""
    if core.group is not None:
        return "tensor-parallel ranks keep their own penalty_counts shards"
    per_slot = sorted(name for name in core.state if name not in paged_states() and name != PENALTY_COUNTS)
    if per_slot:
        return f"its layers keep per-slot state ({', '.join(per_slot)}) that a prefix hit cannot resume"
    return None


def block_manager_for(core, prefix_caching: bool) -> BlockManager | KVGroups | None:
    """The block manager of ``core``'s KV pool (None for a core without paged caches: slots alone then); with sliding
    pools, one a KV-cache group (``KVGroups``)."""
    pool = core.kv_pool
    if pool is None or not pool.paged:
        return None
    refusal = prefix_reuse_refusal(core) if prefix_caching else None
    if refusal is not None:
        log.info("prefix caching is off for %s: %s", core.path.name, refusal)
    caching = prefix_caching and refusal is None
    full = BlockManager(pool.num_blocks, pool.block_size, prefix_caching=caching, host_blocks=pool.host_blocks,
                        pool=pool)
    if pool.window is None:
        return full
    window = BlockManager(pool.window.num_blocks, pool.block_size, prefix_caching=caching, pool=pool.window)
    return KVGroups(full, window, core.spec.model.sliding_window, pool.window.max_blocks)


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


def seed_penalty_counts(state: dict[str, torch.Tensor], slot: int, tokens: list[int]) -> None:
    """Make ``slot``'s ``penalty_counts`` what prefilling ``tokens`` from position 0 leaves: the tokens counted in
    the prompt plane, no emitted token (a prefix hit skips the chunks whose graphs would count them)."""
    counts = state[PENALTY_COUNTS][slot]  # int32 [2, vocab_padded]
    counts.zero_()
    ids = torch.tensor(tokens, dtype=torch.int64, device=counts.device)
    counts[PROMPT_PLANE].index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))


__all__ = ["block_manager_for", "kv_budget", "kv_capacity_tokens", "paged_states", "prefix_reuse_refusal",
           "seed_penalty_counts"]
