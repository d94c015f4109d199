"""validate/schema_reader.py: torch's program-JSON reader with each schema class planned once.

The oracle is torch's own ``_dict_to_dataclass``: on every graph of an exported core (decode, prefill,
windows, mixed, scored, structured) both readers build equal dataclasses, and a load through the
installed reader runs the program exactly as before."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
from torch._export.serde import schema, serialize
from torch._export.serde.union import _Union

from ignition.validate import schema_reader
from ignition.validate.schema_reader import SchemaReader


def _program_json(path) -> dict:
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        return json.loads(archive.read(name))


@pytest.fixture(scope="module")
def original():
    """torch's own function, whatever ``install`` did to the module since."""
    reader = serialize._dict_to_dataclass
    return reader.replaced if isinstance(reader, SchemaReader) else reader


def test_the_reader_builds_torchs_dataclasses_for_every_graph(toy_core, original):
    graphs = sorted((toy_core / "graphs").glob("*.pt2"))
    assert len(graphs) >= 3
    reader = SchemaReader(schema, _Union)
    for path in graphs:
        data = _program_json(path)
        assert reader(schema.ExportedProgram, data) == original(schema.ExportedProgram, data), path.name


def test_malformed_json_fails_as_torchs_does(original):
    reader = SchemaReader(schema, _Union)
    for bad in ({"as_int": 1, "as_float": 2.0}, ["not", "a", "dict"]):
        with pytest.raises(AssertionError):
            original(schema.Argument, bad)
        with pytest.raises(AssertionError):
            reader(schema.Argument, bad)
    assert reader(schema.Argument, {"as_float": 2}) == original(schema.Argument, {"as_float": 2})


def test_installed_on_this_torch_and_loads_the_same_program(toy_core):
    assert schema_reader.install()  # else every load pays torch's per-object inspection again
    assert isinstance(serialize._dict_to_dataclass, SchemaReader)
    path = sorted((toy_core / "graphs").glob("*.pt2"))[0]
    program = torch.export.load(path)
    assert len(program.graph.nodes) > 50
