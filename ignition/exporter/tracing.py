"""Tracing a recipe's graph with ``torch.export``: the example inputs and the windowed dynamic shapes.

Shared by the export stages that trace or re-trace a graph (export.py, onnx_export.py), so neither imports
the other.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ignition.catalog.buffers import MIN_WINDOW, WINDOWS
from ignition.catalog.enums import Role
from ignition.catalog.geometry import DYNAMIC_BLOCKS, PAGED_DIM, PAGED_STATE, WINDOW_PAGED_STATE


EXAMPLE_BLOCKS = 64
"""The most blocks a paged cache with a dynamic block count is traced with: its declared bound (``slots x
max_seq_len`` positions) can be far larger than the exporting machine's memory (a Qwen3-0.6B shape at 32,768
positions and 8 slots declares 60 GiB of FP32 K/V), and the traced program is the same at any count."""


def example_buffers(graph, weights: dict[str, torch.Tensor], paged: list[str] = ()) -> dict[str, torch.Tensor]:
    """Tracing inputs: real weights, zeros for everything the runtime binds or owns; each cache in ``paged``
    (``paged_arguments``) with at most ``EXAMPLE_BLOCKS`` blocks."""
    example = {}
    for a in graph.variant.arguments:
        if a.role is Role.WEIGHT:
            example[a.name] = weights[a.name]
        elif a.name in paged:
            shape = list(a.shape)
            shape[PAGED_DIM] = min(shape[PAGED_DIM], EXAMPLE_BLOCKS)
            example[a.name] = torch.zeros(shape, dtype=a.torch_dtype)
        else:
            example[a.name] = a.empty()
    return example


def dynamic_shapes(example: dict[str, torch.Tensor], windows: list[str], paged: list[str] = (),
                   declared: int | None = None) -> tuple[dict, dict] | None:
    """(tracing inputs, ``torch.export`` dynamic shapes) for a graph with windowed inputs or paged caches, else None.

    Each input the variant's ``layout["windows"]`` names is traced at a prefix shorter than its declared
    extent, so the extent stays symbolic over ``[MIN_WINDOW, declared]`` (``catalog.buffers.WINDOWS``). The block
    count of each paged cache ``paged`` is symbolic over ``[MIN_WINDOW, declared]`` too (the pool a load sizes,
    runtime/kv_pool.py; ``declared``: that bound, by default the example pools' count), traced at a count no window
    is traced at (equal hints would tie the symbols), at most the example pools' own."""
    if not windows and not paged:
        return None
    traced, shapes = dict(example), {name: None for name in example}
    for name in windows:
        dim, extent = WINDOWS[name].dim, example[name].shape[WINDOWS[name].dim]
        traced[name] = example[name].narrow(dim, 0, extent // 2)
        shapes[name] = {dim: torch.export.Dim(f"{name}_extent", min=MIN_WINDOW, max=extent)}
    if paged:
        held = example[paged[0]].shape[PAGED_DIM]
        declared = held if declared is None else declared
        hints = {traced[name].shape[WINDOWS[name].dim] for name in windows}
        hint = next(count for count in range(held, MIN_WINDOW - 1, -1) if count not in hints)
        for name in paged:  # NOTE: one symbol per pool: a shared one makes torch.export guard their equality
            traced[name] = example[name].narrow(PAGED_DIM, 0, hint).contiguous()  # a pool is one contiguous tensor
            shapes[name] = {PAGED_DIM: torch.export.Dim(f"{name}_blocks", min=MIN_WINDOW, max=declared)}
    return traced, shapes


def paged_arguments(variant) -> list[str]:
    """The paged caches a variant's graph takes with a dynamic block count (``DYNAMIC_BLOCKS``): the full layers'
    pools (the sliding layers' hold a fixed count, ``catalog.geometry.window_blocks_bound``)."""
    if not variant.layout.get(DYNAMIC_BLOCKS):
        return []
    return [a.name for a in variant.arguments
            if a.role is Role.STATE and a.name in PAGED_STATE and a.name not in WINDOW_PAGED_STATE]


def capture(graph, weights) -> torch.export.ExportedProgram:
    """``torch.export`` of the graph, without a Python stack trace per node: 4% of a tiny export's time,
    and paths of this checkout that would make two checkouts' cores differ."""
    paged = paged_arguments(graph.variant)
    example = example_buffers(graph, weights, paged)
    declared = next((a.shape[PAGED_DIM] for a in graph.variant.arguments if a.name in paged), None)
    windowed = dynamic_shapes(example, graph.variant.layout.get("windows", []), paged, declared)
    with _no_stack_traces():
        if windowed is None:
            program = torch.export.export(graph.module, (example,), strict=False)
        else:
            # NOTE: size-oblivious guards for the windows' backed extents (all at least MIN_WINDOW = 2). Without,
            # the contiguity query torch makes of every traced result guards a narrowed cache view of one KV head
            # a rank ([slots, 1, W, head_dim]) to W != max_seq_len, which the window's range refutes: a sharded
            # core whose ranks hold one KV head each and two or more slots failed to export.
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                program = torch.export.export(graph.module, (windowed[0],), strict=False,
                                              dynamic_shapes=(windowed[1],))
    program._example_inputs = None  # sample inputs would embed a copy of the weights in every .pt2
    _drop_metadata_asserts(program)
    return program


@contextmanager
def _no_stack_traces():
    """``torch.fx.config.do_not_emit_stack_traces`` for the duration (a plain module flag, no ``patch``)."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _drop_metadata_asserts(program: torch.export.ExportedProgram) -> None:
    """Erase the ``aten._assert_tensor_metadata`` nodes ``torch.export`` leaves after each ``.to()``.

    Each re-checks, on every replay, a dtype and device that the tracer saw and the declared arguments fix
    (GRAPH-SIGNATURE checks their dtypes at load), so they only cost time: one Python-dispatched node each,
    43 of a tiny decode step's 914 operators."""
    graph = program.graph_module.graph
    asserts = [node for node in graph.nodes
               if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in asserts:
        graph.erase_node(node)
    if asserts:
        program.graph_module.recompile()
