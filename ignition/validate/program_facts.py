"""What the graph rules read of a program, the same from either reader.

``validate-core`` loads each graph with ``torch.export.load`` (an ``ExportedProgram`` whose nodes carry
FakeTensors); the runtime reads it with ``program_reader.read_program`` (a ``StaticProgram`` whose nodes carry
``TensorFacts``). The signature, geometry and collective rules read both through ``ProgramFacts`` and
``tensor_facts``, so one set of rules judges what either reader built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ignition.validate.graph_json import FACTS, TensorFacts
from ignition.validate.program_reader import StaticProgram, argument_names


@dataclass(frozen=True, slots=True)
class ProgramFacts:
    graph: torch.fx.Graph
    argument_names: list[str] | None  # the keys of the call's one dict argument; None for another input tree
    inputs: list[tuple[str, TensorFacts | None]]  # user-input placeholders in call order, with their metadata
    outputs: list[TensorFacts | None]  # user outputs' metadata, in order
    bounds: dict[str, tuple[int, int | None]]  # shape symbol -> [lower, upper] (None: unbounded)


def tensor_facts(node) -> TensorFacts | None:
    """The dtype and extents of the tensor ``node`` produces, from whichever reader built it; None for a
    value that is not a tensor (or a node without metadata)."""
    if not isinstance(node, torch.fx.Node):
        return None
    facts = node.meta.get(FACTS)
    if facts is not None:
        return facts
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return TensorFacts(value.dtype, tuple(_extent(extent) for extent in value.shape))


def _extent(extent) -> int | str:
    """An int; a shape symbol's name; any other size expression as the program JSON writes it (``srepr``)."""
    if isinstance(extent, int):
        return extent
    expr = extent.node.expr
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return str(expr)
    import sympy

    return sympy.srepr(expr)


def program_facts(program) -> ProgramFacts:
    """``ProgramFacts`` of an ``ExportedProgram`` or a ``StaticProgram``."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    produced = {o.name: o for o in pytree.tree_leaves(output_node.args[0]) if isinstance(o, torch.fx.Node)}
    if isinstance(program, StaticProgram):
        names, user_inputs, user_outputs = program.argument_names, program.user_inputs, program.user_outputs
        bounds = dict(program.bounds)
    else:
        names = argument_names(program.call_spec.in_spec)
        user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        user_outputs = [s.arg.name for s in program.graph_signature.output_specs if s.kind.name == "USER_OUTPUT"]
        bounds = {str(symbol): (int(r.lower), int(r.upper) if r.upper.is_integer else None)
                  for symbol, r in program.range_constraints.items()}
    return ProgramFacts(
        graph=program.graph, argument_names=names,
        inputs=[(name, tensor_facts(placeholders.get(name))) for name in user_inputs],
        outputs=[tensor_facts(produced[name]) for name in user_outputs if name in produced],
        bounds=bounds)

