"""End to end over gloo: a tiny Qwen3 and a tiny DeepSeek-V3 exported with --tensor-parallel 2 against TP=1.

The vocabulary (151) does not divide by 2: the shards pad it to 152 and the padding lane never
enters a result. Rank 0 runs in a subprocess (tests/_tp_runner.py) that runs every core in turn
and starts the other ranks itself; a Qwen3 with 4 KV heads also runs at TP=4 (four processes). Prompt
scoring (ranks identical, its traced exchanges) and the reduction's bit-level claims on adversarial
logits at TP=2 and TP=4 are in test_vocabulary_logprobs.py; the Qwen3
core (tests/_tp_cores.py, shared with test_serve_tensor_parallel.py, which serves it over HTTP with
prompt scoring) also prepares the six sharded launches for cuda:90.

The DeepSeek-V3 checkpoint (tests/_decoder_cores.py ``TINY_MOE``) has a dense first layer and an MoE
second layer: low-rank queries (q_a/q_b), the MLA latent cache, an untied LM head, group-limited
sigmoid routing and a shared expert. Qwen3-MoE shards by the same expert rules with a softmax router;
to stay within the suite's time budget its shard table is checked from the recipe build, not an export.

Values: the dense model's row-parallel sums keep the single-rank order (test_row_reduction.py), so
its logits are TP=1's and only the normalization differs: at most 2 ulp of lse, measured here at most
4 ulp of the value (|value| ~ 3-5) on one machine and 1 ulp on another; the bound is 8. In an MoE block the routing weights multiply each
rank's partial expert outputs, so DeepSeek-V3's logits differ by rounding too (and the weights,
scaled by routed_scaling_factor 2.5, amplify it): measured 8 ulp, bound 16. A wrong shard, owner,
routing or normalization moves a value by far more than either (``-s`` prints each recipe's worst case).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _decoder_cores import TinyCase, save_checkpoint
from _tp_cores import ULPS as TP_ULPS
from _tp_cores import VOCAB, close, eager_core, shared_tp_cores, ulps
from _tp_runner import as_json, requests
from conftest import CoreCopy
from ignition.catalog.parallel import SCORING_LAUNCHES, VOCABULARY_LAUNCHES
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.registry import build_recipe
from ignition.recipes.sharding import check_tensor_parallel, shard_config
from ignition.runtime.engine import Engine
from ignition.validate.core import validate_core
from ignition.validate.kernels import check_sharded_launches

RUNNER = Path(__file__).with_name("_tp_runner.py")
RECIPES = ("qwen3", "deepseek_v3")  # last: the runner kills its rank 1
ULPS = {"qwen3": TP_ULPS, "deepseek_v3": 16}
MOE_CASES = {"qwen3_moe": TinyCase("qwen3_moe", torch.float32, True, VOCAB),
             "deepseek_v3": TinyCase("deepseek_v3", torch.float32, False, VOCAB)}


def options_for(recipe: str, checkpoint: Path, ranks: int) -> ExportOptions:
    """Blocks of 8: the pool (4 blocks, the null one included) holds 24 tokens, room for a prefix hit."""
    return ExportOptions(recipe=recipe, checkpoint=checkpoint, capacities=(1,), chunk_limit=8, max_seq_len=32,
                         tensor_parallel=ranks, block_size=8)


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    """recipe -> (checkpoint, TP=1 reference results, TP=2 core or None), and the MoE checkpoints.

    The TP=1 reference runs the same recipe's graph modules eagerly in this process (what the exported
    graphs run), which saves an export; the TP=2 cores are exported (export validates them). The Qwen3
    core is tests/_tp_cores.py's; only DeepSeek-V3 is exported here; Qwen3-MoE is only saved.
    """
    shared = shared_tp_cores(tmp_path_factory)
    root = tmp_path_factory.mktemp("tensor-parallel")
    made = {}
    with torch.no_grad():
        made["qwen3"] = (shared.checkpoint, reference_results_of(shared.options(1)), shared.tp2)
        for recipe, case in MOE_CASES.items():
            checkpoint = root / recipe / "ckpt"
            save_checkpoint(case, checkpoint, reload=False)
            made[recipe] = (checkpoint, None, None)
        checkpoint = made["deepseek_v3"][0]
        export_core(options_for("deepseek_v3", checkpoint, 2), root / "deepseek_v3" / "tp2")
        made["deepseek_v3"] = (checkpoint, reference_results_of(options_for("deepseek_v3", checkpoint, 1)),
                               root / "deepseek_v3" / "tp2")
    return made


def reference_results_of(options: ExportOptions) -> list[dict]:
    return [as_json(r) for r in Engine(eager_core(options)).generate(requests())]


@pytest.fixture(scope="module")
def sharded(cores):
    """One runner process over every TP=2 core (saves a process start per core), with the prefix-caching runs, then
    rank 1 of the last killed."""
    report = run([cores[recipe][2] for recipe in RECIPES], 2, kill=True, prefix=True)
    return dict(zip(RECIPES, report["results"], strict=True)), report


def run(cores: list[Path], ranks: int, kill: bool = False, prefix: bool = False) -> dict:
    done = subprocess.run([sys.executable, str(RUNNER), ",".join(map(str, cores)), str(ranks)]
                          + (["--kill"] if kill else []) + (["--prefix"] if prefix else []),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_sharded_core_declares_its_ranks(cores):
    tp2 = cores["qwen3"][2]
    manifest = json.loads((tp2 / "manifest.json").read_text())
    section = manifest["tensor_parallel"]
    assert section["ranks"] == 2 and manifest["vocab_padded"] == 152 and section["vocab_shard"] == 76
    assert section["shards"]["embed"] == {"kind": "vocabulary", "dim": 0, "full": [152, 32], "shard": [76, 32]}
    assert section["shards"]["layers.0.o_proj"]["kind"] == "row"
    assert [e["words"] for e in section["exchanges"]] == [256, 256, 64, 64]
    state = {s["name"]: s["shape"] for s in manifest["state"]}
    assert state["k_cache"][3] == 1 and state["penalty_counts"][2] == 152  # one KV head per rank
    assert sorted(section["rank_files"][1]["graphs"]) == ["decode.c1", "prefill.t8", "scored.t8"]


def test_moe_and_mla_cores_declare_their_shards(cores):
    """Router replicated, each expert split like an MLP (gate/up rows, down columns), MLA split by heads."""
    shards = {"qwen3_moe": build_recipe(options_for("qwen3_moe", cores["qwen3_moe"][0], 2)).parallel.shards,
              "deepseek_v3": json.loads((cores["deepseek_v3"][2] / "manifest.json").read_text())["tensor_parallel"]
              ["shards"]}
    for recipe, table in shards.items():
        assert table["layers.1.router"]["kind"] == "replicated", recipe
        assert table["layers.1.experts.3.gate_proj"] == {"kind": "column", "dim": 0, "full": [16, 32], "shard": [8, 32]}
        assert table["layers.1.experts.0.down_proj"] == {"kind": "row", "dim": 1, "full": [32, 16], "shard": [32, 8]}
        assert table["layers.0.up_proj"]["full"] == [64, 32] and table["layers.0.up_proj"]["shard"] == [32, 32]
    mla = shards["deepseek_v3"]
    assert mla["layers.1.router_bias"]["kind"] == "replicated" and mla["layers.1.shared.up_proj"]["shard"] == [8, 32]
    for name in ("q_a_proj", "q_a_norm", "kv_a_proj", "kv_a_norm"):  # every rank caches the same latent
        assert mla[f"layers.0.{name}"]["kind"] == "replicated", name
    assert mla["layers.0.q_b_proj"] == {"kind": "column", "dim": 0, "full": [96, 24], "shard": [48, 24]}  # 2 heads x 24
    assert mla["layers.0.kv_b_proj"] == {"kind": "column", "dim": 0, "full": [112, 16], "shard": [56, 16]}  # 2 x (16+12)
    assert mla["layers.0.o_proj"] == {"kind": "row", "dim": 1, "full": [32, 48], "shard": [32, 24]}
    state = {s["name"]: s["shape"] for s in
             json.loads((cores["deepseek_v3"][2] / "manifest.json").read_text())["state"]}
    assert state["latent_cache"] == [2, 4, 8, 16] and state["rope_key_cache"] == [2, 4, 8, 8]  # whole pools per rank


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_matches_tp1(cores, sharded, recipe):
    reference_results, results = cores[recipe][1], sharded[0][recipe]
    worst = []  # (ulps, abs) of every value
    for reference, result in zip(reference_results, results, strict=True):
        assert result["error"] is None and result["tokens"] == reference["tokens"]  # greedy tokens identical
        for ref_entry, entry in zip(reference["entries"], result["entries"], strict=True):
            assert entry["id"] == ref_entry["id"]
            assert [i for i, _ in entry["top"]] == [i for i, _ in ref_entry["top"]]  # ids and order identical
            pairs = [(entry["logprob"], ref_entry["logprob"])] + [(v, w) for (_, v), (_, w) in
                                                                   zip(entry["top"], ref_entry["top"])]
            assert all(close(v, w, ULPS[recipe]) for v, w in pairs), pairs
            worst += [(ulps(v, w), abs(v - w)) for v, w in pairs]
    print(f"{recipe}: {len(worst)} values, max {max(u for u, _ in worst):.0f} ulp, max abs {max(a for _, a in worst):.3g}")
    explicit = results[1]["entries"][0]["top"]
    assert [i for i, _ in explicit] == [0, 150, 7, 75, 76, 3]  # caller order, across the shard boundary


def test_tp2_prefix_hits_give_the_uncached_results(sharded):
    """A TP=2 core reuses prefixes (runtime/paging.py): the second request's first block comes from the cache on
    both ranks, its penalty counts seeded on both, and its tokens and logprobs are the uncached ones (FP32's
    chunk-split tolerance allowed). DeepSeek-V3's MLA pools, blocks of 8; the shared Qwen3 core's pool (blocks of
    16, 16 tokens) has no room for a hit."""
    prefixes = dict(zip(RECIPES, sharded[1]["prefix"], strict=True))
    assert prefixes["qwen3"] is None
    prefix = prefixes["deepseek_v3"]
    assert prefix["block_size"] == 8 and prefix["hits"] == 8  # the prompt's one full block, found by the second
    for warm, cold in zip(prefix["warm"], prefix["cold"], strict=True):
        assert warm["error"] is None and warm["tokens"] == cold["tokens"]
        for got, want in zip(warm["entries"], cold["entries"], strict=True):
            assert got["id"] == want["id"] and [i for i, _ in got["top"]] == [i for i, _ in want["top"]]
            assert abs(got["logprob"] - want["logprob"]) <= 2e-5, (got, want)


def test_tp4_matches_tp1(tmp_path_factory):
    """A dense Qwen3 with 4 KV heads at --tensor-parallel 4 (four gloo processes): the same tokens, ids and order as
    TP=1, explicit ids across three shard boundaries, and values within the dense bound (docs/benchmarks.md
    measures TP=4 bit-identical on the example checkpoint)."""
    root = tmp_path_factory.mktemp("tp4")
    checkpoint = root / "ckpt"
    save_checkpoint(TinyCase("qwen3", torch.float32, True, VOCAB, kv_heads=4), checkpoint, reload=False)
    with torch.no_grad():
        reference_results = reference_results_of(options_for("qwen3", checkpoint, 1))
    export_core(options_for("qwen3", checkpoint, 4), root / "tp4")
    assert json.loads((root / "tp4" / "manifest.json").read_text())["tensor_parallel"]["vocab_shard"] == 38
    results = run([root / "tp4"], 4)["results"][0]
    for reference, result in zip(reference_results, results, strict=True):
        assert result["error"] is None and result["tokens"] == reference["tokens"]
        for ref_entry, entry in zip(reference["entries"], result["entries"], strict=True):
            assert entry["id"] == ref_entry["id"]
            assert [i for i, _ in entry["top"]] == [i for i, _ in ref_entry["top"]]
            pairs = [(entry["logprob"], ref_entry["logprob"])] + [(v, w) for (_, v), (_, w) in
                                                                   zip(entry["top"], ref_entry["top"])]
            assert all(close(v, w, ULPS["qwen3"]) for v, w in pairs), pairs
    assert [i for i, _ in results[1]["entries"][0]["top"]] == [0, 150, 7, 75, 76, 3]  # shards of 38 ids


def test_ranks_of_one_kv_head_export_and_run_with_several_slots(tmp_path_factory):
    """Two KV heads at --tensor-parallel 2 on two slots: each rank reads one KV head of a narrowed cache window,
    which torch's contiguity query once guarded to the full cache length (an export error); every variant exports,
    and the ranks give TP=1's tokens and ids."""
    root = tmp_path_factory.mktemp("one-kv-head")
    checkpoint = root / "ckpt"
    save_checkpoint(TinyCase("qwen3", torch.float32, True, VOCAB, kv_heads=2), checkpoint, reload=False)
    options = {ranks: ExportOptions(recipe="qwen3", checkpoint=checkpoint, capacities=(1, 2), chunk_limit=8,
                                    max_seq_len=32, tensor_parallel=ranks) for ranks in (1, 2)}
    with torch.no_grad():
        reference_results = reference_results_of(options[1])
    export_core(options[2], root / "tp2")
    results = run([root / "tp2"], 2)["results"][0]
    for reference, result in zip(reference_results, results, strict=True):
        assert result["error"] is None and result["tokens"] == reference["tokens"]
        assert [e["id"] for e in result["entries"]] == [e["id"] for e in reference["entries"]]


def test_a_dead_rank_fails_cleanly(sharded):
    report = sharded[1]
    assert "rank 1 exited with code -9" in report["failure"], report["failure"]
    assert report["failure_seconds"] < 30  # a clean error, not a wait for the process-group timeout


def test_sizes_that_do_not_divide_are_refused_by_field(cores):
    """Heads, the dense MLP and each expert's width must divide by N; the error names every field that does not."""
    for recipe, fields in (("qwen3_moe", ["num_heads = 4", "num_kv_heads = 2", "intermediate_size = 64",
                                          "moe.intermediate_size = 16 is not divisible by 3 (config.json "
                                          "moe_intermediate_size"]),
                           ("deepseek_v3", ["num_heads = 4 is not divisible by 3 (config.json num_attention_heads",
                                            "moe.intermediate_size = 16"])):
        with pytest.raises(RecipeError) as error:
            build_recipe(options_for(recipe, cores[recipe][0], 3))
        assert all(field in str(error.value) for field in fields), str(error.value)
        assert "num_kv_heads" not in str(error.value) or recipe != "deepseek_v3"  # MLA has no KV heads to divide
    # an expert width alone: 8 heads divide by 8, 12 expert rows do not; an all-MoE model's dense width is unused
    moe = SimpleNamespace(intermediate_size=12)
    cfg = SimpleNamespace(num_heads=8, intermediate_size=36, moe=moe, moe_layers=(0, 1), dense_mlp_layers=())
    with pytest.raises(RecipeError, match=r"^--tensor-parallel 8: .*: moe.intermediate_size = 12 is not divisible by "
                                          r"8 \(config.json moe_intermediate_size: each routed and shared expert's "
                                          r"width\) \("):
        check_tensor_parallel("deepseek_v3", cfg, 8)


def test_shard_config_divides_heads_and_expert_widths(cores):
    from ignition.recipes.deepseek_v3 import DeepseekV3Config
    from ignition.recipes.checkpoint import read_config

    cfg = DeepseekV3Config.from_hf_config(read_config(cores["deepseek_v3"][0]), "config.json")
    rank = shard_config(cfg, 2)
    assert (rank.num_heads, rank.intermediate_size, rank.moe.intermediate_size) == (2, 32, 8)
    assert (rank.kv_lora_rank, rank.moe.num_experts, rank.moe.shared_intermediate_size) == (16, 4, 8)


def test_export_prepares_the_six_sharded_launches_once_for_every_rank(cores):
    """--targets cuda:90: one kernel table entry per launch and shape (both ranks and every variant share the
    binaries); each variant lists the six generation launches in catalog order, and scored.t8 then the seven
    scoring launches of its 8-row block; validate-core passes, and KERNEL-SHARDED refuses a table of the wrong
    rank count or sharded launches on a single-rank core."""
    tp2 = cores["qwen3"][2]
    manifest = json.loads((tp2 / "manifest.json").read_text())
    catalog = json.loads((tp2 / "catalog.json").read_text())
    table = json.loads((tp2 / manifest["kernels"]).read_text())
    names = [f"vocab.{launch.name}" for launch in VOCABULARY_LAUNCHES]
    scoring = [f"score.{launch.name}" for launch in SCORING_LAUNCHES]
    by_key = {entry["key"]: entry for entry in table["kernels"]}
    assert table["targets"] == ["cuda:90"] and sorted(by_key[k]["name"] for k in by_key) == sorted(names + scoring)
    launches = {v["name"]: [by_key[key]["name"] for key in v["launches"]] for v in catalog["variants"]}
    assert launches == {"prefill.t8": names, "decode.c1": names, "scored.t8": names + scoring}
    decode = next(v for v in catalog["variants"] if v["name"] == "decode.c1")
    assert {by_key[key]["constexprs"].get("RANKS") for key in decode["launches"]} == {None, 2}
    assert by_key[decode["launches"][0]]["grid"] == [1, 1]  # one row, one tile of the 76-lane shard
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
    tp2 = cores["qwen3"][2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_launcher_emulation.py")), str(tp2)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"sharded-rows1-k20", "scoring-rows8", "launches"}
    assert {case: problems for case, problems in results.items() if problems} == {}


@pytest.mark.parametrize("recipe,rule,mutate", [
    ("qwen3", "TP-RANKS", lambda tp: tp.update(ranks=3)),
    ("qwen3", "TP-RANKS", lambda tp: tp.update(vocab_shard=75)),
    ("qwen3", "TP-SHARD", lambda tp: tp["shards"]["layers.0.q_proj"].update(full=[32, 32])),
    ("qwen3", "TP-SHARD", lambda tp: tp["shards"].pop("layers.1.down_proj")),
    ("qwen3", "TP-EXCHANGE", lambda tp: tp["exchanges"][1].update(words=512)),
    ("qwen3", "TP-VARIANTS", lambda tp: tp["rank_files"][1]["graphs"].pop("decode.c1")),
    ("qwen3", "TP-VARIANTS", lambda tp: tp["rank_files"][0].update(weights="ranks/0/weights.safetensors")),
    ("deepseek_v3", "TP-SHARD", lambda tp: tp["shards"]["layers.1.experts.2.down_proj"].update(dim=0)),
    ("deepseek_v3", "TP-SHARD", lambda tp: tp["shards"].pop("layers.1.shared.gate_proj")),
    ("deepseek_v3", "TP-SHARD", lambda tp: tp["shards"]["layers.0.kv_a_proj"].update(kind="column")),
    ("deepseek_v3", "TP-RANKS", lambda tp: tp.update(ranks=3)),
])
def test_validator_names_each_broken_tensor_parallel_fact(cores, tmp_path, recipe, rule, mutate):
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(cores[recipe][2], copy.root)
    copy.edit("manifest.json", lambda manifest: mutate(manifest["tensor_parallel"]))
    report = validate_core(copy.root, check_graphs=False)
    assert rule in {v.rule for v in report.violations}, report.violations

