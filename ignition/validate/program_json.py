"""PT2-PROGRAM: the serialized program (``models/model.json``) of an Ignition graph is static.

Three fields of that JSON become code when torch deserializes or unlifts the program:
``guards_code`` strings are ``exec``'d by ``ExportedProgram.module()``; every ``expr_str``
(symbolic shapes, range constraints) goes through ``sympy.sympify``, which ``eval``s; and a
placeholder holding a string constant is pasted into generated guard code. Our graphs take
one dict of tensors of fixed shapes, except the windowed inputs (``catalog.buffers.WINDOWS``),
whose extent is one symbol: so no guards code may appear, every expression must be integer
arithmetic (sum, product, min, max, floor division, modulo, square) of literals and shape symbols, which
sympify can only build, never run code from, and range constraints must be integer bounds of such
symbols. Node targets are limited to operator namespaces we emit (PT2-PROGRAM), plus a fixed list
of ``_operator`` functions on shape symbols and bounded integer literals, and within them to the exact
operator overloads the recipes emit (GRAPH-OPERATOR, ``ignition/catalog/operators.py``: ``aten.from_file`` and
its kind can write files; ``aten.slice_scatter.__init__`` is no overload);
pytree specs to the plain containers our signature uses.
"""

from __future__ import annotations

import json
import re

from ignition.catalog.limits import INT32_MAX
from ignition.catalog.operators import OPERATOR_NAMESPACES as OP_NAMESPACES, operator_refusal
from ignition.validate.report import Violation
_TARGET = re.compile(rf"torch\.ops\.({'|'.join(OP_NAMESPACES)})\.[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")
_SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict"}
_REPORT_AT_MOST = 5
_SYMBOL_NAME = re.compile(r"s[0-9]{1,6}")
_ATOM = re.compile(r"Symbol\('s[0-9]{1,6}', positive=True, integer=True\)|Integer\(-?[0-9]{1,12}\)")
_SQUARE_EXPONENT = "Integer(2)"  # reduced to "2": an operand anywhere, and the only exponent of a power
_NODE = re.compile(r"(?:(?:Mul|Add|Min|Max)\([X2](?:, [X2])+\))|(?:(?:FloorDiv|Mod)\([X2], [X2]\))|(?:Pow\([X2], 2\))")
SYMBOLIC_OPERATORS = ("add", "sub", "mul", "floordiv", "mod", "neg", "lt", "le", "gt", "ge", "eq", "ne")
"""``_operator`` functions a graph may call on shape symbols (torch maps the names to functions; nothing is evaluated)."""
_SYMBOLIC_TARGET = re.compile(rf"_operator\.({'|'.join(SYMBOLIC_OPERATORS)})")
_MAX_EXPRESSION = 400
SHAPE_LITERAL_BOUND = INT32_MAX
"""The largest integer literal (in magnitude) a shape-arithmetic node takes: every extent fits in int32."""


def symbolic_expression_allowed(text) -> bool:
    """True when ``text`` is a tree of ``Add``/``Mul``/``Min``/``Max``/``FloorDiv``/``Mod`` and squares (``Pow(e,
    Integer(2))``: a square block of a windowed extent, as the delta rule's one block of a dynamic chunk) over
    ``Integer(n)`` and ``Symbol('sN', positive=True, integer=True)``. No other power: sympify would evaluate
    ``Pow(Integer(2), Integer(99999999))``."""
    if not isinstance(text, str) or len(text) > _MAX_EXPRESSION:
        return False
    reduced = _ATOM.sub(lambda atom: "2" if atom.group(0) == _SQUARE_EXPONENT else "X", text)
    while True:
        shorter = _NODE.sub("X", reduced)
        if shorter == reduced:
            return reduced in ("X", "2")
        reduced = shorter


def _range_constraints_allowed(constraints) -> bool:
    """Integer bounds of plain shape symbols: ``{"s72": {"min_val": 2, "max_val": 512}}``."""
    return isinstance(constraints, dict) and all(
        isinstance(name, str) and _SYMBOL_NAME.fullmatch(name) and isinstance(bounds, dict)
        and set(bounds) == {"min_val", "max_val"}
        and all(isinstance(v, int) and not isinstance(v, bool) for v in bounds.values())
        for name, bounds in constraints.items())


def program_violations(document, at: str) -> list[Violation]:
    """Every reason torch could execute code while loading or unlifting this program; [] when none."""
    def bad(message: str) -> Violation:
        return Violation("PT2-PROGRAM", at, message)

    if not isinstance(document, dict) or not isinstance(document.get("graph_module"), dict):
        return [bad("expected an object with a graph_module")]
    found = []
    if document.get("guards_code") not in (None, []):
        found.append(bad(f"expected no guards_code (torch execs it), found {str(document['guards_code'])[:80]}"))
    if document.get("range_constraints") not in (None, {}) and \
            not _range_constraints_allowed(document["range_constraints"]):
        found.append(bad("expected range_constraints to be integer bounds of shape symbols (torch sympifies them), "
                         f"found {str(document['range_constraints'])[:80]}"))
    graph = document["graph_module"].get("graph")
    inputs = graph.get("inputs") if isinstance(graph, dict) else None
    if not isinstance(inputs, list):
        return found + [bad("expected graph_module.graph.inputs to be a list")]
    for index, arg in enumerate(inputs):
        if not (isinstance(arg, dict) and set(arg) == {"as_tensor"}):
            found.append(bad(f"graph input {index}: expected a tensor, found {str(arg)[:80]}"))
    found += _walk(document, bad, at)
    return found


_CONTAINERS = (dict, list)
_CHECKED_KEYS = frozenset({"as_custom_obj", "custom_obj_values", "inputs", "as_operator", "in_spec", "out_spec"})
"""The keys ``_node_violations`` reads: a node with none of them (most are tensor metadata) has nothing to check."""


def _walk(document, bad, at: str) -> list[Violation]:
    """One iterative pass over the whole tree (nested subgraphs included), without recursion."""
    found: list[Violation] = []
    stack = [document]
    while stack and len(found) < _REPORT_AT_MOST:
        node = stack.pop()
        if type(node) is list:  # json.loads builds exact lists and dicts; only containers are pushed
            stack.extend([item for item in node if type(item) in _CONTAINERS])
            continue
        if "expr_str" in node and not symbolic_expression_allowed(node["expr_str"]):
            found.append(bad(f"expected static shapes or sums and products of integers and shape symbols, found the "
                             f"symbolic expression {str(node['expr_str'])[:80]!r} (torch parses it with sympify, "
                             "which evaluates Python)"))
        if not node.keys().isdisjoint(_CHECKED_KEYS):
            found += _node_violations(node, bad, at)
        stack.extend([value for value in node.values() if type(value) in _CONTAINERS])
    return found


def _node_violations(node: dict, bad, at: str) -> list[Violation]:
    """A node's custom objects, operators and pytree specs (``_walk``)."""
    found = []
    if node.get("as_custom_obj") is not None or node.get("custom_obj_values"):
        found.append(bad("expected no custom objects (torch unpickles them)"))
    target = node.get("target") if "inputs" in node and "outputs" in node else None
    for operator in (target, node.get("as_operator")):  # a node's target, or an operator passed as an argument
        if operator is None:
            continue
        if operator is target and isinstance(target, str) and _SYMBOLIC_TARGET.fullmatch(target):
            found += _shape_arithmetic_violations(node, bad)  # torch maps these names to fixed functions
            continue
        if not (isinstance(operator, str) and _TARGET.fullmatch(operator)):
            found.append(bad(f"operator {str(operator)[:80]!r} is not an operator in the allowed namespaces "
                             f"{', '.join(OP_NAMESPACES)}"))
        elif (refusal := operator_refusal(operator)) is not None:
            found.append(Violation("GRAPH-OPERATOR", at, refusal))
    for key in ("in_spec", "out_spec"):
        if isinstance(node.get(key), str):
            found += _spec_violations(node[key], key, bad)
    return found


def _shape_arithmetic_violations(node: dict, bad) -> list[Violation]:
    """A shape-arithmetic node computes on shape symbols and integer literals of at most ``SHAPE_LITERAL_BOUND``;
    any other argument (a string, a list, a huge integer) would make ``_operator.mul`` build whatever it likes."""
    found = []
    for item in node["inputs"] if isinstance(node["inputs"], list) else [None]:
        arg = item.get("arg") if isinstance(item, dict) else None
        if not _shape_argument(arg):
            found.append(bad(f"{node['target']}: expected a shape symbol or an integer literal of magnitude at most "
                             f"{SHAPE_LITERAL_BOUND}, found {str(arg)[:80]}"))
    return found


def _shape_argument(arg) -> bool:
    if not isinstance(arg, dict) or len([v for v in arg.values() if v is not None]) != 1:
        return False
    kind, value = next((k, v) for k, v in arg.items() if v is not None)
    if kind == "as_sym_int" and isinstance(value, dict) and len(value) == 1:
        kind, value = next(iter(value.items()))
        if kind == "as_name":
            return isinstance(value, str)
    return kind == "as_int" and type(value) is int and abs(value) <= SHAPE_LITERAL_BOUND


def _spec_violations(text: str, key: str, bad) -> list[Violation]:
    """Pytree specs name container types that torch rebuilds; ours use plain tuples, lists and dicts."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return [bad(f"{key}: expected a JSON pytree spec, found {type(exc).__name__}")]
    found, stack = [], [spec]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if "type" in item and item["type"] not in _SPEC_TYPES:
                found.append(bad(f"{key}: expected only tuple, list and dict containers, found {str(item['type'])[:80]}"))
                break
            stack.extend(v for k, v in item.items() if k != "context")
    return found
