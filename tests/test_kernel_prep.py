"""Ahead-of-time kernel preparation (no GPU) and the kernel table's validation rules."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from ignition.catalog.contract import NATURAL_K
from ignition.components.triton_logprobs import launch_plan
from ignition.exporter.kernels import (TARGETS, KernelPreparationError, Target, launch_key, parse_targets,
                                       prepare_kernels)
from ignition.validate.kernels import validate_kernel_table
from ignition.validate.schema import schema_violations

BOTH = ["cuda:90", "cuda:120"]


def specs():
    small = launch_plan(4, 1003, 1000, NATURAL_K, True, torch.bfloat16)
    return small + launch_plan(4, 1003, 1000, NATURAL_K, True, torch.bfloat16) + launch_plan(
        64, 151936, 151936, NATURAL_K, False, torch.float16)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    core = tmp_path_factory.mktemp("core")
    table = prepare_kernels(specs(), BOTH, core)
    return core, table


def launches(table):
    return {"decode_4": sorted({entry["key"] for entry in table["kernels"]})}


def rules(found):
    return sorted({violation.rule for violation in found})


def test_parse_targets():
    assert parse_targets("cuda:90, cuda:120") == BOTH
    with pytest.raises(ValueError, match="unknown kernel target.*'cuda:80'.*known targets: cuda:90, cuda:120"):
        parse_targets("cuda:90,cuda:80")
    with pytest.raises(ValueError, match="repeat"):
        parse_targets("cuda:90,cuda:90")
    with pytest.raises(ValueError, match="no kernel target"):
        parse_targets(" , ")


def test_table_covers_each_distinct_launch_once_per_target(prepared):
    _, table = prepared
    keys = {launch_key(spec) for spec in specs()}
    assert len(keys) == 8  # the repeated small plan is prepared once
    assert sorted((e["key"], e["target"]) for e in table["kernels"]) == sorted((k, t) for k in keys for t in BOTH)
    assert table["targets"] == sorted(BOTH)
    assert schema_violations(table, "kernels.schema.json", "kernels.json") == []
    json.dumps(table, allow_nan=False)


def test_shared_memory_within_target_limits(prepared):
    _, table = prepared
    for entry in table["kernels"]:
        assert 0 <= entry["shared_bytes"] <= TARGETS[entry["target"]].max_shared_bytes, entry["key"]


def test_files_match_recorded_sha256(prepared):
    core, table = prepared
    for entry in table["kernels"]:
        assert not Path(entry["file"]).is_absolute() and ".." not in Path(entry["file"]).parts
        assert hashlib.sha256((core / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
        assert entry["kernel_name"] == entry["name"].split(".")[-1] + "_kernel"
    assert validate_kernel_table(core, table, launches(table)) == []


def test_preparing_twice_is_byte_identical(prepared, tmp_path):
    core, table = prepared
    again = prepare_kernels(list(reversed(specs())), list(reversed(BOTH)), tmp_path)
    assert json.dumps(again, sort_keys=True) == json.dumps(table, sort_keys=True)
    assert again == table  # same order too
    first = {p.name: p.read_bytes() for p in (core / "kernels").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "kernels").iterdir()} == first


def test_validator_catches_missing_and_tampered_binaries(prepared, tmp_path):
    core, table = prepared
    shutil.copytree(core, tmp_path, dirs_exist_ok=True)
    first, second = table["kernels"][0], table["kernels"][1]
    (tmp_path / first["file"]).unlink()
    (tmp_path / second["file"]).write_bytes((tmp_path / second["file"]).read_bytes() + b"\0")
    found = validate_kernel_table(tmp_path, table, launches(table))
    assert rules(found) == ["KERNEL-FILE", "KERNEL-HASH"]
    assert any(first["file"] in v.message for v in found if v.rule == "KERNEL-FILE")

    dropped = copy.deepcopy(table)
    del dropped["kernels"][0]
    found = validate_kernel_table(core, dropped, launches(table))
    assert rules(found) == ["KERNEL-MISSING"] and first["target"] in found[0].message


def test_validator_catches_oversized_shared_memory_and_unknown_targets(prepared):
    core, table = prepared
    bad = copy.deepcopy(table)
    bad["kernels"][0]["shared_bytes"] = TARGETS[bad["kernels"][0]["target"]].max_shared_bytes + 1
    bad["kernels"][1]["target"] = "cuda:80"
    found = validate_kernel_table(core, bad, {})
    assert rules(found) == ["KERNEL-SMEM", "KERNEL-TARGET"]
    bad["targets"].append("rocm:942")
    assert "KERNEL-TARGET" in rules(validate_kernel_table(core, bad, {}))


@pytest.mark.parametrize("path", ["/etc/passwd", "kernels/../../outside.cubin", "", None])
def test_validator_rejects_paths_outside_the_core(prepared, path):
    core, table = prepared
    bad = copy.deepcopy(table)
    bad["kernels"][0]["file"] = path
    assert rules(validate_kernel_table(core, bad, {})) == ["KERNEL-FILE"]


@pytest.mark.parametrize("table", [None, [], {"kernels": "x"}, {"kernels": [], "targets": "cuda:90"},
                                   {"kernels": [7, {"target": ["x"], "key": {}}], "targets": ["cuda:90"]}])
def test_validator_never_raises_on_malformed_tables(tmp_path, table):
    assert validate_kernel_table(tmp_path, table, {"v": ["k"], "w": None})


def test_preparation_refuses_kernels_over_the_shared_memory_limit(monkeypatch, tmp_path):
    monkeypatch.setitem(TARGETS, "cuda:120", Target("cuda", 120, 32, 8))
    tile_stats = launch_plan(4, 1000, 1000, NATURAL_K, False, torch.float32)[0]
    with pytest.raises(KernelPreparationError, match=r"logprobs.tile_stats .* on cuda:120; the target allows 8"):
        prepare_kernels([tile_stats], ["cuda:120"], tmp_path)
