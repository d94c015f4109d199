"""One graph of a program JSON as an FX graph, node for node as torch's deserializer builds it.

``program_reader.read_program`` reads a program's signature, constants and call tree and hands each graph (and
each ``cond`` branch) to ``GraphReader``: placeholders, call nodes with their operator resolved only among the
allowed namespaces and shape arithmetic, arguments positional or keyword by the operator's schema as torch orders
them, ``getitem`` nodes for several outputs, and every value's serialized metadata as ``TensorFacts`` under
``node.meta[FACTS]``. Decoding tables (dtype, layout, memory-format codes) decode torch's own schema enums.
"""

from __future__ import annotations

import functools
import keyword
import operator
import re
from dataclasses import dataclass

import torch

from ignition.catalog.operators import resolve_operator
from ignition.validate.program_json import SHAPE_LITERAL_BOUND, SYMBOLIC_OPERATORS

_SHAPE_ARITHMETIC = {name: getattr(operator, name) for name in SYMBOLIC_OPERATORS}

_OPERATOR = re.compile(r"torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?")
_SYMBOL = re.compile(r"Symbol\('(s[0-9]+)', positive=True, integer=True\)")
_POSITIONAL, _KEYWORD = 1, 2  # torch._export.serde.schema.ArgumentKind
_LIST_KINDS = ("as_ints", "as_bools", "as_strings")
FACTS = "ignition_facts"
"""The node-metadata key of a value's ``TensorFacts`` (torch's own loader keeps a FakeTensor under ``val``)."""


class ProgramReadError(ValueError):
    """The program JSON holds something this reader does not read; the message names it."""


@dataclass(frozen=True, slots=True)
class TensorFacts:
    """A value's serialized tensor metadata: its dtype and extents (an int, or a symbol's name such as ``s33``,
    or the text of a compound size expression)."""

    dtype: torch.dtype
    shape: tuple[int | str, ...]

    def dim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class SerdeTables:
    dtypes: dict
    layouts: dict
    memory_formats: dict
    device: object  # JSON Device -> torch.device


# The program JSON's enum members (torch._export.serde.schema, whose codes they name) -> the torch attribute each
# decodes to: what torch's serializer module holds as _SERIALIZE_TO_TORCH_DTYPE/_LAYOUT/_MEMORY_FORMAT
# (tests/test_program_reader.py pins them equal). Not imported from there: that module imports dynamo, sympy and
# mpmath, 1.2-2.3 s of a warm load_core in a fresh process and several seconds more on a cold disk.
_SCALAR_TYPES = {"BYTE": "uint8", "CHAR": "int8", "SHORT": "int16", "INT": "int32", "LONG": "int64",
                 "HALF": "float16", "FLOAT": "float32", "DOUBLE": "float64", "COMPLEXHALF": "complex32",
                 "COMPLEXFLOAT": "complex64", "COMPLEXDOUBLE": "complex128", "BOOL": "bool", "BFLOAT16": "bfloat16",
                 "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "FLOAT8E4M3FN": "float8_e4m3fn",
                 "FLOAT8E5M2": "float8_e5m2", "FLOAT8E4M3FNUZ": "float8_e4m3fnuz",
                 "FLOAT8E5M2FNUZ": "float8_e5m2fnuz", "FLOAT8E8M0FNU": "float8_e8m0fnu"}
_LAYOUTS = {"SparseCoo": "sparse_coo", "SparseCsr": "sparse_csr", "SparseCsc": "sparse_csc", "SparseBsr": "sparse_bsr",
            "SparseBsc": "sparse_bsc", "_mkldnn": "_mkldnn", "Strided": "strided"}
_MEMORY_FORMATS = {"ContiguousFormat": "contiguous_format", "ChannelsLast": "channels_last",
                   "ChannelsLast3d": "channels_last_3d", "PreserveFormat": "preserve_format"}


def _decoding(enum, attributes: dict[str, str]) -> dict:
    """Code -> torch value for each member of the schema's ``enum`` that this torch has."""
    return {enum[member].value: getattr(torch, attribute) for member, attribute in attributes.items()
            if member in enum.__members__ and hasattr(torch, attribute)}


def _device(value: dict) -> torch.device:
    return torch.device(value.get("type"), value.get("index"))


@functools.cache
def serde_tables():
    """The decoding tables of the program JSON (dtype, layout and memory-format codes, from torch's own schema
    enums) and its device decoder, built once."""
    from torch._export.serde import schema

    return SerdeTables(_decoding(schema.ScalarType, _SCALAR_TYPES), _decoding(schema.Layout, _LAYOUTS),
                       _decoding(schema.MemoryFormat, _MEMORY_FORMATS), _device)


def _resolve(target: str):
    """The operator a node's target string names: an exact entry of the operator allow-list (``catalog/
    operators.resolve_operator``, which looks the object up by the entry's own spelling) or one of the
    ``_operator`` shape-arithmetic functions; nothing else is looked up, and no attribute is read off a target."""
    if target.startswith("_operator."):
        name = target.removeprefix("_operator.")
        if name not in SYMBOLIC_OPERATORS:
            raise ProgramReadError(f"target {target!r} is not one of the shape-arithmetic operators")
        return _SHAPE_ARITHMETIC[name]
    if _OPERATOR.fullmatch(target) is None:
        raise ProgramReadError(f"target {target[:80]!r} is not an operator")
    resolved = resolve_operator(target)
    if resolved is None:
        raise ProgramReadError(f"operator {target!r} is not an allowed operator registered in this torch")
    return resolved


class GraphReader:
    """One graph (and, for ``cond`` branches, its subgraphs) as torch's deserializer builds it."""

    def __init__(self, root: torch.nn.Module, tables: SerdeTables, constants: dict[str, str] | None = None):
        self.root, self.tables = root, tables
        self.constants = constants or {}  # placeholder name -> the root attribute holding that constant
        self.values: dict[str, TensorFacts] = {}  # this graph's tensor names -> their metadata

    def graph_of(self, graph_json: dict) -> torch.fx.Graph:
        graph = torch.fx.Graph()
        nodes: dict[str, torch.fx.Node] = {}
        for name, meta in graph_json["tensor_values"].items():
            self.values[name] = self._facts(meta)
        for index, spec in enumerate(graph_json["inputs"]):
            if set(spec) != {"as_tensor"}:
                raise ProgramReadError(f"graph input {index}: expected a tensor, found {str(spec)[:80]}")
            name = spec["as_tensor"]["name"]
            attribute = self.constants.get(name)
            node = graph.placeholder(name) if attribute is None else graph.get_attr(attribute)
            self._sync(nodes, name, node)
        for node_json in graph_json["nodes"]:
            self._node(graph, nodes, node_json)
        outputs = [self._output(nodes, spec) for spec in graph_json["outputs"]]
        graph.output(outputs[0] if graph_json.get("is_single_tensor_return") else tuple(outputs))
        return graph

    def _facts(self, meta: dict) -> TensorFacts:
        shape = []
        for size in meta["sizes"]:
            if size.get("as_int") is not None:
                shape.append(int(size["as_int"]))
            else:
                text = size["as_expr"]["expr_str"]
                symbol = _SYMBOL.fullmatch(text)
                shape.append(symbol.group(1) if symbol else text)
        return TensorFacts(self.tables.dtypes[meta["dtype"]], tuple(shape))

    def _sync(self, nodes: dict, name: str, node: torch.fx.Node) -> None:
        if name in nodes:
            raise ProgramReadError(f"value {name!r} is defined twice")
        node.name = name
        nodes[name] = node
        facts = self.values.get(name)
        if facts is not None:
            node.meta[FACTS] = facts

    def _node(self, graph: torch.fx.Graph, nodes: dict, node_json: dict) -> None:
        target = _resolve(node_json["target"])
        inputs, outputs = node_json["inputs"], node_json["outputs"]
        if isinstance(target, torch._ops.OpOverload):
            args, kwargs = self._schema_arguments(target, inputs, nodes, graph)
            name = node_json.get("name") or None
            if name is None and len(outputs) == 1 and "as_tensor" in outputs[0] and len(target._schema.returns) == 1:
                name = outputs[0]["as_tensor"]["name"]
            node = graph.create_node("call_function", target, args, kwargs, name)
            self._outputs(graph, nodes, node, outputs, hop=False)
        elif isinstance(target, torch._ops.HigherOrderOperator):
            args, kwargs = [], {}
            for item in inputs:
                value = self._argument(item["arg"], nodes, graph)
                if item.get("kind") == _POSITIONAL or item.get("name") == "":
                    args.append(value)
                else:
                    kwargs[item["name"]] = value
            name = node_json.get("name") or None
            node = graph.create_node("call_function", target, tuple(args), kwargs, name)
            self._outputs(graph, nodes, node, outputs, hop=True,
                          single=node_json.get("is_hop_single_tensor_return", True))
        else:  # shape arithmetic on symbols: positional arguments
            name = node_json.get("name") or outputs[0]["as_sym_int"]["as_name"]
            args = tuple(self._argument(item["arg"], nodes, graph) for item in inputs)
            for value in args:
                if not (isinstance(value, torch.fx.Node) or (type(value) is int and abs(value) <= SHAPE_LITERAL_BOUND)):
                    raise ProgramReadError(f"{node_json['target']}: expected shape symbols and integer literals of "
                                           f"magnitude at most {SHAPE_LITERAL_BOUND}, found {str(value)[:40]!r}")
            node = graph.create_node("call_function", target, args, {}, name)
            self._sync(nodes, outputs[0]["as_sym_int"]["as_name"], node)

    def _schema_arguments(self, target, inputs: list, nodes: dict, graph: torch.fx.Graph):
        """Positional and keyword arguments by the operator's schema, as torch's ``deserialize_inputs`` orders them."""
        kinds = {item["name"]: item.get("kind") for item in inputs}
        actual = {item["name"]: self._argument(item["arg"], nodes, graph) for item in inputs}
        args, kwargs = [], {}
        for schema_arg in target._schema.arguments:
            name = schema_arg.name
            if name in actual:
                if kinds[name] == _POSITIONAL:
                    args.append(actual[name])
                    continue
                if kinds[name] == _KEYWORD and not keyword.iskeyword(name):
                    kwargs[name] = actual[name]
                    continue
            if not schema_arg.has_default_value() and not schema_arg.kwarg_only:
                if name not in actual:
                    raise ProgramReadError(f"{target}: required argument {name!r} is missing")
                args.append(actual[name])
            elif keyword.iskeyword(name):
                args.append(actual[name])
            elif name in actual:
                kwargs[name] = actual[name]
        unknown = set(actual) - {a.name for a in target._schema.arguments}
        if unknown:
            raise ProgramReadError(f"{target}: arguments {sorted(unknown)} are not in its schema")
        return tuple(args), kwargs

    def _argument(self, arg: dict, nodes: dict, graph: torch.fx.Graph):
        kinds = value_kinds(arg)
        if not kinds:
            kinds = list(arg)[:1]  # as_none's value is serialized as None or True
        if len(kinds) != 1:
            raise ProgramReadError(f"expected one argument kind, found {kinds}")
        kind, value = kinds[0], arg[kinds[0]]
        if kind == "as_none":
            return None
        if kind == "as_tensor":
            return self._node_named(nodes, value["name"])
        if kind in ("as_int", "as_bool", "as_string"):
            return value
        if kind == "as_float":  # torch writes infinities and NaN as the strings float() reads
            return float(value)
        if kind in _LIST_KINDS:
            return list(value)
        if kind == "as_floats":
            return [float(item) for item in value]
        if kind == "as_tensors":
            return [self._node_named(nodes, item["name"]) for item in value]
        if kind == "as_optional_tensors":
            return [None if "as_tensor" not in item or item["as_tensor"] is None
                    else self._node_named(nodes, item["as_tensor"]["name"]) for item in value]
        if kind == "as_sym_int":
            return self._sym(nodes, value)
        if kind == "as_sym_ints":
            return [self._sym(nodes, item) for item in value]
        if kind == "as_scalar_type":
            return self.tables.dtypes[value]
        if kind == "as_layout":
            return self.tables.layouts[value]
        if kind == "as_memory_format":
            return self.tables.memory_formats[value]
        if kind == "as_device":
            return self.tables.device(value)
        if kind == "as_graph":
            return self._subgraph(value, graph)
        raise ProgramReadError(f"argument kind {kind!r} is not one an Ignition graph holds")

    @staticmethod
    def _node_named(nodes: dict, name: str) -> torch.fx.Node:
        try:
            return nodes[name]
        except KeyError:
            raise ProgramReadError(f"value {name!r} is used before it is defined") from None

    def _sym(self, nodes: dict, value: dict):
        if value.get("as_int") is not None:
            return value["as_int"]
        return self._node_named(nodes, value["as_name"])

    def _subgraph(self, value: dict, graph: torch.fx.Graph) -> torch.fx.Node:
        """A ``cond`` branch: its own graph module under this graph's module, named as torch names it, read by
        get_attr."""
        sub = GraphReader(torch.nn.Module(), self.tables)  # a branch's own branches live under it, as in torch
        branch = torch.fx.GraphModule(sub.root, sub.graph_of(value["graph"]))
        self.root.register_module(value["name"], branch)
        return graph.create_node("get_attr", value["name"], name=value["name"])

    def _outputs(self, graph, nodes: dict, node: torch.fx.Node, outputs: list, *, hop: bool, single=True) -> None:
        if not outputs:
            return
        if hop and len(outputs) == 1 and not single and "as_none" not in value_kinds(outputs[0]):
            self._getitem(graph, nodes, node, outputs[0], 0)
            return
        if len(outputs) == 1:
            only = outputs[0]
            kind = value_kinds(only)
            if kind == ["as_tensor"]:
                self._sync(nodes, only["as_tensor"]["name"], node)
                return
            if kind == ["as_sym_int"]:
                self._sync(nodes, only["as_sym_int"]["as_name"], node)
                return
            if kind == ["as_none"] or not kind:
                node._rename(f"{graph._target_to_str(node.target)}_unused")
                return
            if kind == ["as_tensors"]:
                for index, item in enumerate(only["as_tensors"]):
                    self._getitem(graph, nodes, node, {"as_tensor": item}, index)
                return
        for index, item in enumerate(outputs):
            self._getitem(graph, nodes, node, item, index)

    def _getitem(self, graph, nodes: dict, node: torch.fx.Node, item: dict, index: int) -> None:
        kind = value_kinds(item)
        if kind == ["as_tensor"]:
            name = item["as_tensor"]["name"]
        elif kind == ["as_sym_int"]:
            name = item["as_sym_int"]["as_name"]
        elif kind == ["as_none"] or not kind:
            graph.create_node("call_function", operator.getitem, (node, index), name="as_none")
            return
        elif kind == ["as_tensors"]:
            inner = graph.create_node("call_function", operator.getitem, (node, index))
            for position, tensor in enumerate(item["as_tensors"]):
                self._getitem(graph, nodes, inner, {"as_tensor": tensor}, position)
            return
        else:
            raise ProgramReadError(f"output kind {kind} is not one an Ignition graph returns")
        picked = graph.create_node("call_function", operator.getitem, (node, index), name=name)
        self._sync(nodes, name, picked)

    def _output(self, nodes: dict, spec: dict):
        kind = value_kinds(spec)
        if kind == ["as_tensor"]:
            return self._node_named(nodes, spec["as_tensor"]["name"])
        if kind == ["as_sym_int"]:
            return self._node_named(nodes, spec["as_sym_int"]["as_name"])
        if kind in (["as_int"], ["as_float"], ["as_bool"]):
            return spec[kind[0]]
        if kind == ["as_none"] or not kind:
            return None
        raise ProgramReadError(f"graph output kind {kind} is not one an Ignition graph returns")


def value_kinds(arg: dict) -> list[str]:
    """The keys of a JSON union (an argument, output or signature entry) whose value is set."""
    return [k for k, v in arg.items() if v is not None]
