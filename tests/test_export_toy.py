"""Exporting the toy recipe: determinism, atomicity, replay correctness and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import ignition  # noqa: F401  (registers the ops the .pt2 graphs use)
from ignition.catalog.abi import decode_packed_position, decode_record, has_payload
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.exporter.publish import PublishError
from ignition.recipes.base import ExportOptions
from ignition.validate.core import validate_core

SENTINEL = -99


def test_reexport_is_byte_identical(tmp_path, toy_core):
    again = tmp_path / "toy"
    export_core(ExportOptions(recipe="toy", capacities=(1, 4)), again)
    files = sorted(p.relative_to(toy_core) for p in toy_core.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (toy_core / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_weights_are_stored_once(toy_core):
    weights = load_file(str(toy_core / "weights.safetensors"))
    probe = weights["lm_head.weight"][7].numpy().tobytes()  # 128 bytes of one weight row
    for graph in (toy_core / "graphs").iterdir():
        with zipfile.ZipFile(graph) as archive:
            data = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
        assert data < 256, f"{graph.name} stores {data} bytes of tensors/sample inputs"
        assert probe not in graph.read_bytes()


def test_killed_export_never_validates(tmp_path):
    out = tmp_path / "killed"
    code = ("from pathlib import Path; from ignition.exporter.export import export_core; "
            "from ignition.recipes.base import ExportOptions; "
            f"export_core(ExportOptions(recipe='toy', capacities=(1, 2, 4, 8, 16)), Path({str(out)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 120
    staging = None
    while time.time() < deadline and staging is None:
        staging = next((p for p in tmp_path.glob(".killed.partial-*") if (p / "graphs").exists()), None)
        time.sleep(0.02)
    assert staging is not None, "export never started writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert not validate_core(out).ok
    assert not validate_core(staging).ok


def test_existing_core_is_not_overwritten_silently(tmp_path, toy_core):
    out = tmp_path / "exists"
    out.mkdir()
    with pytest.raises(PublishError, match="--overwrite"):
        export_core(ExportOptions(recipe="toy", capacities=(1,)), out)
    assert list(out.iterdir()) == []
    assert not list(tmp_path.glob(".exists.*"))


def _decode_inputs(core: Path, capacity: int) -> dict[str, torch.Tensor]:
    catalog = json.loads((core / "catalog.json").read_text())
    variant = next(v for v in catalog["variants"] if v["name"] == f"decode.c{capacity}")
    weights = load_file(str(core / "weights.safetensors"))
    buffers = {}
    for arg in variant["arguments"]:
        dtype = getattr(torch, arg["dtype"])
        buffers[arg["name"]] = weights[arg["name"]] if arg["role"] == "weight" else torch.zeros(arg["shape"], dtype=dtype)
    return buffers


def test_replayed_decode_matches_oracle(toy_core):
    program = torch.export.load(str(toy_core / "graphs" / "decode.c4.pt2"))
    b = _decode_inputs(toy_core, 4)
    b["input_ids"][:] = torch.tensor([3, 77, 249, 5])
    b["positions"][:] = torch.tensor([4, 9, 0, 2])
    b["slot_ids"][:] = torch.tensor([5, 1, 0, 2])
    b["slot_epochs"][:] = torch.tensor([3, 7, 1, 2])
    b["active_lanes"][:] = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    b["frame_index"][:] = 1
    b["generated_counts"][:] = torch.tensor([4, 1, 0, 0])
    b["token_budget"][:] = torch.tensor([16, 2, 16, 16])
    b["eos_token_ids"][:] = -1
    b["forced_token_ids"][:] = torch.tensor([-1, -1, 42, -1])
    b["logprob_requested"][:] = torch.tensor([1, 1, 1, 1], dtype=torch.int32)
    b["logprob_token_id_counts"][1] = 3
    b["logprob_token_ids"][1, :3] = torch.tensor([200, 3, 249], dtype=torch.int32)
    b["completion_logprobs"].fill_(SENTINEL)
    (next_tokens,) = program.module()(b)

    emb, head = b["embedding.weight"].double(), b["lm_head.weight"].double()
    logits = emb[b["input_ids"]] @ head.T  # fp64 oracle: [4, 256]
    logprobs = torch.log_softmax(logits[:, :250], dim=1)
    greedy = logprobs.argmax(dim=1)
    assert next_tokens.tolist() == [greedy[0].item(), greedy[1].item(), 42, -1]
    records = [decode_record(b["completion_records"][1, lane].numpy()) for lane in range(4)]
    assert (b["completion_records"][0] == 0).all(), "the inactive frame is never written"
    assert records[0].slot == 5 and records[0].epoch == 3 and records[0].round_kind is RoundKind.SAMPLING
    assert records[0].operation == Operation.DECODE and records[0].sequence_length == 5
    assert records[1].finish_reason is FinishReason.LENGTH
    assert records[2].forced == (True,) and not has_payload(records[2], 0, requested=True)
    assert records[3].round_kind is RoundKind.INVALID and records[3].emitted == () and records[3].slot == -1

    # fp32 logits from a 32-wide fp32 matmul differ from fp64 by < 1e-5; the reduction adds < 5e-6.
    tol = 3e-5
    packed = b["completion_logprobs"][1, :, 0].numpy()
    natural = decode_packed_position(packed[0], 20)
    assert natural.chosen_id == greedy[0].item()
    assert abs(natural.chosen_logprob - logprobs[0, greedy[0]].item()) < tol
    order = sorted(range(250), key=lambda t: (-logprobs[0, t].item(), t))[:20]
    assert [i for i, _ in natural.alternatives] == order
    np.testing.assert_allclose([v for _, v in natural.alternatives], logprobs[0, order].numpy(), atol=tol, rtol=0)
    selected = decode_packed_position(packed[1], 3)
    assert [i for i, _ in selected.alternatives] == [200, 3, 249]
    np.testing.assert_allclose([v for _, v in selected.alternatives], logprobs[1, [200, 3, 249]].numpy(), atol=tol, rtol=0)
    assert (packed[1, 8:] == SENTINEL).all()
    assert (packed[2] == SENTINEL).all(), "a forced token has no logprob entry"
    assert (packed[3] == SENTINEL).all(), "an inactive lane is never written"
    assert (b["completion_logprobs"][1, :, 1:] == SENTINEL).all() and (b["completion_logprobs"][0] == SENTINEL).all()


def test_sampled_tokens_do_not_depend_on_logprob_requests(toy_core):
    program = torch.export.load(str(toy_core / "graphs" / "decode.c4.pt2")).module()
    results = []
    for flag in (0, 1):
        b = _decode_inputs(toy_core, 4)
        b["input_ids"][:] = torch.tensor([1, 2, 3, 4])
        b["active_lanes"][:] = 1
        b["token_budget"][:] = 10
        b["eos_token_ids"][:] = -1
        b["forced_token_ids"][:] = -1
        b["logprob_requested"][:] = flag
        results.append((program(b)[0], b["completion_records"].clone()))
    assert torch.equal(results[0][0], results[1][0])
    header_without_payload_mask = [i for i in range(24) if i != 6]
    assert torch.equal(results[0][1][..., header_without_payload_mask], results[1][1][..., header_without_payload_mask])


runner = CliRunner()


def test_cli_validate_exit_codes(toy_core, core_copy):
    result = runner.invoke(app, ["validate-core", str(toy_core)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["validate-core", str(toy_core), "--json"])
    assert json.loads(result.stdout) == {"core": str(toy_core), "valid": True, "violations": [],
                                         "digest": validate_core(toy_core, check_graphs=False).digest}
    core_copy.edit("manifest.json", lambda m: m.update(capacities=[3]))
    result = runner.invoke(app, ["validate-core", str(core_copy.root)])
    assert result.exit_code == 1 and "CATALOG-CAPACITIES" in result.output and "Traceback" not in result.output
    assert runner.invoke(app, ["validate-core"]).exit_code == 2


def test_cli_inspect(toy_core):
    result = runner.invoke(app, ["inspect-core", str(toy_core), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["features"] == {"allow_logprobs": True, "explicit_ids": True,
                                   "prompt_logprobs": False, "structured_output": True, "k": 20}
    assert [v["name"] for v in summary["variants"]] == ["decode.c1", "decode.c4", "prefill.t256"]
    assert summary["memory"]["completion_frame_bytes"] > 0
    result = runner.invoke(app, ["inspect-core", str(toy_core), "--memory"])
    assert result.exit_code == 0 and "decode.c4" in result.output


@pytest.mark.parametrize("args,code,message", [
    (["--recipe", "nope"], 2, "unknown recipe 'nope'"),
    (["--recipe", "toy", "--capacities", "1,x"], 2, "comma-separated integers"),
    (["--recipe", "toy", "--capacities", "0"], 2, "capacities must be distinct positive integers"),
    (["--recipe", "toy", "--completion-token-capacity", "-3"], 2, "--completion-token-capacity must be >= 0"),
])
def test_cli_export_errors(tmp_path, args, code, message):
    result = runner.invoke(app, ["export-core", "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_cli_toy_checkpoint_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{trunc")
    result = runner.invoke(app, ["export-core", str(bad), "--recipe", "toy", "--out", str(tmp_path / "y")])
    assert result.exit_code == 1 and "not a readable safetensors file" in result.output
    assert not (tmp_path / "y").exists()


def test_export_prepares_kernels_for_every_variant(tmp_path):
    out = tmp_path / "prepared"
    timings = export_core(ExportOptions(recipe="toy", capacities=(1, 4), targets=("cuda:90", "cuda:120")), out)
    assert list(timings)[:2] == ["build", "prepare"]  # kernels are prepared before any capture
    report = validate_core(out)
    assert report.ok, report.violations
    catalog = json.loads((out / "catalog.json").read_text())
    table = json.loads((out / "kernels.json").read_text())
    prepared = {(k["key"], k["target"]) for k in table["kernels"]}
    for variant in catalog["variants"]:
        assert len(variant["launches"]) == 4
        assert {(key, t) for key in variant["launches"] for t in ("cuda:90", "cuda:120")} <= prepared
    table["kernels"] = [k for k in table["kernels"] if not (k["target"] == "cuda:120" and "merge" in k["key"])]
    (out / "kernels.json").write_text(json.dumps(table))
    from conftest import CoreCopy
    CoreCopy(out).rehash("kernels.json")
    assert "KERNEL-MISSING" in {v.rule for v in validate_core(out, check_graphs=False).violations}


def test_unknown_target_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["export-core", "--recipe", "toy", "--out", str(tmp_path / "z"), "--targets", "cuda:75"])
    assert result.exit_code == 2 and "unknown kernel target(s) 'cuda:75'" in " ".join(result.output.split())
    assert not (tmp_path / "z").exists()
