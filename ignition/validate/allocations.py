"""GRAPH-ALLOCATION: every tensor a graph creates from a size it names is bounded by the core's declared geometry.

A graph's creation operators (``aten.new_full``, ``zeros``, ``empty``, ``arange``, ...) and the operators that
grow a tensor by a size they name (``expand``, ``repeat``, ``pad``) take their extents as integer literals or as
shape symbols computed in the graph. Nothing else bounds them: ``new_full`` of a literal ``[10**13]`` passes every
signature rule and asks the allocator for 40 TB at run time. So each such size is bounded here, before anything
runs: a literal is itself, a shape symbol its ``range_constraints`` maximum, shape arithmetic (``_operator``) the
bound of its result, a compound size expression (``Add``, ``Mul``, ``Max``, ... of symbols and integers, as the
program writes it) the bound its parts give, and the elements it creates may not exceed ``ALLOCATION_HEADROOM``
times the elements of all the variant's declared buffers together (``allocation_bound``). A size that cannot be
bounded this way is refused too.
"""

from __future__ import annotations

import math
import operator
import re

import torch

from ignition.validate.program_facts import ProgramFacts, tensor_facts
from ignition.validate.report import Violation

_ATEN = torch.ops.aten
CREATION_SIZE = {_ATEN.new_full.default: 1, _ATEN.new_zeros.default: 1, _ATEN.new_ones.default: 1,
                 _ATEN.new_empty.default: 1, _ATEN.full.default: 0, _ATEN.zeros.default: 0, _ATEN.ones.default: 0,
                 _ATEN.empty.memory_format: 0, _ATEN.expand.default: 1}
"""Operators whose result's extents are the list argument at this position."""
_GROWING = (_ATEN.repeat.default, _ATEN.pad.default, _ATEN.arange.default, _ATEN.arange.start,
            _ATEN.arange.start_step)
_COMBINE = {operator.add: lambda a, b: a + b, operator.sub: lambda a, b: a + b, operator.mul: lambda a, b: a * b,
            operator.floordiv: lambda a, b: a, operator.mod: lambda a, b: b, operator.neg: lambda a: a}
"""Upper bounds of magnitudes: |a - b| <= |a| + |b|, |a // b| <= |a| for integer b != 0, |a % b| < |b|."""


ALLOCATION_HEADROOM = 64
"""Scratch a graph may create beyond its declared buffers: a chunk's attention scores and masks (``[heads, rows,
keys]``) exceed the buffers of a small core (the tiny test cores' 200-row chunks: 1.1x); a literal size such as
``10**13`` stays far outside any core's bound."""


def allocation_bound(variant: dict) -> int:
    """The most elements one allocation of ``variant``'s graph may create: ``ALLOCATION_HEADROOM`` times all its
    declared buffers together."""
    declared = sum(math.prod(d["shape"]) for d in variant["arguments"]) + sum(math.prod(r["shape"])
                                                                              for r in variant["returns"])
    return ALLOCATION_HEADROOM * declared


def allocation_violations(facts: ProgramFacts, variant: dict, where: str) -> list[Violation]:
    """A GRAPH-ALLOCATION violation for each node of the graph whose created elements exceed, or cannot be
    bounded by, ``allocation_bound(variant)``."""
    bound = allocation_bound(variant)
    found, sizes = [], _SizeBounds(facts)
    for node in facts.graph.nodes:
        if node.op != "call_function":
            continue
        created = _created(node, sizes)
        if node.target in CREATION_SIZE or node.target in _GROWING:
            if created is None or created > bound:
                what = "cannot be bounded" if created is None else f"creates up to {created:,} elements"
                found.append(Violation("GRAPH-ALLOCATION", f"{where}: node {node.name}",
                                       f"{node.target} {what}; expected at most {bound:,} ({ALLOCATION_HEADROOM} times "
                                       "all the variant's declared buffers together)"))
    return found


def _created(node: torch.fx.Node, sizes: "_SizeBounds") -> int | None:
    """Upper bound of the elements ``node`` creates, or None when unknown."""
    args = node.args
    if node.target in CREATION_SIZE:
        position = CREATION_SIZE[node.target]
        extents = args[position] if len(args) > position else node.kwargs.get("size")
        return sizes.product(extents)
    if node.target in (_ATEN.arange.default, _ATEN.arange.start, _ATEN.arange.start_step):
        ends = [sizes.upper(value) for value in args[:2]]
        return None if None in ends else sum(ends)
    if node.target == _ATEN.repeat.default:
        source = sizes.elements(args[0])
        factor = sizes.product(args[1])
        return None if source is None or factor is None else source * factor
    if node.target == _ATEN.pad.default:
        widths = sizes.product([1 + sizes.upper(p) if sizes.upper(p) is not None else None for p in args[1]])
        extents = tensor_facts(args[0])
        if extents is None or widths is None:
            return None
        grown = 1
        for extent in extents.shape:
            grown *= sizes.upper(extent) or 0
        return grown * widths if grown else None
    return None


class _SizeBounds:
    """Upper bounds of the integers a graph computes its sizes from."""

    def __init__(self, facts: ProgramFacts):
        self.facts = facts
        self.cache: dict[str, int | None] = {}

    def upper(self, value) -> int | None:
        if type(value) is int:
            return abs(value)
        if isinstance(value, str):  # a tensor extent: a shape symbol's name, or a compound expression
            bounds = self.facts.bounds.get(value)
            if bounds is not None:
                return bounds[1]
            return _expression_upper(value, self.facts.bounds) if value.endswith(")") else None
        if not isinstance(value, torch.fx.Node):
            return None
        if value.name not in self.cache:
            self.cache[value.name] = None  # a cycle cannot occur in a graph; this only guards re-entry
            self.cache[value.name] = self._node_upper(value)
        return self.cache[value.name]

    def _node_upper(self, node: torch.fx.Node) -> int | None:
        if node.target == _ATEN.sym_size.int:
            tensor = tensor_facts(node.args[0])
            dim = node.args[1]
            if tensor is None or type(dim) is not int or not -tensor.dim() <= dim < tensor.dim():
                return None
            return self.upper(tensor.shape[dim])
        combine = _COMBINE.get(node.target)
        if combine is None or node.kwargs:
            return None
        bounds = [self.upper(arg) for arg in node.args]
        return None if None in bounds or len(bounds) not in (1, 2) else combine(*bounds)

    def product(self, extents) -> int | None:
        if not isinstance(extents, (list, tuple)):
            return None
        total = 1
        for extent in extents:
            bound = self.upper(extent)
            if bound is None:
                return None
            total *= bound
        return total

    def elements(self, node) -> int | None:
        tensor = tensor_facts(node)
        return None if tensor is None else self.product(list(tensor.shape))


_TOKEN = re.compile(r"\s*(?:(?P<call>[A-Za-z]+)\(|(?P<text>'[^']*')|(?P<int>-?\d+)|(?P<keyword>\w+=\w+)|(?P<close>\))|,)")
_EXPRESSION_UPPER = {"Add": sum, "Mul": math.prod, "Max": max, "Min": min, "FloorDiv": lambda parts: parts[0],
                     "PythonMod": lambda parts: parts[1], "Mod": lambda parts: parts[1]}
"""Upper bounds of a size expression's magnitude from its arguments' (``srepr`` function names)."""


def _expression_upper(text: str, bounds: dict) -> int | None:
    """Upper bound of a size expression written as ``sympy.srepr`` writes it (``Add(Symbol('s0', ...),
    Integer(1))``), read token by token (nothing is evaluated); None for any other function or an unbounded
    symbol."""
    position, stack = 0, [["", []]]
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            return None
        position = match.end()
        if match["call"]:
            stack.append([match["call"], []])
        elif match["text"] is not None and stack[-1][0] == "Symbol" and not stack[-1][1]:
            bound = bounds.get(match["text"][1:-1])
            if bound is None or bound[1] is None:
                return None
            stack[-1][1].append(bound[1])
        elif match["int"] is not None and stack[-1][0] == "Integer":
            stack[-1][1].append(abs(int(match["int"])))
        elif match["close"]:
            if len(stack) < 2:
                return None
            name, parts = stack.pop()
            if name in ("Symbol", "Integer") and len(parts) == 1:
                stack[-1][1].append(parts[0])
            elif name in _EXPRESSION_UPPER and parts:
                stack[-1][1].append(_EXPRESSION_UPPER[name](parts))
            else:
                return None
    return stack[0][1][0] if len(stack) == 1 and len(stack[0][1]) == 1 else None
