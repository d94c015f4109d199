"""validate_core's ``written`` and ``read_ahead``: digests and programs the caller took before the validation stand
for the files only where they match the manifest, and every rule still runs on them."""

from __future__ import annotations

import dataclasses
import json

from ignition.validate import files as files_module
from ignition.validate.core import validate_core
from ignition.validate.graphs import read_ahead
from ignition.validate.report import Violation


def _variants(core) -> list[dict]:
    return json.loads((core / "catalog.json").read_text())["variants"]


def _ahead(core) -> dict:
    return {v["graph"]: read_ahead(core / v["graph"], v) for v in _variants(core)}


def _files_read(monkeypatch) -> list[str]:
    """The names of the files ``check_files`` hashes from disk, as it hashes them."""
    read = []
    original = files_module.sha256_file
    monkeypatch.setattr(files_module, "sha256_file", lambda path: read.append(path.name) or original(path))
    return read


def test_graphs_read_ahead_are_the_programs_checked_and_not_read_again(toy_core, monkeypatch):
    ahead = _ahead(toy_core)
    manifest = json.loads((toy_core / "manifest.json").read_text())
    written = {manifest["weights"]: manifest["files"][manifest["weights"]]}
    read = _files_read(monkeypatch)
    report = validate_core(toy_core, torch_load=False, written=written, read_ahead=ahead)
    assert report.ok, report.violations
    assert {v["name"]: report.programs[v["name"]] for v in _variants(toy_core)} == \
        {v["name"]: ahead[v["graph"]].program for v in _variants(toy_core)}  # the very programs read ahead
    assert not set(read) & ({"weights.safetensors"} | {v["graph"].rsplit("/", 1)[-1] for v in _variants(toy_core)})


def test_a_read_ahead_whose_digest_is_not_the_manifests_is_a_file_hash_finding(toy_core):
    ahead = _ahead(toy_core)
    graph = _variants(toy_core)[0]["graph"]
    ahead[graph] = dataclasses.replace(ahead[graph], sha256="0" * 64)  # the file changed after it was read
    report = validate_core(toy_core, torch_load=False, read_ahead=ahead)
    assert [(v.rule, v.where) for v in report.violations] == [("FILE-HASH", graph)]
    assert "found " + "0" * 64 in report.violations[0].message


def test_what_a_read_ahead_refused_is_reported_by_the_validation(toy_core):
    ahead = _ahead(toy_core)
    variant = _variants(toy_core)[0]
    refusal = Violation("PT2-PICKLE", f"variant {variant['name']}: {variant['graph']}", "a pickle member")
    ahead[variant["graph"]] = dataclasses.replace(ahead[variant["graph"]], refused=[refusal], program=None)
    report = validate_core(toy_core, torch_load=False, read_ahead=ahead)
    assert report.violations == [refusal]
    unreadable = dataclasses.replace(ahead[variant["graph"]], refused=[], unreadable="no graph_module")
    report = validate_core(toy_core, torch_load=False, read_ahead={variant["graph"]: unreadable})
    assert [(v.rule, v.message) for v in report.violations] == \
        [("GRAPH-LOAD", "the program cannot be read: no graph_module")]


def test_a_written_digest_stands_for_the_file_only_where_it_is_the_manifests(toy_core, monkeypatch):
    weights = json.loads((toy_core / "manifest.json").read_text())["weights"]
    report = validate_core(toy_core, check_graphs=False, written={weights: "f" * 64})
    assert [(v.rule, v.where) for v in report.violations] == [("FILE-HASH", weights)]


def test_torch_loads_read_every_graph_themselves(toy_core, monkeypatch):
    ahead = {rel: dataclasses.replace(a, sha256="0" * 64) for rel, a in _ahead(toy_core).items()}
    read = _files_read(monkeypatch)
    report = validate_core(toy_core, torch_load=True, read_ahead=ahead)  # ignored: torch.export.load reads the file
    assert report.ok, report.violations
    assert {v["graph"].rsplit("/", 1)[-1] for v in _variants(toy_core)} <= set(read)
