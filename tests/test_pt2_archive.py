"""The safe .pt2 reader: live payloads that plain torch.export.load executes are refused before it runs.

Every planted payload is first shown to be live (plain torch runs it and writes the canary),
then planted in a core with rehashed manifest entries: validate-core and the loader must refuse
it by rule id, and the canary must never appear.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
import zipfile

import pytest
import torch

from _payloads import EXPECTED_RULES, legacy_archive, pt2_payloads, rewrite, shared_library
from ignition.catalog.model import BufferDecl
from ignition.exporter.export import ExportError, save_program
from ignition.runtime.core import CoreLoadError, load_core
from ignition.validate.archive import check_archive
from ignition.validate.core import validate_core

GRAPH = "graphs/decode.c1.pt2"


def rules(found) -> set[str]:
    return {v.rule for v in found}


def example_inputs(core_root, variant="decode.c1") -> dict[str, torch.Tensor]:
    catalog = json.loads((core_root / "catalog.json").read_text())
    entry = next(v for v in catalog["variants"] if v["name"] == variant)
    return {a["name"]: BufferDecl.from_json(a).empty() for a in entry["arguments"]}


def plain_torch_load(data: bytes, inputs) -> None:
    """What a careless loader does: torch.export.load, then run the program."""
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.load(io.BytesIO(data)).module()(inputs)
    except Exception:  # the payload has already run, or not; the canary says which
        pass
    finally:
        logging.disable(logging.NOTSET)


def test_exported_graphs_pass_the_safe_reader(toy_core):
    for graph in sorted((toy_core / "graphs").glob("*.pt2")):
        assert check_archive(graph.read_bytes(), graph.name) == []


@pytest.mark.parametrize("payload", sorted(EXPECTED_RULES))
def test_pickle_in_a_pt2_with_rehash_never_runs(core_copy, tmp_path, payload):
    canary, inputs = tmp_path / "canary", example_inputs(core_copy.root)
    planted = rewrite((core_copy.root / GRAPH).read_bytes(), pt2_payloads(canary, inputs)[payload])
    plain_torch_load(planted, inputs)
    assert canary.exists(), f"{payload} is not a live payload: the test would prove nothing"
    canary.unlink()

    (core_copy.root / GRAPH).write_bytes(planted)
    core_copy.rehash(GRAPH)
    report = validate_core(core_copy.root)
    assert rules(report.violations) == EXPECTED_RULES[payload], report.violations
    assert all(GRAPH in v.where for v in report.violations)
    with pytest.raises(CoreLoadError, match="PT2-"):
        load_core(core_copy.root)
    assert not canary.exists()


def test_legacy_fallback_format_is_refused(core_copy, tmp_path):
    canary = tmp_path / "canary"
    model_json = zipfile.ZipFile(core_copy.root / GRAPH).read("decode.c1/models/model.json")
    planted = legacy_archive(model_json, canary)
    plain_torch_load(planted, example_inputs(core_copy.root))
    assert canary.exists()  # torch.export.load falls back to torch.load(weights_only=False)
    canary.unlink()
    (core_copy.root / GRAPH).write_bytes(planted)
    core_copy.rehash(GRAPH)
    assert rules(validate_core(core_copy.root).violations) == {"PT2-ARCHIVE"}
    assert not canary.exists()


def test_compiled_package_as_a_graph_is_refused(core_copy, tmp_path):
    """torch.export.load dlopens any data/aotinductor/ member; a graph .pt2 may hold none."""
    canary = tmp_path / "canary"
    library = shared_library(canary, tmp_path / "planted.so")
    if library is None:
        pytest.skip("needs a C compiler to build the planted library")
    planted = rewrite((core_copy.root / GRAPH).read_bytes(), lambda m: m.update({
        "data/aotinductor/model/model.wrapper.so": library.read_bytes(),
        "data/aotinductor/model/model.wrapper_metadata.json": b'{"AOTI_DEVICE_KEY": "cpu"}'}))
    plain_torch_load(planted, example_inputs(core_copy.root))
    assert canary.exists()
    canary.unlink()
    (core_copy.root / GRAPH).write_bytes(planted)
    core_copy.rehash(GRAPH)
    assert rules(validate_core(core_copy.root).violations) == {"PT2-MEMBER"}
    assert not canary.exists()


def _zip(entries, compression=zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as archive:
        for name, content in entries:
            archive.writestr(name, content)
    return out.getvalue()


@pytest.fixture(scope="module")
def members(toy_core) -> dict[str, bytes]:
    with zipfile.ZipFile(toy_core / GRAPH) as archive:
        return {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}


def _layout(members, transform):
    entries = [(f"g/{name}", content) for name, content in members.items()]
    return check_archive(transform(entries), "g.pt2")


@pytest.mark.filterwarnings("ignore:Duplicate name")
@pytest.mark.parametrize("transform,message", [
    (lambda e: _zip(e + e[:1]), "duplicate member"),
    (lambda e: _zip(e, zipfile.ZIP_DEFLATED), "compressed"),
    (lambda e: b"#!/bin/sh\n" + _zip(e), "precede the first member"),
    (lambda e: _zip(e) + b"trailing", "follow the zip's end record"),
    (lambda e: _zip(e + [("other/x", b"")]), "one root folder"),
    (lambda e: _zip(e + [("g/../x", b"")]), "plain relative path"),
    (lambda e: _zip([]), "empty archive"),
])
def test_zip_layout(members, transform, message):
    found = _layout(members, transform)
    assert rules(found) == {"PT2-ARCHIVE"} and message in found[0].message, found


def test_not_a_zip_cannot_load():
    assert rules(check_archive(b"\x7fELF not a zip", "g.pt2")) == {"GRAPH-LOAD"}


def _edited(members, changes: dict) -> list:
    edited = dict(members) | changes
    return check_archive(_zip([(f"g/{n}", c) for n, c in edited.items() if c is not None]), "g.pt2")


def _model(members, change) -> bytes:
    document = json.loads(members["models/model.json"])
    change(document)
    return json.dumps(document).encode()


def _first_node(document) -> dict:
    return document["graph_module"]["graph"]["nodes"][0]


@pytest.mark.parametrize("changes,rule,message", [
    ({"extra/module_info.json": b"{}"}, "PT2-MEMBER", "not a member torch.export.save writes"),
    ({"data/mtia/blob": b"x"}, "PT2-MEMBER", "not a member"),
    ({"data/weights/model_weights.pkl": b"plain"}, "PT2-PICKLE", "pickled member"),
    ({"archive_format": b"zip"}, "PT2-MEMBER", "expected 'pt2'"),
    ({"archive_version": b"1"}, "PT2-MEMBER", "archive_version"),
    ({"models/model.json": None}, "PT2-MEMBER", "expected member models/model.json"),
    ({"models/model.json": b"\x80\x04K\x01."}, "PT2-PICKLE", "pickled member"),
    ({"models/model.json": b"[" * 100_000}, "PT2-MEMBER", "UTF-8 JSON"),
    ({"data/sample_inputs/model.pt": b"not empty"}, "PT2-PICKLE", "empty sample-input"),
    ({"data/constants/model_constants_config.json": b'{"config": {"c": {"path_name": "custom_obj_0", '
      b'"is_param": false, "use_pickle": false, "tensor_meta": {}}}}', "data/constants/custom_obj_0": b"x"},
     "PT2-PICKLE", "raw tensor file"),
])
def test_member_allow_list(members, changes, rule, message):
    found = _edited(members, changes)
    assert rule in rules(found) and any(message in v.message or message in v.where for v in found), found


def test_raw_tensor_constants_are_data(members):
    """A raw (never unpickled) constant may hold any bytes, even a pickle's: torch reads it with as_strided."""
    config = {"config": {"c": {"path_name": "tensor_0", "is_param": False, "use_pickle": False,
                               "tensor_meta": {"dtype": 7, "sizes": [], "requires_grad": False}}}}
    found = _edited(members, {"data/constants/model_constants_config.json": json.dumps(config).encode(),
                              "data/constants/tensor_0": b"\x80\x04\x00\x00"})
    assert found == []


@pytest.mark.parametrize("change,message", [
    (lambda d: _first_node(d).update(target="torch.os.system"), "not an operator in the allowed namespaces"),
    (lambda d: _first_node(d).update(target="torch.ops.evil.op.default"), "allowed namespaces"),
    (lambda d: d["graph_module"]["graph"]["inputs"].append({"as_string": "x'); import os; ('"}), "expected a tensor"),
    (lambda d: d.update(range_constraints={"s0": {"min_val": "__import__('os')", "max_val": 4}}), "range_constraints"),
    (lambda d: d.update(range_constraints={"__import__('os')": {"min_val": 2, "max_val": 4}}), "range_constraints"),
    (lambda d: _first_node(d)["outputs"].append({"as_sym_int": {"as_expr": {"expr_str": "__import__('os').getcwd()"}}}),
     "symbolic expression"),
    (lambda d: _first_node(d)["outputs"].append({"as_sym_int": {"as_expr": {
        "expr_str": "Mul(Integer(2), Symbol('s0', positive=True, integer=True, evil=exec('1')))"}}}), "symbolic expression"),
    (lambda d: d["graph_module"]["module_call_graph"][0]["signature"].update(
        in_spec='[1, {"type": "collections.OrderedDict", "context": "[]", "children_spec": []}]'), "containers"),
])
def test_program_must_be_static_and_plain(members, change, message):
    found = _edited(members, {"models/model.json": _model(members, change)})
    assert rules(found) == {"PT2-PROGRAM"} and message in found[0].message, found


@pytest.mark.parametrize("text,allowed", [
    ("Symbol('s72', positive=True, integer=True)", True),
    ("Mul(Integer(512), Symbol('s72', positive=True, integer=True))", True),
    ("Add(Integer(-1), Mul(Integer(2), Symbol('s3', positive=True, integer=True)))", True),
    ("Symbol('os', positive=True, integer=True)", False),
    ("Mul(Integer(2))", False),
    ("Pow(Integer(2), Integer(99999999))", False),
    ("Mul(Integer(4), Pow(Symbol('s88', positive=True, integer=True), Integer(2)))", True),
    ("Pow(Add(Integer(2), Symbol('s1', positive=True, integer=True)), Integer(2))", True),
    ("Integer(2)", True),
    ("Pow(Symbol('s88', positive=True, integer=True), Integer(3))", False),
    ("Pow(Integer(2), Symbol('s88', positive=True, integer=True))", False),
    ("Integer(1) + Integer(2)", False),
    ("Mul(" * 300 + "Integer(1)", False),
])
def test_symbolic_expressions_are_a_closed_grammar(text, allowed):
    """The key window's extent is a shape symbol; sympify may only see sums and products of literals and symbols."""
    from ignition.validate.program_json import symbolic_expression_allowed
    assert symbolic_expression_allowed(text) is allowed


def test_exporter_never_writes_what_loading_refuses(tmp_path):
    """Sample inputs are a pickle torch.load reads; an export that would keep them fails, naming the rule."""
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    assert program.example_inputs is not None
    with pytest.raises(ExportError, match=r"graphs/g\.pt2: .*\n.*\[PT2-PICKLE\] .*sample_inputs"):
        (tmp_path / "graphs").mkdir()
        save_program(program, tmp_path, "graphs/g.pt2")
    program._example_inputs = None  # what capture() does
    save_program(program, tmp_path, "graphs/g.pt2")
