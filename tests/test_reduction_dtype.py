"""The logits a prepared reduction reads (``catalog.model.reduction_logits_dtype``): float32 on a single rank, whose
graph converts BF16/FP16 logits once for sampling and the reduction, so a BF16 core exports with ``--targets``
and its plan, the exporter's check of the captured graph and the loader's launcher all agree on float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import reduction_logits_dtype
from ignition.runtime.launchers.reduction import ReductionShape, reduction_shapes
from ignition.validate.core import validate_core


def test_a_single_rank_reduces_float32_and_a_shard_its_model_dtype():
    for dtype in ("float32", "bfloat16", "float16"):
        assert reduction_logits_dtype(dtype, sharded=False) == "float32"
        assert reduction_logits_dtype(dtype, sharded=True) == dtype


@pytest.fixture(scope="module")
def bf16_core(tmp_path_factory) -> Path:
    """A tiny BF16 Qwen3 core exported with ``--targets cuda:90`` (the export checks every captured reduction node
    against the prepared plan and fails on a dtype mismatch)."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("bf16-targets")
    save_checkpoint(TinyCase("qwen3", torch.bfloat16, True, 300), root / "ckpt")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=16,
                              max_seq_len=32, targets=("cuda:90",)), root / "core")
    return root / "core"


def test_a_bf16_core_exports_with_targets_and_validates(bf16_core):
    manifest = json.loads((bf16_core / "manifest.json").read_text())
    assert manifest["model"]["dtype"] == "bfloat16"
    report = validate_core(bf16_core)
    assert report.ok, [str(v) for v in report.violations]


def test_the_launcher_and_the_prepared_kernels_read_float32_logits(bf16_core):
    manifest = json.loads((bf16_core / "manifest.json").read_text())
    catalog = json.loads((bf16_core / "catalog.json").read_text())
    shapes = reduction_shapes(Manifest.from_json(manifest), catalog)
    assert {shape.logits_dtype for shape in shapes} == {"float32"}
    assert ReductionShape(4, 300, 300, 20, True, "float32") in shapes  # decode.c4
    table = json.loads((bf16_core / "kernels.json").read_text())
    pointers = {p["type"] for entry in table["kernels"] for p in entry["signature"] if p["name"] == "logits_ptr"}
    assert pointers == {"*fp32"}  # tile_stats, tile_candidates and merge read the logits
    for variant in catalog["variants"]:
        if variant["contract"]["layout"].get("logprobs"):
            assert variant["launches"] and set(variant["launches"]) <= {e["key"] for e in table["kernels"]}


def test_each_captured_reduction_reads_the_dtype_the_launcher_looks_up(bf16_core):
    """The graph's ``ignition::reduce_logprobs`` input, as the runtime will hand it to ``PreparedReduction``."""
    catalog = json.loads((bf16_core / "catalog.json").read_text())
    manifest = json.loads((bf16_core / "manifest.json").read_text())
    shapes = reduction_shapes(Manifest.from_json(manifest), catalog)
    entry = next(e for e in catalog["variants"] if e["name"].startswith("decode"))
    program = torch.export.load(bf16_core / entry["graph"])
    (node,) = [n for n in program.graph.nodes if str(n.target) == "ignition.reduce_logprobs.default"]
    logits = node.args[0].meta["val"]
    assert logits.dtype == torch.float32
    assert any(shape.rows == logits.shape[0] and shape.logits_dtype == "float32" for shape in shapes)
