"""Tracing a recipe's graph with ``torch.export``: the example inputs and the windowed dynamic shapes.

Shared by the export stages that trace or re-trace a graph (export.py, onnx_export.py), so neither imports
the other.
"""

from __future__ import annotations

import torch

from ignition.catalog.buffers import MIN_WINDOW, WINDOWS
from ignition.catalog.enums import Role


def example_buffers(graph, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tracing inputs: real weights, zeros for everything the runtime binds or owns."""
    return {a.name: weights[a.name] if a.role is Role.WEIGHT else a.empty() for a in graph.variant.arguments}


def dynamic_shapes(example: dict[str, torch.Tensor], windows: list[str]) -> tuple[dict, dict] | None:
    """(tracing inputs, ``torch.export`` dynamic shapes) for a graph with windowed inputs, else None.

    Each input the variant's ``layout["windows"]`` names is traced at a prefix shorter than its declared
    extent, so the extent stays symbolic over ``[MIN_WINDOW, declared]`` (``catalog.buffers.WINDOWS``)."""
    if not windows:
        return None
    traced, shapes = dict(example), {name: None for name in example}
    for name in windows:
        dim, extent = WINDOWS[name].dim, example[name].shape[WINDOWS[name].dim]
        traced[name] = example[name].narrow(dim, 0, extent // 2)
        shapes[name] = {dim: torch.export.Dim(f"{name}_extent", min=MIN_WINDOW, max=extent)}
    return traced, shapes


def capture(graph, weights) -> torch.export.ExportedProgram:
    example = example_buffers(graph, weights)
    windowed = dynamic_shapes(example, graph.variant.layout.get("windows", []))
    if windowed is None:
        program = torch.export.export(graph.module, (example,), strict=False)
    else:
        program = torch.export.export(graph.module, (windowed[0],), strict=False, dynamic_shapes=(windowed[1],))
    program._example_inputs = None  # sample inputs would embed a copy of the weights in every .pt2
    return program
