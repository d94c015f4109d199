"""Ignition's program reader: an accepted ``.pt2``'s program as an FX graph module, straight from its JSON.

NOTE: ``torch.export.load`` spends most of a real-size core's load on metadata the runtime never reads. For
the five graphs of the 28-layer Qwen3-0.6B-shaped core (16,628 nodes) it builds a FakeTensor for every node's
output (9.3 s of 37 s under cProfile), parses every symbolic size with sympy (9.2 s), converts the JSON into
the export schema's dataclasses first (8.5 s), and then unlifts and regenerates each module's code several
times (5.5 s). ``read_program`` builds the same graph (the same nodes, targets, arguments and names, in the
same order: ``tests/test_program_reader.py`` compares the two readers' graphs and runs them bit for bit) from
the JSON document itself (each graph through ``validate/graph_json.GraphReader``), and keeps each value's
serialized metadata as data (``TensorFacts``) for the validator's signature, geometry and collective rules
(``validate/program_facts.py``).

It reads only what ``check_archive`` accepted, the validate-core rules of the runtime's load: static
programs whose inputs are the variant's named tensors, whose targets are allowed operators (``catalog/
operators.py``) or shape arithmetic, with no guards code, custom objects or pickles. Anything else in the
document (a signature entry other than a user input or output, an argument kind our graphs never hold) is a
``ProgramReadError`` naming it, never a guess. ``validate-core`` itself still loads every graph with
``torch.export.load`` (GRAPH-LOAD): a core must load in torch as well as here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ignition.validate.archive import CONSTANTS_CONFIG, CONSTANTS_DIR
from ignition.validate.graph_json import GraphReader, ProgramReadError, serde_tables, value_kinds


@dataclass(slots=True)
class StaticProgram:
    """What ``read_program`` builds: the graph (its placeholders the user inputs in call order) over the module
    that holds its constants and branches, and what the validator's rules read of the signature. The graph
    module (Python code generated from the graph) is built on first use, so a runtime pass that rewrites the
    graph first (``runtime/backends/packed_linear.py``) costs no second code generation."""

    root: torch.nn.Module  # lifted constants and ``cond`` branch modules, as the graph's get_attr nodes name them
    graph: torch.fx.Graph
    argument_names: list[str] | None  # the keys of the one dict argument; None when the input tree is another
    user_inputs: list[str]  # placeholder names, in call order
    user_outputs: list[str]
    bounds: dict[str, tuple[int, int]]  # shape symbol -> its [min, max]
    out_spec: pytree.TreeSpec
    _graph_module: torch.fx.GraphModule | None = None

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        if self._graph_module is None:
            self._graph_module = torch.fx.GraphModule(self.root, self.graph)
        return self._graph_module

    @property
    def module_built(self) -> bool:
        return self._graph_module is not None

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
        # the generated code itself: GraphModule.__call__ prints the failing line of it to stderr when an operator
        # raises straight from that code (a Python binding, runtime/backends/direct_calls.py), and the caller reports
        # the error, once, its own way
        result = self.graph_module.forward(*[buffers[name] for name in self.names])
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


def _read(document: dict, members: dict[str, bytes]) -> StaticProgram:
    tables = serde_tables()
    module_json = document["graph_module"]
    signature = module_json["signature"]
    user_inputs, user_outputs, constants = [], [], {}
    for spec in signature["input_specs"]:
        kinds = value_kinds(spec)
        if kinds == ["tensor_constant"]:  # a tensor the trace made (torch.tensor([...])): an attribute, as unlifted
            constants[spec["tensor_constant"]["arg"]["name"]] = spec["tensor_constant"]["tensor_constant_name"]
            continue
        if kinds != ["user_input"] or "as_tensor" not in spec["user_input"]["arg"]:
            raise ProgramReadError(f"expected every input to be a user tensor or a tensor constant, found "
                                   f"{str(spec)[:120]}")
        user_inputs.append(spec["user_input"]["arg"]["as_tensor"]["name"])
    for spec in signature["output_specs"]:
        if value_kinds(spec) != ["user_output"]:
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
    reader = GraphReader(root, tables, constants)
    graph = reader.graph_of(module_json["graph"])
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if placeholders != user_inputs:
        raise ProgramReadError(f"the graph's inputs {placeholders[:4]}... are not the signature's user inputs")
    return StaticProgram(root=reader.root, graph=graph, argument_names=argument_names(in_spec),
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
