"""End to end over gloo: a tiny Qwen3 exported with --tensor-parallel 2 against the same recipe at TP=1.

The vocabulary (151) does not divide by 2: the shards pad it to 152 and the padding lane never
enters a result. Rank 0 runs in a subprocess (tests/_tp_runner.py) and starts rank 1 itself.
TP=4, prompt scoring (ranks identical, its traced exchanges) and the reduction's bit-level claims
on adversarial logits are in test_vocabulary_logprobs.py; the same core served over HTTP (prompt
scoring included) is test_serve_tensor_parallel.py's.

Values: the sharded model sums the row-parallel o/down partial products over ranks, so its FP32
logits differ from TP=1's by rounding; the reduction adds at most 2 ulp of the normalization
(test_vocabulary_logprobs.py). Measured end to end here: at most 4 ulp (|value| ~ 3-5), so the
bound (tests/_tp_cores.py ULPS) is 8 ulp of the value's magnitude, while a wrong shard, owner or normalization moves a
value by far more than that.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _tp_cores import close, eager_core, shared_tp_cores
from _tp_runner import as_json, requests
from conftest import CoreCopy
from ignition.runtime.engine import Engine
from ignition.validate.core import validate_core

RUNNER = Path(__file__).with_name("_tp_runner.py")


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    """(TP=1 reference results, TP=2 core) of one tied-embedding checkpoint: prefill.t8, decode.c1, scored.t8.

    The TP=1 reference runs the same recipe's graph modules eagerly in this process (what the exported
    graphs run), which saves an export; the TP=2 core (tests/_tp_cores.py, shared with
    test_serve_tensor_parallel.py) is exported, validated and run over gloo.
    """
    shared = shared_tp_cores(tmp_path_factory)
    with torch.no_grad():
        reference = [as_json(r) for r in Engine(eager_core(shared.options(1))).generate(requests())]
    return reference, shared.tp2


def run(core: Path, ranks: int, kill: bool = False) -> dict:
    done = subprocess.run([sys.executable, str(RUNNER), str(core), str(ranks)] + (["--kill"] if kill else []),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_sharded_core_declares_its_ranks(cores):
    _, tp2 = cores
    manifest = json.loads((tp2 / "manifest.json").read_text())
    section = manifest["tensor_parallel"]
    assert section["ranks"] == 2 and manifest["vocab_padded"] == 152 and section["vocab_shard"] == 76
    assert section["shards"]["embed"] == {"kind": "vocabulary", "dim": 0, "full": [152, 32], "shard": [76, 32]}
    assert section["shards"]["layers.0.o_proj"]["kind"] == "row"
    assert [e["words"] for e in section["exchanges"]] == [256, 256, 64, 64]
    state = {s["name"]: s["shape"] for s in manifest["state"]}
    assert state["k_cache"][3] == 1 and state["penalty_counts"][2] == 152  # one KV head per rank
    assert sorted(section["rank_files"][1]["graphs"]) == ["decode.c1", "prefill.t8", "scored.t8"]


def test_tp2_matches_tp1_and_a_dead_rank_fails_cleanly(cores):
    reference_results, tp2 = cores
    sharded = run(tp2, 2, kill=True)
    for reference, result in zip(reference_results, sharded["results"], strict=True):
        assert result["error"] is None and result["tokens"] == reference["tokens"]  # greedy tokens identical
        for ref_entry, entry in zip(reference["entries"], result["entries"], strict=True):
            assert entry["id"] == ref_entry["id"]
            assert [i for i, _ in entry["top"]] == [i for i, _ in ref_entry["top"]]  # ids and order identical
            assert close(entry["logprob"], ref_entry["logprob"])
            assert all(close(v, w) for (_, v), (_, w) in zip(entry["top"], ref_entry["top"]))
    explicit = sharded["results"][1]["entries"][0]["top"]
    assert [i for i, _ in explicit] == [0, 150, 7, 75, 76, 3]  # caller order, across the shard boundary
    assert "rank 1 exited with code -9" in sharded["failure"], sharded["failure"]
    assert sharded["failure_seconds"] < 30  # a clean error, not a wait for the process-group timeout


@pytest.mark.parametrize("rule,mutate", [
    ("TP-RANKS", lambda tp: tp.update(ranks=3)),
    ("TP-RANKS", lambda tp: tp.update(vocab_shard=75)),
    ("TP-SHARD", lambda tp: tp["shards"]["layers.0.q_proj"].update(full=[32, 32])),
    ("TP-SHARD", lambda tp: tp["shards"].pop("layers.1.down_proj")),
    ("TP-EXCHANGE", lambda tp: tp["exchanges"][1].update(words=512)),
    ("TP-VARIANTS", lambda tp: tp["rank_files"][1]["graphs"].pop("decode.c1")),
    ("TP-VARIANTS", lambda tp: tp["rank_files"][0].update(weights="ranks/0/weights.safetensors")),
])
def test_validator_names_each_broken_tensor_parallel_fact(cores, tmp_path, rule, mutate):
    _, tp2 = cores
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(tp2, copy.root)
    copy.edit("manifest.json", lambda manifest: mutate(manifest["tensor_parallel"]))
    report = validate_core(copy.root, check_graphs=False)
    assert rule in {v.rule for v in report.violations}, report.violations
