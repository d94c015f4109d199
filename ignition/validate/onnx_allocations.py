"""GRAPH-ALLOCATION for ONNX graphs: a tensor created or grown from constant sizes is bounded by the geometry.

The ONNX twin of ``validate/allocations.py``. ``ConstantOfShape`` of a constant shape ``[10**13]`` wired into an
output parses, passes the checker and every signature rule, and asks onnxruntime for 40 TB when it runs. So every
``ConstantOfShape``, ``Expand``, ``Tile`` and ``Range`` whose size inputs are constants (initializers held in the
file, or ``Constant`` nodes) may create at most ``allocation_bound(variant)`` elements: all the variant's declared
buffers together. Sizes computed from the inputs follow the inputs' declared shapes, which the ONNX-INPUTS rule
fixes.
"""

from __future__ import annotations

import math

from ignition.validate.allocations import allocation_bound
from ignition.validate.report import Violation


def _graphs(model) -> list:
    """The model's graph and every subgraph (``If``/``Loop``/``Scan`` bodies), without recursion."""
    found, pending = [], [model.graph]
    while pending:
        graph = pending.pop()
        found.append(graph)
        pending += [a.g for node in graph.node for a in node.attribute if a.HasField("g")]
        pending += [g for node in graph.node for a in node.attribute for g in a.graphs]
    return found


def _constants(graphs: list) -> dict[str, list]:
    """Name -> the flat integer values of every constant small enough to be a size (at most 64 values)."""
    from onnx import numpy_helper

    found = {}
    tensors = [(t.name, t) for graph in graphs for t in graph.initializer if not t.external_data]
    for node in (node for graph in graphs for node in graph.node):
        if node.op_type == "Constant" and node.output:
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.HasField("t"):
                    tensors.append((node.output[0], attribute.t))
                elif attribute.name in ("value_int", "value_ints"):
                    found[node.output[0]] = [attribute.i] if attribute.name == "value_int" else list(attribute.ints)
    for name, tensor in tensors:
        if math.prod(tensor.dims) <= 64:
            try:
                found[name] = [v.item() for v in numpy_helper.to_array(tensor).reshape(-1)]
            except (ValueError, TypeError):
                continue
    return found


def _declared_elements(model) -> dict[str, int]:
    """Name -> the element count of each graph input or value whose shape the file states with fixed extents."""
    found = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            found[value.name] = math.prod(d.dim_value for d in dims)
    return found


def _created(node, constants: dict[str, list], declared: dict[str, int]) -> int | None:
    """Elements the node creates when its size inputs are constants; None when they are not (or it is another op)."""
    inputs = list(node.input)
    if node.op_type == "ConstantOfShape" and inputs and inputs[0] in constants:
        return math.prod(abs(int(v)) for v in constants[inputs[0]])
    if node.op_type == "Expand" and len(inputs) == 2 and inputs[1] in constants:
        return max(math.prod(abs(int(v)) for v in constants[inputs[1]]), declared.get(inputs[0], 1))
    if node.op_type == "Tile" and len(inputs) == 2 and inputs[1] in constants:
        return math.prod(abs(int(v)) for v in constants[inputs[1]]) * declared.get(inputs[0], 1)
    if node.op_type == "Range" and len(inputs) == 3 and all(name in constants for name in inputs):
        start, limit, delta = (constants[name][0] for name in inputs)
        return max(0, math.ceil((limit - start) / delta)) if delta else None
    return None


def onnx_allocation_violations(model, variant: dict, where: str) -> list[Violation]:
    """GRAPH-ALLOCATION findings of one ONNX graph (nodes of nested subgraphs included)."""
    bound = allocation_bound(variant)
    graphs = _graphs(model)
    constants, declared = _constants(graphs), _declared_elements(model)
    found = []
    for graph in graphs:
        for node in graph.node:
            created = _created(node, constants, declared)
            if node.op_type == "Range" and created is None and all(name in constants for name in node.input):
                created = bound + 1  # a zero step never ends
            if created is not None and created > bound:
                found.append(Violation("GRAPH-ALLOCATION", f"{where}: node {node.name or node.op_type}",
                                       f"{node.op_type} creates up to {created:,} elements; expected at most "
                                       f"{bound:,} (all the variant's declared buffers together)"))
    return found
