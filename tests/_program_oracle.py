"""The program reader's oracle: torch.export.load of the same archive.

``assert_same_program`` compares what ``validate/program_reader.read_program`` built from a ``.pt2`` with what
``torch.export.load`` built: every graph module (cond branches too) node by node (kind, name, target, positional
and keyword arguments with nodes named), the generated code of the root graph, and every fact the graph rules
read (``program_facts``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.fx.node import map_aggregate

from ignition.validate.archive import accept_archive
from ignition.validate.graphs import _load_accepted_program
from ignition.validate.program_facts import program_facts, tensor_facts
from ignition.validate.program_reader import StaticProgram, read_program


def read_both(path: Path) -> tuple[StaticProgram, torch.export.ExportedProgram]:
    data = path.read_bytes()
    refused, accepted = accept_archive(data, path.name)
    assert not refused, refused
    return read_program(accepted.document, accepted.members), _load_accepted_program(data)


def _named(value):
    return map_aggregate(value, lambda x: ("node", x.name) if isinstance(x, torch.fx.Node) else x)


def _modules(root: torch.nn.Module) -> dict[str, torch.fx.GraphModule]:
    return {name: m for name, m in root.named_modules() if isinstance(m, torch.fx.GraphModule)}


def assert_same_program(ours: StaticProgram, theirs: torch.export.ExportedProgram, where: str) -> None:
    """The same graphs; a lifted tensor constant, a placeholder in torch's lifted graph, is the attribute its
    unlifted module reads (get_attr) in ours, holding the same tensor."""
    constants = {s.arg.name: s.target for s in theirs.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
    for node_name, fqn in constants.items():
        assert torch.equal(getattr(ours.graph_module, fqn), theirs.constants[fqn]), (where, fqn)
    ours_modules, their_modules = _modules(ours.graph_module), _modules(theirs.graph_module)
    assert sorted(ours_modules) == sorted(their_modules), (where, sorted(ours_modules), sorted(their_modules))
    for name, module in ours_modules.items():
        mine, other = list(module.graph.nodes), list(their_modules[name].graph.nodes)
        assert len(mine) == len(other), (where, name)
        for a, b in zip(mine, other):
            if b.name in constants and name == "":
                assert (a.op, a.name, a.target) == ("get_attr", b.name, constants[b.name]), (where, a.format_node())
                continue
            assert (a.op, a.name, a.target) == (b.op, b.name, b.target), (where, a.format_node(), b.format_node())
            assert _named(a.args) == _named(b.args), (where, a.format_node(), b.format_node())
            assert _named(a.kwargs) == _named(b.kwargs), (where, a.format_node(), b.format_node())
            if "val" in b.meta and isinstance(b.meta["val"], torch.Tensor):
                assert tensor_facts(a) == tensor_facts(b), (where, a.name, tensor_facts(a), tensor_facts(b))
    if not constants:
        assert ours.graph_module.code == theirs.graph_module.code, where
    mine, other = program_facts(ours), program_facts(theirs)
    assert (mine.argument_names, mine.inputs, mine.outputs) == (other.argument_names, other.inputs, other.outputs)
    assert mine.bounds == other.bounds, where


def zeroed_buffers(program: torch.export.ExportedProgram, weights: dict[str, torch.Tensor]) -> dict:
    """The program's arguments: the core's weights by name, every other input zeroed at its declared extents
    (a window at its upper bound)."""
    facts = program_facts(program)
    buffers = {}
    for name, (_, tensor) in zip(facts.argument_names, facts.inputs):
        if name in weights:
            buffers[name] = weights[name].clone()
            continue
        shape = [extent if isinstance(extent, int) else facts.bounds[extent][1] for extent in tensor.shape]
        buffers[name] = torch.zeros(shape, dtype=tensor.dtype)
    return buffers


def assert_same_run(ours: StaticProgram, theirs: torch.export.ExportedProgram, weights: dict, where: str) -> None:
    """Both modules on the same buffers: the same returns and the same writes, bit for bit."""
    mine = zeroed_buffers(theirs, weights)
    other = {name: tensor.clone() for name, tensor in mine.items()}
    result = ours.module()(mine)
    expected = theirs.module()(other)
    torch.testing.assert_close(result, expected, rtol=0, atol=0, equal_nan=True, msg=where)
    for name in mine:
        torch.testing.assert_close(mine[name], other[name], rtol=0, atol=0, equal_nan=True, msg=f"{where}: {name}")


def assert_core_read_alike(core: Path) -> dict[str, StaticProgram]:
    """Every graph of ``core``: the same program and run from both readers; the reader's programs by variant."""
    import json

    from safetensors.torch import load_file

    catalog = json.loads((core / "catalog.json").read_text())
    weights = load_file(core / "weights.safetensors")
    programs = {}
    for variant in catalog["variants"]:
        ours, theirs = read_both(core / variant["graph"])
        assert_same_program(ours, theirs, variant["name"])
        assert_same_run(ours, theirs, weights, variant["name"])
        programs[variant["name"]] = ours
    return programs
