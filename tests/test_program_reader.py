"""validate/program_reader.py: the runtime reads each graph from its JSON, without torch.export.load.

The oracle is torch.export.load of the same bytes (tests/_program_oracle.py): on every graph of the toy core
both build the same nodes, names, targets, arguments and generated code, the graph rules read the same facts,
and the two modules write and return the same values bit for bit. What the reader does not read is a clear
GRAPH-LOAD at load, never a guess. A GQA decoder's windowed graphs (symbolic extents) are compared in
test_geometry_rules.py, the MoE cores' cond branches in test_moe_recipes.py."""

from __future__ import annotations

import copy
import io
import json
import zipfile

import pytest
import torch

from _program_oracle import assert_core_read_alike
from ignition.runtime.core import load_core
from ignition.runtime.verified import CoreLoadError
from ignition.validate.archive import accept_archive
from ignition.validate.graphs import read_graph
from ignition.validate.graph_json import TensorFacts
from ignition.validate.program_reader import ProgramReadError, StaticProgram, read_program


def _document(path) -> dict:
    refused, accepted = accept_archive(path.read_bytes(), path.name)
    assert not refused
    return accepted.document


def test_every_graph_of_the_toy_core_is_torchs_graph(toy_core):
    catalog = json.loads((toy_core / "catalog.json").read_text())
    assert len(assert_core_read_alike(toy_core)) == len(catalog["variants"]) >= 3
    for variant in catalog["variants"]:
        found, loaded = read_graph(toy_core / variant["graph"], variant)
        assert found == [] and isinstance(loaded, StaticProgram)


def _edited(document: dict, edit) -> dict:
    edited = copy.deepcopy(document)
    edit(edited)
    return edited


def _graph(document: dict) -> dict:
    return document["graph_module"]["graph"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["graph_module"]["signature"]["output_specs"].append(
        {"buffer_mutation": {"arg": {"name": "x"}, "buffer_name": "b"}}), "expected every output to be a user output"),
    (lambda d: d["graph_module"]["signature"]["input_specs"].insert(
        0, {"parameter": {"arg": {"name": "p"}, "parameter_name": "p"}}), "expected every input to be a user tensor"),
    (lambda d: d["graph_module"]["signature"]["input_specs"].insert(
        0, {"tensor_constant": {"arg": {"name": "c_t"}, "tensor_constant_name": "t"}}), "has no data/constants"),
    (lambda d: _graph(d)["nodes"][0].update(target="builtins.eval"), "is not an operator"),
    (lambda d: _graph(d)["nodes"][0].update(target="torch.ops.aten.no_such_op.default"), "is not an allowed operator"),
    (lambda d: _graph(d)["nodes"][0].update(target="_operator.getitem"), "shape-arithmetic"),
    (lambda d: _graph(d)["nodes"][0]["inputs"][0].update(arg={"as_custom_obj": {"name": "o", "class_fqn": "x"}}),
     "argument kind 'as_custom_obj'"),
    (lambda d: _graph(d)["nodes"][0]["inputs"][0].update(arg={"as_tensor": {"name": "defined_later"}}),
     "used before it is defined"),
    (lambda d: _graph(d)["nodes"].append(copy.deepcopy(_graph(d)["nodes"][0])), "defined twice"),
    (lambda d: _graph(d)["nodes"][0]["inputs"].append({"name": "bogus", "arg": {"as_int": 1}, "kind": 2}),
     "not in its schema"),
    (lambda d: _graph(d).pop("tensor_values"), "malformed program JSON: KeyError"),
])
def test_what_the_reader_does_not_read_is_named(toy_core, edit, message):
    catalog = json.loads((toy_core / "catalog.json").read_text())
    document = _document(toy_core / catalog["variants"][0]["graph"])
    with pytest.raises(ProgramReadError, match=message):
        read_program(_edited(document, edit))


def test_a_graph_the_reader_refuses_stops_the_load_naming_it(core_copy):
    """A hand-made archive with a node the reader cannot read: load_core fails with GRAPH-LOAD, no traceback."""
    catalog = core_copy.load("catalog.json")
    rel = catalog["variants"][0]["graph"]
    path = core_copy.root / rel
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for info, content in members:
            if info.filename.endswith("models/model.json"):
                document = json.loads(content)
                _graph(document)["nodes"][0]["inputs"][0]["arg"] = {"as_tensor": {"name": "defined_later"}}
                content = json.dumps(document).encode()
            archive.writestr(info, content)
    path.write_bytes(buffer.getvalue())
    core_copy.rehash(rel)
    with pytest.raises(CoreLoadError, match=r"GRAPH-LOAD.*defined_later.*used before it is defined"):
        load_core(core_copy.root)


def test_tensor_facts_are_plain_data():
    facts = TensorFacts(torch.float32, (2, "s3"))
    assert facts.dim() == 2 and facts.shape[-1] == "s3"


def test_the_decoding_tables_are_torchs_own():
    """The reader decodes dtype, layout and memory-format codes with the tables torch's serializer holds, built
    from the schema enums so that loading never imports the serializer (dynamo, sympy and mpmath with it)."""
    from torch._export.serde import schema, serialize

    from ignition.validate.graph_json import serde_tables

    tables = serde_tables()
    assert tables.dtypes == serialize._SERIALIZE_TO_TORCH_DTYPE
    assert tables.layouts == serialize._SERIALIZE_TO_TORCH_LAYOUT
    assert tables.memory_formats == serialize._SERIALIZE_TO_TORCH_MEMORY_FORMAT
    for device in ({"type": "cpu"}, {"type": "cuda", "index": 1}, {"type": "cuda", "index": None}):
        expected = serialize.deserialize_device(schema.Device(type=device["type"], index=device.get("index")))
        assert tables.device(device) == expected


def test_loading_a_core_imports_neither_dynamo_nor_sympy(toy_core):
    import subprocess
    import sys

    script = ("import sys; from ignition.runtime.core import load_core; load_core(sys.argv[1]); "
              "print(sorted(m for m in ('torch._dynamo', 'sympy', 'torch._export.serde.serialize') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, str(toy_core)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
