"""Ignition's program reader: an accepted ``.pt2``'s program as an FX graph module, straight from its JSON.

NOTE: ``torch.export.load`` spends most of a real-size core's load on metadata the runtime never reads. For
the five graphs of the 28-layer Qwen3-0.6B-shaped core (16,628 nodes) it builds a FakeTensor for every node's
output (9.3 s of 37 s under cProfile), parses every symbolic size with sympy (9.2 s), converts the JSON into
the export schema's dataclasses first (8.5 s), and then unlifts and regenerates each module's code several
times (5.5 s). ``read_program`` builds the same graph (the same nodes, targets, arguments and names, in the
same order: ``tests/test_program_reader.py`` compares the two readers' graphs and runs them bit for bit) from
the JSON document itself, and keeps each value's serialized metadata as data (``TensorFacts``) for the
validator's signature, geometry and collective rules (``validate/program_facts.py``).

It reads only what ``check_archive`` accepted, the validate-core rules of the runtime's load: static
programs whose inputs are the variant's named tensors, whose targets are allowed operators (``catalog/
operators.py``) or shape arithmetic, with no guards code, custom objects or pickles. Anything else in the
document (a signature entry other than a user input or output, an argument kind our graphs never hold) is a
``ProgramReadError`` naming it, never a guess. ``validate-core`` itself still loads every graph with
``torch.export.load`` (GRAPH-LOAD): a core must load in torch as well as here.
"""

from __future__ import annotations

import functools
import json
import keyword
import operator
import re
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ignition.validate.archive import CONSTANTS_CONFIG, CONSTANTS_DIR
from ignition.validate.program_json import SYMBOLIC_OPERATORS

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


@dataclass(slots=True)
class StaticProgram:
    """What ``read_program`` builds: the graph module (its placeholders the user inputs in call order) and what
    the validator's rules read of the signature."""

    graph_module: torch.fx.GraphModule
    argument_names: list[str] | None  # the keys of the one dict argument; None when the input tree is another
    user_inputs: list[str]  # placeholder names, in call order
    user_outputs: list[str]
    bounds: dict[str, tuple[int, int]]  # shape symbol -> its [min, max]
    out_spec: pytree.TreeSpec

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def module(self) -> torch.nn.Module:
        """The program called as ``torch.export``'s module is: ``module(buffers)`` with the dict of named tensors,
        returning the output tree."""
        if self.argument_names is None:
            raise ProgramReadError("the program's input tree is not one dict of named tensors")
        return ProgramModule(self.graph_module, self.argument_names, self.out_spec)


class ProgramModule(torch.nn.Module):
    """``forward(buffers)``: the graph on the buffers its placeholders name, in call order."""

    def __init__(self, graph_module: torch.fx.GraphModule, names: list[str], out_spec: pytree.TreeSpec):
        super().__init__()
        self.graph_module, self.names, self.out_spec = graph_module, list(names), out_spec
        self._single = out_spec.is_leaf()

    def forward(self, buffers: dict):
        result = self.graph_module(*[buffers[name] for name in self.names])
        if self._single:
            return result
        return pytree.tree_unflatten(list(result) if isinstance(result, (tuple, list)) else [result], self.out_spec)


def read_program(document: dict, members: dict[str, bytes] | None = None) -> StaticProgram:
    """The program of one ``models/model.json`` document (already accepted by ``check_archive``); ``members``:
    the archive's members by name under its root folder, where a lifted tensor constant's bytes are."""
    try:
        return _read(document, members or {})
    except ProgramReadError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise ProgramReadError(f"malformed program JSON: {type(exc).__name__}: {str(exc)[:160]}") from None


@dataclass(frozen=True, slots=True)
class _SerdeTables:
    dtypes: dict
    layouts: dict
    memory_formats: dict
    device: object  # JSON Device -> torch.device


@functools.cache
def _serde_tables():
    """torch's own decoding tables of the program JSON (dtype, layout and memory-format codes) and its device
    decoder, imported once."""
    from torch._export.serde import schema, serialize

    return _SerdeTables(serialize._SERIALIZE_TO_TORCH_DTYPE, serialize._SERIALIZE_TO_TORCH_LAYOUT,
                        serialize._SERIALIZE_TO_TORCH_MEMORY_FORMAT,
                        lambda d: serialize.deserialize_device(schema.Device(type=d.get("type"), index=d.get("index"))))


def _read(document: dict, members: dict[str, bytes]) -> StaticProgram:
    tables = _serde_tables()
    module_json = document["graph_module"]
    signature = module_json["signature"]
    user_inputs, user_outputs, constants = [], [], {}
    for spec in signature["input_specs"]:
        kinds = _kinds(spec)
        if kinds == ["tensor_constant"]:  # a tensor the trace made (torch.tensor([...])): an attribute, as unlifted
            constants[spec["tensor_constant"]["arg"]["name"]] = spec["tensor_constant"]["tensor_constant_name"]
            continue
        if kinds != ["user_input"] or "as_tensor" not in spec["user_input"]["arg"]:
            raise ProgramReadError(f"expected every input to be a user tensor or a tensor constant, found "
                                   f"{str(spec)[:120]}")
        user_inputs.append(spec["user_input"]["arg"]["as_tensor"]["name"])
    for spec in signature["output_specs"]:
        if _kinds(spec) != ["user_output"]:
            raise ProgramReadError(f"expected every output to be a user output (the graph writes its inputs in "
                                   f"place), found {str(spec)[:120]}")
        arg = spec["user_output"]["arg"]
        user_outputs.append(arg["as_tensor"]["name"] if "as_tensor" in arg else None)
    calls = module_json["module_call_graph"]
    if not calls or calls[0].get("fqn") != "":
        raise ProgramReadError("expected the module call graph's root entry")
    in_spec = pytree.treespec_loads(calls[0]["signature"]["in_spec"])
    out_spec = pytree.treespec_loads(calls[0]["signature"]["out_spec"])
    bounds = {name: (int(b["min_val"]), int(b["max_val"])) for name, b in (document.get("range_constraints") or
                                                                               {}).items()}
    root = torch.nn.Module()
    for fqn, tensor in _constants(members, set(constants.values()), tables.dtypes).items():
        root.register_buffer(fqn, tensor)
    reader = _GraphReader(root, tables, constants)
    graph = reader.graph_of(module_json["graph"])
    graph_module = torch.fx.GraphModule(reader.root, graph)
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if placeholders != user_inputs:
        raise ProgramReadError(f"the graph's inputs {placeholders[:4]}... are not the signature's user inputs")
    return StaticProgram(graph_module=graph_module, argument_names=argument_names(in_spec),
                         user_inputs=user_inputs, user_outputs=user_outputs, bounds=bounds, out_spec=out_spec)


def _constants(members: dict[str, bytes], wanted: set[str], dtypes: dict) -> dict[str, torch.Tensor]:
    """The lifted tensor constants ``wanted`` (by name), from the archive's raw constant files as torch reads
    them: a flat tensor of the file's bytes, viewed with the entry's sizes, strides and offset."""
    if not wanted:
        return {}
    if CONSTANTS_CONFIG not in members:
        raise ProgramReadError(f"the program lifts constants {sorted(wanted)} but the archive has no {CONSTANTS_CONFIG}")
    config = json.loads(members[CONSTANTS_CONFIG])["config"]
    tensors = {}
    for fqn in sorted(wanted):
        if not fqn.isidentifier():
            raise ProgramReadError(f"constant name {fqn[:80]!r} is not an attribute name")
        entry = config.get(fqn)
        if entry is None:
            raise ProgramReadError(f"constant {fqn!r} is not in {CONSTANTS_CONFIG}")
        meta = entry["tensor_meta"]
        dtype = dtypes[meta["dtype"]]
        sizes, strides = [int(s["as_int"]) for s in meta["sizes"]], [int(s["as_int"]) for s in meta["strides"]]
        data = members.get(CONSTANTS_DIR + entry["path_name"])
        if data is None:
            raise ProgramReadError(f"constant {fqn!r}: the archive has no {CONSTANTS_DIR}{entry['path_name']}")
        if not data:
            tensors[fqn] = torch.zeros(sizes, dtype=dtype)
            continue
        if len(data) % dtype.itemsize:
            raise ProgramReadError(f"constant {fqn!r}: {len(data)} bytes are not whole {dtype} elements")
        flat = torch.frombuffer(bytearray(data), dtype=dtype)
        tensors[fqn] = torch.as_strided(flat, sizes, strides, int(meta["storage_offset"]["as_int"]))
    return tensors


def argument_names(in_spec: pytree.TreeSpec) -> list[str] | None:
    """The keys of the call's one dict argument, in order; None for any other input tree."""
    args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    if kwargs or len(args) != 1 or not isinstance(args[0], dict):
        return None
    return list(args[0].keys())


def _resolve(target: str):
    """The operator a node's target string names: ``torch.ops.<namespace>.<name>[.<overload>]`` or one of the
    ``_operator`` shape-arithmetic functions; nothing else is looked up."""
    if target.startswith("_operator."):
        name = target.removeprefix("_operator.")
        if name not in SYMBOLIC_OPERATORS:
            raise ProgramReadError(f"target {target!r} is not one of the shape-arithmetic operators")
        return getattr(operator, name)
    match = _OPERATOR.fullmatch(target)
    if match is None:
        raise ProgramReadError(f"target {target[:80]!r} is not an operator")
    namespace, name, overload = match.groups()
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return packet if overload is None else getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise ProgramReadError(f"operator {target!r} is not registered in this torch") from None


class _GraphReader:
    """One graph (and, for ``cond`` branches, its subgraphs) as torch's deserializer builds it."""

    def __init__(self, root: torch.nn.Module, tables: _SerdeTables, constants: dict[str, str] | None = None):
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
        kinds = _kinds(arg)
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
        sub = _GraphReader(torch.nn.Module(), self.tables)  # a branch's own branches live under it, as in torch
        branch = torch.fx.GraphModule(sub.root, sub.graph_of(value["graph"]))
        self.root.register_module(value["name"], branch)
        return graph.create_node("get_attr", value["name"], name=value["name"])

    def _outputs(self, graph, nodes: dict, node: torch.fx.Node, outputs: list, *, hop: bool, single=True) -> None:
        if not outputs:
            return
        if hop and len(outputs) == 1 and not single and "as_none" not in _kinds(outputs[0]):
            self._getitem(graph, nodes, node, outputs[0], 0)
            return
        if len(outputs) == 1:
            only = outputs[0]
            kind = _kinds(only)
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
        kind = _kinds(item)
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
        kind = _kinds(spec)
        if kind == ["as_tensor"]:
            return self._node_named(nodes, spec["as_tensor"]["name"])
        if kind == ["as_sym_int"]:
            return self._node_named(nodes, spec["as_sym_int"]["as_name"])
        if kind in (["as_int"], ["as_float"], ["as_bool"]):
            return spec[kind[0]]
        if kind == ["as_none"] or not kind:
            return None
        raise ProgramReadError(f"graph output kind {kind} is not one an Ignition graph returns")


def _kinds(arg: dict) -> list[str]:
    return [k for k, v in arg.items() if v is not None]
