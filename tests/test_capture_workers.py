"""exporter/workers.py: variants captured in worker processes make the very core the serial export makes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ignition.catalog.hashing import core_digest
from ignition.exporter.export import ExportError, export_core
from ignition.exporter.workers import (PARALLEL_CAPTURE_BYTES, CaptureWorkerError, capture_in_workers,
                                       capture_jobs)
from ignition.recipes.base import ExportOptions, RecipeError


def _digest(core) -> str:
    return core_digest(json.loads((core / "manifest.json").read_bytes()))


def test_workers_write_the_serial_exports_core_byte_for_byte(toy_core, tmp_path):
    stages = []
    timings = export_core(ExportOptions(recipe="toy", capacities=(1, 4), capture_jobs=2), tmp_path / "core",
                          progress=lambda stage, item: stages.append((stage, item)))
    assert _digest(tmp_path / "core") == _digest(toy_core)  # the session's toy core was captured serially
    assert "capture (2 workers)" in timings
    assert ("capture", "3 variants in 2 worker processes") in stages


def test_the_export_reads_each_saved_graph_while_the_others_capture(toy_core, tmp_path, monkeypatch):
    """The parent reads each variant's file as its worker saves it (validate.graphs.read_ahead) and the last stage
    checks those programs; a read-ahead that fails leaves that file to the validation, which reads it itself."""
    from ignition.validate import graphs

    original, calls = graphs.read_ahead, []

    def failing_once(path, variant):
        calls.append(variant["name"])
        if len(calls) == 1:
            raise RuntimeError("a read-ahead bug")
        return original(path, variant)

    monkeypatch.setattr(graphs, "read_ahead", failing_once)
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), capture_jobs=2), tmp_path / "core")
    assert sorted(calls) == ["decode.c1", "decode.c4", "prefill.t256"]
    assert _digest(tmp_path / "core") == _digest(toy_core)


def test_a_variant_a_worker_cannot_capture_is_named(tmp_path):
    options = ExportOptions(recipe="toy", capacities=(1,))
    with pytest.raises(CaptureWorkerError, match="variant no.such.variant: StopIteration"):
        capture_in_workers(options, ["decode.c1", "no.such.variant"], tmp_path, False, 2, lambda *_: None)


def _build(weight_bytes: int, graphs: int = 5, parallel=None):
    return SimpleNamespace(weights={"w": torch.empty(weight_bytes, dtype=torch.uint8)}, graphs=[None] * graphs,
                           parallel=parallel)


def test_capture_jobs_is_decided_by_the_exports_size_and_stages(monkeypatch):
    monkeypatch.setattr("ignition.exporter.workers.available_cores", lambda: 4)
    options = ExportOptions(recipe="toy")
    assert capture_jobs(options, _build(PARALLEL_CAPTURE_BYTES - 1)) == 1  # a small model: workers cost more
    assert capture_jobs(options, _build(PARALLEL_CAPTURE_BYTES)) == 4
    assert capture_jobs(options, _build(PARALLEL_CAPTURE_BYTES, graphs=3)) == 3  # never more than the variants
    assert capture_jobs(ExportOptions(recipe="toy", capture_jobs=2), _build(1)) == 2  # asked for
    assert capture_jobs(ExportOptions(recipe="toy", capture_jobs=0), _build(1)) == 1  # 0: by size
    for kept in (dict(onnx=True), dict(compile="inductor")):  # a later stage needs the programs in this process
        assert capture_jobs(ExportOptions(recipe="toy", capture_jobs=2, **kept), _build(1 << 30)) == 1
    assert capture_jobs(ExportOptions(recipe="toy", capture_jobs=2), _build(1 << 30, parallel=object())) == 1


def test_jobs_out_of_range_is_refused_by_name():
    with pytest.raises(RecipeError, match="--jobs must be <= 256, got 1000"):
        ExportOptions(recipe="toy", capture_jobs=1000)
    with pytest.raises(RecipeError, match="--jobs must be >= 0, got -1"):
        ExportOptions(recipe="toy", capture_jobs=-1)


def test_a_failed_worker_export_publishes_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise CaptureWorkerError("variant decode.c1: RuntimeError: boom")

    monkeypatch.setattr("ignition.exporter.workers.capture_in_workers", broken)
    with pytest.raises(ExportError, match="variant decode.c1: RuntimeError: boom"):
        export_core(ExportOptions(recipe="toy", capacities=(1,), capture_jobs=2), tmp_path / "core")
    assert not (tmp_path / "core").exists()


def test_workers_take_the_longest_captures_first():
    """CAPTURE_ORDER names every operation a recipe builds; packed and prompt graphs go out before decode graphs."""
    from types import SimpleNamespace

    from ignition.catalog.enums import Operation
    from ignition.exporter.workers import CAPTURE_ORDER, capture_order

    assert set(CAPTURE_ORDER) == set(Operation.__members__) - {"DRAFT_PROPOSE"}  # reserved: no recipe builds it
    graphs = [SimpleNamespace(variant=SimpleNamespace(name=name, operation=operation)) for name, operation in (
        ("decode.c1", Operation.DECODE), ("prefill.t256", Operation.PREFILL), ("decode.c8", Operation.DECODE),
        ("packed.t256.c8", Operation.PACKED_PREFILL), ("scored.t256", Operation.SCORED_PREFILL))]
    assert capture_order(graphs) == ["packed.t256.c8", "scored.t256", "prefill.t256", "decode.c1", "decode.c8"]
