"""CPU replay: a layer's cache write in one native call (``paged_attention.c`` ``write_cells``), in place of the
recipes' ``index_copy_`` of ``where(valid, new rows, old values)``.

The recipes write each cache of a layer as ``index_copy_(pool, 0, cells, where(valid, new.index_select(0, order),
old))`` (``recipes/layers.py``), where ``old`` is a step's gather of the old values of every layer's cells, so that a
row not valid (a padded lane) writes back what its cell held: four to five calls a cache and layer, and two gathers
of every layer's cells a step. ``rewrite`` points each such write at ``write_cells``, which copies the valid rows'
bytes into their cells and leaves the others as they are: bit for bit the same pool, with the gathers gone. Made at
load on the CPU with the paged attention (``LoadOptions.native_kernels``), in every variant of a core alike.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ignition.runtime.backends.paged_attention import call_of, erase_unread, library
from ignition.validate.graph_json import FACTS

_aten = torch.ops.aten
_profiling = torch._C._autograd._profiler_enabled


def write_cells(pool: torch.Tensor, cells: torch.Tensor, source: torch.Tensor, order: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """A layer's cache write as the recipes' graphs make it, ``pool.index_copy_(0, cells, where(valid,
    source.index_select(0, order), old))`` (``old``: the cells' values before the step), in one call that copies
    only the valid rows' bytes: ``pool [rows, ...]`` contiguous, ``source [S, ...]`` of pool's dtype with rows laid
    out as pool's, ``cells`` and ``order`` int64 ``[n]``, ``valid`` bool of ``n`` elements. Returns ``pool``. Shown
    as ``ignition::write_cells`` while a profiler runs."""
    if _profiling():
        with torch.profiler.record_function("ignition::write_cells"):
            return _write(pool, cells, source, order, valid)
    return _write(pool, cells, source, order, valid)


def _write(pool: torch.Tensor, cells: torch.Tensor, source: torch.Tensor, order: torch.Tensor,
           valid: torch.Tensor) -> torch.Tensor:
    count = cells.numel()
    if source.dtype is not pool.dtype or not pool.is_contiguous() or source.dim() != pool.dim() or \
            source.shape[1:] != pool.shape[1:] or source.stride()[1:] != pool.stride()[1:] or \
            cells.dtype is not torch.int64 or order.dtype is not torch.int64 or valid.dtype is not torch.bool or \
            cells.dim() != 1 or order.shape != cells.shape or valid.numel() != count or not cells.is_contiguous() or \
            not order.is_contiguous() or not valid.is_contiguous():
        raise ValueError(
            "write_cells takes a contiguous pool [rows, ...], a source [S, ...] of its dtype and row layout, int64 "
            "cells and order [n] and n bool valid flags; got pool "
            f"{tuple(pool.shape)} {pool.dtype}, source {tuple(source.shape)} {source.dtype} strides "
            f"{source.stride()}, cells {tuple(cells.shape)} {cells.dtype}, order {tuple(order.shape)} {order.dtype}, "
            f"valid {tuple(valid.shape)} {valid.dtype}")
    row = pool.stride(0) * pool.element_size()
    if library().write_cells(pool.data_ptr(), pool.size(0), row, cells.data_ptr(), source.data_ptr(), source.size(0),
                             source.stride(0) * source.element_size(), order.data_ptr(), valid.data_ptr(), count):
        raise IndexError(f"write_cells: a valid row's cell outside the pool's {pool.size(0)} rows or its source row "
                         f"outside the source's {source.size(0)} (cells {cells.tolist()}, order {order.tolist()})")
    return pool


GRAPH_CALLS = {write_cells: "ignition::write_cells"}
"""The function rewritten graphs call, by the name a profiler shows it under."""


def _match(node: Node) -> tuple[Node, Node, Node, Node, Node, list[Node]] | None:
    """``(pool, cells, source, order, valid, replaced)`` where ``node`` is ``index_copy_(pool, 0, cells, where(valid,
    index_select(source, 0, order), old))`` (the recipes' cache write, ``recipes/layers.py``) over rows of one dtype,
    ``valid`` boolean with one flag a cell."""
    if not call_of(node, _aten.index_copy_.default, 4) or node.args[1] != 0 or node.kwargs:
        return None
    pool, _, cells, merged = node.args
    if not call_of(merged, _aten.where.self, 3) or list(merged.users) != [node]:
        return None
    valid, fresh, old = merged.args
    if not call_of(fresh, _aten.index_select.default, 3) or fresh.args[1] != 0 or list(fresh.users) != [merged]:
        return None
    source, order = fresh.args[0], fresh.args[2]
    facts = [getattr(n, "meta", {}).get(FACTS) for n in (pool, source, fresh, old, valid, cells, order)]
    if any(f is None for f in facts):
        return None
    rows, source_rows, written, olds, flags, cell_ids, order_ids = facts
    if any(f.dtype != rows.dtype or f.shape[1:] != rows.shape[1:] for f in (source_rows, written, olds)) or \
            flags.dtype != torch.bool or cell_ids.dtype != torch.int64 or order_ids.dtype != torch.int64 or \
            cell_ids.dim() != 1 or order_ids.shape != cell_ids.shape or \
            flags.shape != (cell_ids.shape[0],) + (1,) * (rows.dim() - 1):
        return None
    return pool, cells, source, order, valid, [merged, fresh, old]


def rewrite(graph: Graph) -> int:
    """Point each cache write of ``graph`` (``_match``) at ``write_cells``, and erase what only the writes read (the
    old values' gathers); returns how many. Before the graph module's code is generated."""
    count = 0
    for node in list(graph.nodes):
        found = _match(node)
        if found is None:
            continue
        pool, cells, source, order, valid, replaced = found
        with graph.inserting_before(node):
            call = graph.call_function(write_cells, (pool, cells, source, order, valid))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        erase_unread(replaced)
        count += 1
    return count


__all__ = ["GRAPH_CALLS", "rewrite", "write_cells"]
