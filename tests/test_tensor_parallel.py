"""End to end over gloo: a tiny Qwen3 exported with --tensor-parallel 2 against the same recipe at TP=1.

The vocabulary (151) does not divide by 2: the shards pad it to 152 and the padding lane never
enters a result. Rank 0 runs in a subprocess (tests/_tp_runner.py) and starts rank 1 itself.
TP=4, prompt scoring (ranks identical, its traced exchanges) and the reduction's bit-level claims
on adversarial logits are in test_vocabulary_logprobs.py; to stay within the suite's time budget
this core has no scored-prefill variants.

Values: the sharded model sums the row-parallel o/down partial products over ranks, so its FP32
logits differ from TP=1's by rounding; the reduction adds at most 2 ulp of the normalization
(test_vocabulary_logprobs.py). Measured end to end here: at most 4 ulp (|value| ~ 3-5), so the
bound below is 8 ulp of the value's magnitude, while a wrong shard, owner or normalization moves a
value by far more than that.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from _tp_runner import as_json, requests
from conftest import CoreCopy
from ignition.catalog.enums import Role
from ignition.catalog.parallel import VOCABULARY_LAUNCHES
from ignition.exporter.export import export_core, manifest_for
from ignition.recipes.base import ExportOptions
from ignition.recipes.registry import build_recipe
from ignition.runtime.core import LoadedCore, LoadedVariant
from ignition.runtime.engine import Engine
from ignition.runtime.transfer import HostTransfer
from ignition.validate.kernels import check_sharded_launches
from ignition.validate.core import validate_core

VOCAB = 151
RUNNER = Path(__file__).with_name("_tp_runner.py")
ULPS = 8


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    """(TP=1 reference results, TP=2 core) of one tied-embedding checkpoint: prefill.t8 and decode.c1.

    The TP=1 reference runs the same recipe's graph modules eagerly in this process (what the exported
    graphs run), which saves an export; the TP=2 core is exported, validated and run over gloo.
    """
    root = tmp_path_factory.mktemp("tensor-parallel")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5 if parameter.dim() > 1
                            else 1.0 + 0.1 * torch.randn_like(parameter))
    model.save_pretrained(root / "ckpt")
    options = {ranks: ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1,), chunk_limit=8,
                                    max_seq_len=32, tensor_parallel=ranks, targets=targets)
               for ranks, targets in ((1, ()), (2, ("cuda:90",)))}  # TP=2 also prepares its sharded launches
    with torch.no_grad():
        reference = [as_json(r) for r in Engine(eager_core(options[1])).generate(requests())]
    export_core(options[2], root / "tp2")
    return reference, root / "tp2"


def eager_core(options: ExportOptions) -> LoadedCore:
    """A LoadedCore whose variants run the recipe's modules eagerly (no export, no validation)."""
    build = build_recipe(options)
    state = {decl.name: decl.empty() for decl in build.state}
    variants = {}
    for graph in build.graphs:
        v = graph.variant
        buffers = {a.name: build.weights[a.name] if a.role is Role.WEIGHT else state[a.name] if a.role is Role.STATE
                   else a.empty() for a in v.arguments}
        variants[v.name] = LoadedVariant(v.name, v.operation, v.capacity, v.arguments, v.bindings, v.layout,
                                         graph.module, buffers)
    manifest = manifest_for(build, options, {}, False)
    return LoadedCore(Path("eager"), manifest, build.weights, state, variants, transfer=HostTransfer(torch.device("cpu")))


def run(core: Path, ranks: int, kill: bool = False) -> dict:
    done = subprocess.run([sys.executable, str(RUNNER), str(core), str(ranks)] + (["--kill"] if kill else []),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def close(a: float, b: float) -> bool:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return (a is None) == (b is None) and (a is None or math.isnan(a) == math.isnan(b))
    return abs(a - b) <= ULPS * float(np.spacing(np.float32(max(abs(a), abs(b)))))  # FP32 ulps


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
    assert sorted(section["rank_files"][1]["graphs"]) == ["decode.c1", "prefill.t8"]


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


def test_export_prepares_the_six_sharded_launches_once_for_every_rank(cores):
    """--targets cuda:90: one kernel table entry per launch (both ranks and both variants share the binaries), the
    variants list them in catalog order, validate-core passes, and KERNEL-SHARDED refuses a table of the wrong
    rank count or sharded launches on a single-rank core."""
    _, tp2 = cores
    manifest = json.loads((tp2 / "manifest.json").read_text())
    catalog = json.loads((tp2 / "catalog.json").read_text())
    table = json.loads((tp2 / manifest["kernels"]).read_text())
    names = [f"vocab.{launch.name}" for launch in VOCABULARY_LAUNCHES]
    by_key = {entry["key"]: entry for entry in table["kernels"]}
    assert table["targets"] == ["cuda:90"] and sorted(by_key[k]["name"] for k in by_key) == sorted(names)
    reducing = [v for v in catalog["variants"] if v["contract"]["layout"].get("logprobs")]
    assert len(reducing) == 2 and all([by_key[key]["name"] for key in v["launches"]] == names for v in reducing)
    assert {by_key[key]["constexprs"].get("RANKS") for key in reducing[0]["launches"]} == {None, 2}
    assert by_key[reducing[0]["launches"][0]]["grid"] == [1, 1]  # one row, one tile of the 76-lane shard
    report = validate_core(tp2, check_graphs=False)
    assert report.ok, report.violations
    wider = json.loads(json.dumps(manifest))
    wider["tensor_parallel"]["ranks"] = 4
    assert {v.rule for v in check_sharded_launches(wider, catalog["variants"], table)} == {"KERNEL-SHARDED"}
    del wider["tensor_parallel"]
    assert {v.rule for v in check_sharded_launches(wider, catalog["variants"], table)} == {"KERNEL-SHARDED"}


def test_prepared_sharded_launcher_drives_the_kernels_exactly(cores):
    """Both ranks' PreparedVocabulary against an emulated CUDA driver in Triton's interpreter (one subprocess):
    parameters, grid and threads from the table; exchange and packed words equal to the reference stages'."""
    _, tp2 = cores
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_launcher_emulation.py")), str(tp2)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"sharded-rows1-k20", "launches"}
    assert {case: problems for case, problems in results.items() if problems} == {}


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
