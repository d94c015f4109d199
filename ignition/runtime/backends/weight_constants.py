"""CPU replay: graph nodes that read only weights, computed once at load instead of at every replay.

A graph rebuilds what depends on its weights alone at every call: a row-parallel projection's weight viewed as its
leaves (``recipes/layers.py`` ``row_linear``: a ``view`` and a ``permute`` of ``o_proj`` and ``down_proj``), every
layer's q/k norm scales stacked once a forward and each layer's selected (``recipes/transformer.py``
``qk_norm_scales``). At Qwen3-0.6B's width that is about 150 operator calls of a decode step, each a few
microseconds between the GEMMs, for the same tensors every time.

``WeightConstants.rewrite`` finds, before a program's graph module is built, the nodes whose every input is a
weight argument or such a node and whose operator is a view or a concatenation (``FOLDED_TARGETS``), evaluates them
on uninitialized stand-ins of the declared shapes, and replaces each one a later node reads by a constant of the
graph module (``get_attr``). ``finish`` computes those constants from the loaded weights, once per distinct
expression across every variant: a view stays a view of the weight (no copy), a concatenation is a new tensor of at
most ``FOLDED_MAX_BYTES``. A program in which any such node feeds an operator that writes its input is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.node import Node, map_arg

from ignition.catalog.model import BufferDecl
from ignition.validate.program_reader import StaticProgram

_aten = torch.ops.aten
FOLDED_TARGETS = frozenset({
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default,
    _aten.transpose.int, _aten.t.default, _aten.select.int, _aten.slice.Tensor, _aten.narrow.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.unflatten.int,
    _aten.flatten.using_ints, _aten.stack.default, _aten.cat.default,
})
"""Operators folded over weights: views of them, and concatenations (which copy, so they are size-bounded)."""
COPYING_TARGETS = frozenset({_aten.stack.default, _aten.cat.default})
"""The folded operators whose result is a new tensor (at most ``FOLDED_MAX_BYTES``); every other one must return a
view (a ``reshape`` that would copy is left to the replay)."""
FOLDED_MAX_BYTES = 1 << 22
"""The largest result of a folded operator that copies (a concatenation): the q/k norm scales of a 28-layer Qwen3-0.6B
are 344 KiB; a folded copy of a whole weight would hold the weights twice."""


@dataclass(frozen=True, slots=True)
class Weight:
    """A weight argument, by name: a leaf of an expression."""

    name: str


@dataclass(frozen=True, slots=True)
class Apply:
    """``target(*args, **kwargs)`` over weights: a folded node, comparable across graphs."""

    target: torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs


def _frozen(value):
    """Lists as tuples, so an expression hashes and compares by value."""
    return tuple(_frozen(item) for item in value) if isinstance(value, (list, tuple)) else value


def _evaluate(value, weights: dict[str, torch.Tensor], cache: dict):
    if isinstance(value, Weight):
        return weights[value.name]
    if isinstance(value, Apply):
        if value not in cache:
            cache[value] = value.target(*_evaluate(value.args, weights, cache),
                                        **{name: _evaluate(item, weights, cache) for name, item in value.kwargs})
        return cache[value]
    if isinstance(value, tuple):
        return [_evaluate(item, weights, cache) for item in value]
    return value


class WeightConstants:
    """The weight-only nodes of every rewritten graph, as constants computed once per load (``finish``)."""

    def __init__(self):
        self.attributes: dict[Apply, str] = {}  # expression -> its graph-module attribute, shared by every graph
        self.programs: list[tuple[StaticProgram, list[tuple[str, Apply]]]] = []  # each rewritten program's constants
        self.stand_ins: dict[str, torch.Tensor] = {}  # ``_stand_in``, until ``finish``

    def rewrite(self, program: StaticProgram, weight_of: dict[Node, str], decls: dict[str, BufferDecl]) -> int:
        """Replace ``program``'s weight-only nodes that other nodes read by constants (``weight_of``: its weight
        placeholders and their names; ``decls``: the weights' declarations). Returns how many nodes it removed."""
        if program.module_built:
            raise ValueError("weight constants rewrite a program's graph before its graph module is built")
        graph = program.graph
        stand_in: dict[Node, torch.Tensor] = {node: self._stand_in(name, decls[name]) for node, name in weight_of.items()
                                              if any(user.target in FOLDED_TARGETS for user in node.users)}
        expression: dict[Node, object] = {node: Weight(name) for node, name in weight_of.items()}
        folded: list[Node] = []
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in FOLDED_TARGETS:
                continue
            inputs = node.all_input_nodes
            if not inputs or any(source not in stand_in for source in inputs):
                continue
            if node.target in COPYING_TARGETS and sum(stand_in[source].numel() * stand_in[source].element_size()
                                                      for source in inputs) > FOLDED_MAX_BYTES:
                continue
            try:
                value = node.target(*map_arg(node.args, stand_in.__getitem__),
                                    **map_arg(node.kwargs, stand_in.__getitem__))
            except (RuntimeError, TypeError, ValueError):  # not evaluable here: left to the replay
                continue
            if value._base is None and node.target not in COPYING_TARGETS:  # a view operator that copied (reshape)
                continue
            stand_in[node] = value
            expression[node] = Apply(node.target, _frozen(map_arg(node.args, expression.__getitem__)),
                                     tuple(sorted(_frozen(map_arg(node.kwargs, expression.__getitem__)).items())))
            folded.append(node)
        if not folded or any(_may_write(user) for node in folded for user in node.users):
            return 0
        inside = set(folded)
        constants = []
        for node in folded:
            if all(user in inside for user in node.users):
                continue
            attribute = self.attributes.setdefault(expression[node], f"_weight_constant_{len(self.attributes)}")
            if not hasattr(program.root, attribute):  # ``finish`` sets the value
                program.root.register_buffer(attribute, torch.empty(0), persistent=False)
                constants.append((attribute, expression[node]))
            with graph.inserting_before(node):
                constant = graph.get_attr(attribute)
            constant.meta = dict(node.meta)
            node.replace_all_uses_with(constant)
        for node in reversed(folded):
            graph.erase_node(node)
        self.programs.append((program, constants))
        return len(folded)

    def _stand_in(self, name: str, decl: BufferDecl) -> torch.Tensor:
        """An uninitialized tensor of weight ``name``'s declared shape and dtype, shared by every graph's rewrite: the
        rewrite runs the folded operators on it to learn their results' shapes and whether they are views (CPU
        operators cost microseconds where meta tensors cost milliseconds; its pages are never touched)."""
        if name not in self.stand_ins:
            self.stand_ins[name] = torch.empty(decl.shape, dtype=decl.torch_dtype)
        return self.stand_ins[name]

    def finish(self, weights: dict[str, torch.Tensor]) -> None:
        """Compute every constant from the loaded ``weights`` (each distinct expression once, shared by every graph
        that reads it) and give each rewritten graph module its constants. ``weights`` must still hold the tensors
        the graphs read raw (LinearPacks releases only weights no graph reads raw, and these graphs read them)."""
        self.stand_ins.clear()
        cache: dict = {}
        for program, constants in self.programs:
            for attribute, value in constants:
                setattr(program.graph_module, attribute, _evaluate(value, weights, cache))


def _may_write(user: Node) -> bool:
    """Whether ``user`` may write one of its inputs: an operator with a written argument or an in-place name, or a
    callable that is not an operator."""
    if user.op != "call_function":
        return False
    if not isinstance(user.target, torch._ops.OpOverload):
        return True
    schema = user.target._schema
    return schema.name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                            for a in schema.arguments)


__all__ = ["Apply", "COPYING_TARGETS", "FOLDED_MAX_BYTES", "FOLDED_TARGETS", "Weight", "WeightConstants"]
