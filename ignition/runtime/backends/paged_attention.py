"""CPU replay: FP32 and BF16 attention over a layer's KV pool read in place (``paged_attention.c``), in place of the
gathered windows and ATen's kernels.

A recipe's graph attends over each group's key window in one gather a layer (``recipes/attention.py``
``gather_pages``: ``index_select`` of the window's cells from the layer's pool, ``[G, kv_heads, W, head_dim]``), then
``scaled_dot_product_attention`` (FP32) or transformers' eager attention (BF16: ``_eager_product``, a dozen calls).
The gather copies every live key and value once a layer and the kernel reads the copy again: at Qwen3-0.6B's width
and a 300-position context, 20 MB a layer at eight lanes. ``rewrite`` points each such attention of a decode or
verify graph (FP32 with an additive mask and no dropout or causal flag; BF16 with its boolean mask) at
``paged_attention``, which reads the pool's cells where they are.

Every row is computed on its own, in one order whatever the rows beside it, the window's extent past the row's
keys, or the threads (the C source's note): a decode step and a verify row at the same position give the same bits.
Against ATen's kernel (a prompt chunk's rows, ``ROWS_LIMIT``) the rows differ by FP32 rounding (the exp polynomial and
the sums' order), well inside the tolerances transformers is held to (``tests/test_paged_attention.py``). BF16 rounds
the scores, the probabilities and the output to BF16 where the eager path does, so it differs from ATen's products
only where an FP32 sum's order moves a BF16 rounding (its deviation from an FP32 reference is ATen's).
The BF16 graph's softmax of short forwards in transformers' order (``recipes/attention.py``
``_softmax_in_order``) has no counterpart: the kernel's order is its own.

The same library writes a layer's cache for ``cell_writes.py`` (``write_cells`` in the C source).

The rewrite is made at load on the CPU (``LoadOptions.native_kernels``), wherever the kernel builds
(``native_build``), for every decode and verify variant of a core alike; where it does not build (``unavailable`` says
why), the graphs keep ATen's kernels."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch.fx import Graph, Node

from ignition.runtime.backends.batched_products import BMM, widened_bmm
from ignition.runtime.backends.native_build import build, failure
from ignition.validate.graph_json import FACTS, TensorFacts

SOURCE = Path(__file__).with_name("paged_attention.c")
SDPA = torch.ops.aten.scaled_dot_product_attention.default
ROWS_LIMIT = 128
"""The most query rows a group and KV head (a fixed extent of the graph) that ``rewrite`` points at the kernel: a
decode step's heads (``share`` rows a lane) and a verify round's (``share`` x its tokens). A prompt chunk's rows (a
dynamic extent) stay on ATen's kernel, whose blocked products win at many rows."""
_aten = torch.ops.aten


@cache
def library() -> ctypes.CDLL:
    """The compiled kernel (``native_build.build`` of ``SOURCE``); NativeUnavailable with the reason where it cannot
    be built or loaded."""
    loaded, _ = build(SOURCE)
    for function in (loaded.paged_attention_f32, loaded.paged_attention_bf16):
        function.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                             ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                             ctypes.c_long, ctypes.c_long, ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
    loaded.write_cells.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    loaded.write_cells.restype = ctypes.c_int
    return loaded


@cache
def unavailable() -> str | None:
    """None where the kernel builds and loads here; else why not."""
    return failure(library)


_profiling = torch._C._autograd._profiler_enabled


MASKS = {torch.float32: torch.float32, torch.bfloat16: torch.bool}
"""The mask's dtype for each dtype the kernel attends in: FP32 additive (0 or the FP32 minimum), BF16 boolean (True
where hidden), as ``recipes/attention.py`` ``causal_mask`` builds them."""


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cells: torch.Tensor,
           mask: torch.Tensor) -> None:
    dtype = query.dtype
    if dtype not in MASKS or key_cache.dtype != dtype or value_cache.dtype != dtype or mask.dtype != MASKS[dtype] or \
            query.dim() != 4 or key_cache.dim() != 5 or key_cache.shape != value_cache.shape or \
            cells.dtype != torch.int64 or cells.dim() != 1 or mask.dim() != 4 or \
            key_cache.shape[3:] != query.shape[1:2] + query.shape[3:] or \
            (query.shape[0] and cells.shape[0] % query.shape[0]) or \
            not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError(
            "paged_attention takes a query [G, kv_heads, M, head_dim] and contiguous pools [layers, blocks, "
            "block_size, kv_heads, head_dim], both float32 (a float32 additive mask) or both bfloat16 (a bool mask, "
            "True where hidden), int64 cells [G * W] and a mask [G or 1, 1, M or 1, W]; "
            f"got query {tuple(query.shape)} {query.dtype}, pools {tuple(key_cache.shape)} {key_cache.dtype} and "
            f"{tuple(value_cache.shape)} {value_cache.dtype}, cells {tuple(cells.shape)} {cells.dtype}, mask "
            f"{tuple(mask.shape)} {mask.dtype}")
    groups = query.shape[0]
    window = cells.shape[0] // groups if groups else 0
    if mask.shape[0] not in (1, groups) or mask.shape[1] != 1 or mask.shape[2] not in (1, query.shape[2]) or \
            mask.shape[3] != window:
        raise ValueError(f"paged_attention: a mask {tuple(mask.shape)} does not broadcast against {groups} groups "
                         f"of {query.shape[2]} rows over {window} keys")


def _launch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int, cells: torch.Tensor,
            mask: torch.Tensor, scale: float, window: int) -> tuple[torch.Tensor, int]:
    """The kernel of query's dtype on checked operands, ``layer`` in range: the output and the kernel's status (0;
    1 a cell out of range; 2 no scratch)."""
    groups, kv_heads, rows, head_dim = query.shape
    out = torch.empty(groups, kv_heads, rows, head_dim, dtype=query.dtype)
    offset = layer * key_cache.stride(0) * key_cache.element_size()
    kernels = library()
    failed = (kernels.paged_attention_f32 if query.dtype is torch.float32 else kernels.paged_attention_bf16)(
        query.data_ptr(), query.stride(0), query.stride(1), query.stride(2), key_cache.data_ptr() + offset,
        value_cache.data_ptr() + offset, key_cache.size(1) * key_cache.size(2), cells.data_ptr(), mask.data_ptr(),
        mask.stride(0) if mask.size(0) > 1 else 0, mask.stride(2) if mask.size(2) > 1 else 0, mask.stride(3),
        out.data_ptr(), groups, kv_heads, rows, window, head_dim, scale, torch.get_num_threads())
    return out, failed


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int,
            cells: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    _check(query, key_cache, value_cache, cells, mask)
    if query.stride(3) != 1:
        query = query.contiguous()
    if not cells.is_contiguous():
        cells = cells.contiguous()
    groups, kv_heads, rows, head_dim = query.shape
    layers, blocks, block_size = key_cache.shape[:3]
    window = cells.shape[0] // groups if groups else 0
    if not -layers <= layer < layers:
        raise IndexError(f"paged_attention: layer {layer} of a pool of {layers} layers")
    layer %= layers
    if not groups * kv_heads * rows * head_dim:
        return torch.empty(groups, kv_heads, rows, head_dim, dtype=query.dtype)
    scale = head_dim ** -0.5 if scale is None else scale
    out, failed = _launch(query, key_cache, value_cache, layer, cells, mask, scale, window)
    if failed == 1:
        raise IndexError(f"paged_attention: a cell outside the layer's pool of {blocks * block_size} cells "
                         f"(cells {int(cells.min())} .. {int(cells.max())})")
    if failed:
        raise MemoryError(f"paged_attention could not allocate scratch for {window} keys")
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int,
                    cells: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(query, gather(key_cache), gather(value_cache), attn_mask=mask, scale=scale)``
    with ``gather(c) = c[layer].flatten(0, 1).index_select(0, cells).view(G, -1, kv_heads, head_dim).transpose(1,
    2)`` (``recipes/attention.py`` ``gather_pages``), reading the pools in place: ``query [G, kv_heads, M,
    head_dim]``, pools ``[layers, blocks, block_size, kv_heads, head_dim]`` contiguous, ``cells [G * W]`` int64,
    ``mask`` broadcast against ``[G, 1, M, W]``; returns ``[G, kv_heads, M, head_dim]``. FP32: ``mask`` additive
    float32. BF16 (query and pools): ``mask`` boolean, True where hidden, and the attention ``recipes/attention.py``
    ``_eager_product``'s, its roundings to BF16 kept.
    Shown as ``ignition::paged_attention`` while a profiler runs."""
    if _profiling():
        with torch.profiler.record_function("ignition::paged_attention"):
            return _attend(query, key_cache, value_cache, layer, cells, mask, scale)
    return _attend(query, key_cache, value_cache, layer, cells, mask, scale)


def _graph_attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int,
                  cells: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    dtype = query.dtype
    if key_cache.dtype is not dtype or value_cache.dtype is not dtype or mask.dtype is not MASKS.get(dtype) or \
            query.stride(3) != 1 or \
            not cells.is_contiguous() or cells.dtype is not torch.int64 or not key_cache.is_contiguous() or \
            not value_cache.is_contiguous():
        return _attend(query, key_cache, value_cache, layer, cells, mask, scale)
    groups, kv_heads, rows, head_dim = query.shape
    window = cells.size(0) // groups if groups else 0
    if not groups or mask.size(3) != window or cells.size(0) != groups * window or key_cache.size(3) != kv_heads \
            or key_cache.size(4) != head_dim or not 0 <= layer < key_cache.size(0) or \
            value_cache.shape != key_cache.shape or mask.size(0) not in (1, groups) or mask.size(2) not in (1, rows):
        return _attend(query, key_cache, value_cache, layer, cells, mask, scale)  # refused there, by name
    out, failed = _launch(query, key_cache, value_cache, layer, cells, mask, scale, window)
    if failed:
        return _attend(query, key_cache, value_cache, layer, cells, mask, scale)  # refused there, by name
    return out


def graph_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int,
                          cells: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """What a rewritten graph calls: ``paged_attention`` with the checks ``rewrite`` made once on the graph's
    extents left out (a decode step makes one call a layer, and the checks cost about as much as the kernel at a
    short window), its layer in range and its scale a number; where a check that remains fails, or the kernel
    refuses a cell, ``paged_attention`` says why. Shown as ``ignition::paged_attention`` while a profiler runs."""
    if _profiling():
        with torch.profiler.record_function("ignition::paged_attention"):
            return _graph_attend(query, key_cache, value_cache, layer, cells, mask, scale)
    return _graph_attend(query, key_cache, value_cache, layer, cells, mask, scale)


GRAPH_CALLS = {graph_paged_attention: "ignition::paged_attention"}
"""The function rewritten graphs call, by the name a profiler shows it under."""


def _gather(node, dtype: torch.dtype = torch.float32) -> tuple[Node, int, Node, Node] | None:
    """``(pool, layer, cells, transpose)`` where ``node`` is ``gather_pages``' chain over a graph input's pool of
    ``dtype``: a ``transpose(1, 2)`` of a ``view`` of ``index_select(flatten(select(pool, 0, layer), 0, 1), 0,
    cells)``."""
    if not isinstance(node, Node) or node.target is not _aten.transpose.int or node.args[1:] != (1, 2):
        return None
    view = node.args[0]
    if view.target is not _aten.view.default or len(view.args[1]) != 4:
        return None
    gathered = view.args[0]
    if gathered.target is not _aten.index_select.default or gathered.args[1] != 0:
        return None
    flat = gathered.args[0]
    if flat.target is not _aten.flatten.using_ints or tuple(flat.args[1:]) != (0, 1):
        return None
    picked = flat.args[0]
    if picked.target is not _aten.select.int or picked.args[1] != 0 or not isinstance(picked.args[2], int):
        return None
    pool = picked.args[0]
    facts = pool.meta.get(FACTS)
    if pool.op != "placeholder" or facts is None or facts.dim() != 5 or facts.dtype != dtype:
        return None
    return pool, picked.args[2], gathered.args[2], node


def call_of(node, target, arguments: int | None = None) -> bool:
    """True where ``node`` calls ``target`` (with ``arguments`` positional arguments where given)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target is target and \
        (arguments is None or len(node.args) == arguments)


def _derives(node, source: Node, depth: int) -> bool:
    """True where ``node``'s first operands lead back to ``source`` within ``depth`` steps."""
    for _ in range(depth):
        if node is source:
            return True
        if not isinstance(node, Node) or not node.args:
            return False
        node = node.args[0]
    return node is source


_BF16_LOWEST = torch.finfo(torch.bfloat16).min


def _eager(node: Node) -> tuple[Node, tuple, tuple, Node, float] | None:
    """``(query, key gather, value gather, hidden, scale)`` where ``node`` is the mix product of
    ``recipes/attention.py`` ``_eager_product`` in BF16 over ``gather_pages`` windows: ``bmm(view(to(P, bf16)),
    reshape(values))`` with ``P`` ``softmax(S, -1, float32)`` (or ``_softmax_in_order``'s ``where(short, ·,
    softmax(S))``) and ``S`` ``masked_fill(view(mul(bmm(reshape(query), transpose(reshape(keys), 1, 2)), scale)),
    hidden, BF16 minimum)``, ``query [G, kv_heads, M, head_dim]`` of a fixed ``M`` of at most ``ROWS_LIMIT``."""
    if not (call_of(node, BMM, 2) or call_of(node, widened_bmm, 2)) or node.kwargs:
        return None
    weights, values = node.args
    if not call_of(weights, _aten.view.default) or not call_of(values, _aten.reshape.default):
        return None
    found_values = _gather(values.args[0], torch.bfloat16)
    rounded = weights.args[0]
    if found_values is None or not call_of(rounded, _aten.to.dtype, 2) or rounded.args[1] != torch.bfloat16:
        return None
    probs = rounded.args[0]
    if call_of(probs, _aten.where.self, 3):
        if not _derives(probs.args[1], probs.args[2].args[0] if isinstance(probs.args[2], Node) else None, 6):
            return None
        probs = probs.args[2]
    if not call_of(probs, _aten.softmax.int, 3) or probs.args[1:] != (-1, torch.float32):
        return None
    masked = probs.args[0]
    if not call_of(masked, _aten.masked_fill.Scalar, 3) or masked.args[2] != _BF16_LOWEST:
        return None
    scores, hidden = masked.args[:2]
    if not call_of(scores, _aten.view.default):
        return None
    scaled = scores.args[0]
    if not call_of(scaled, _aten.mul.Tensor, 2) or not isinstance(scaled.args[1], float):
        return None
    product = scaled.args[0]
    if not (call_of(product, BMM, 2) or call_of(product, widened_bmm, 2)):
        return None
    query, keys = product.args
    if not call_of(query, _aten.reshape.default) or not call_of(keys, _aten.transpose.int) or \
            keys.args[1:] != (1, 2) or not call_of(keys.args[0], _aten.reshape.default):
        return None
    found_keys = _gather(keys.args[0].args[0], torch.bfloat16)
    if found_keys is None or found_keys[1] != found_values[1] or found_keys[2] is not found_values[2]:
        return None
    query = query.args[0]
    facts = [getattr(argument, "meta", {}).get(FACTS) for argument in (query, hidden, node)]
    if any(fact is None for fact in facts) or facts[0].dtype != torch.bfloat16 or facts[0].dim() != 4 or \
            facts[1].dtype != torch.bool or facts[1].dim() != 4 or not all(isinstance(e, int) for e in facts[2].shape) \
            or not isinstance(facts[0].shape[2], int) or facts[0].shape[2] > ROWS_LIMIT:
        return None
    return query, found_keys, found_values, hidden, scaled.args[1]


def erase_unread(nodes) -> None:
    """Erase the ATen calls among ``nodes`` that nothing reads and that mutate nothing, and the ones above them that
    this leaves unread."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if not isinstance(node, Node) or node.op != "call_function" or node.users or \
                not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable or \
                getattr(node, "_erased", False) or node.is_impure():  # impure: an assertion, a random draw's state
            continue
        above = list(node.all_input_nodes)
        node.graph.erase_node(node)
        pending.extend(above)


def _layer(found: tuple[Node, int, Node, Node]) -> int:
    """The gather's layer in ``[0, layers)``, or as given where the pool's extent is unknown or it is out of range
    (``paged_attention`` refuses it)."""
    pool, layer = found[0], found[1]
    layers = pool.meta[FACTS].shape[0]
    return layer % layers if isinstance(layers, int) and -layers <= layer < layers else layer


def _scale(scale: float | None, query: Node) -> float:
    """SDPA's scale: as given, or ``head_dim ** -0.5``."""
    return float(query.meta[FACTS].shape[-1] ** -0.5 if scale is None else scale)


def rewrite(graph: Graph) -> int:
    """Point each FP32 ``scaled_dot_product_attention`` of ``graph`` over at most ``ROWS_LIMIT`` query rows whose keys
    and values are ``gather_pages`` of one layer's pools through the same cells, with an additive FP32 mask and no
    dropout, causal flag or grouped-query broadcast, and each BF16 eager attention over such windows (``_eager``), at
    ``paged_attention``; returns how many. Before the graph module's code is generated."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or len(node.args) != 4 or \
                set(node.kwargs) - {"scale"}:
            continue
        query, keys, values, mask = node.args
        found_keys, found_values = _gather(keys), _gather(values)
        if found_keys is None or found_values is None or found_keys[1] != found_values[1] or \
                found_keys[2] is not found_values[2]:
            continue
        facts = [getattr(argument, "meta", {}).get(FACTS) for argument in (query, mask)]
        if any(fact is None or fact.dtype != torch.float32 or fact.dim() != 4 for fact in facts) or \
                not isinstance(facts[0].shape[2], int) or facts[0].shape[2] > ROWS_LIMIT:
            continue
        with graph.inserting_before(node):
            call = graph.call_function(graph_paged_attention, (query, found_keys[0], found_values[0],
                                                               _layer(found_keys), found_keys[2], mask,
                                                               _scale(node.kwargs.get("scale"), query)))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        erase_unread([found_keys[3], found_values[3]])
        count += 1
    eager = [(node, found) for node in graph.nodes if (found := _eager(node)) is not None]
    for node, (query, found_keys, found_values, hidden, scale) in eager:  # BF16: the plan's nodes erased at the last
        with graph.inserting_before(node):
            call = graph.call_function(graph_paged_attention, (query, found_keys[0], found_values[0],
                                                               _layer(found_keys), found_keys[2], hidden, scale))
            shaped = graph.call_function(_aten.view.default, (call, list(node.meta[FACTS].shape)))
        call.meta[FACTS] = TensorFacts(torch.bfloat16, tuple(query.meta[FACTS].shape))
        shaped.meta.update(node.meta)
        node.replace_all_uses_with(shaped)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erase_unread(inputs)
        count += 1
    return count


__all__ = ["GRAPH_CALLS", "MASKS", "ROWS_LIMIT", "SDPA", "call_of", "erase_unread", "graph_paged_attention", "library",
           "paged_attention", "rewrite", "unavailable"]
