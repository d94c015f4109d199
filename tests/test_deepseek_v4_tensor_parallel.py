"""``deepseek_v4`` exported with --tensor-parallel 2 and run over gloo, against TP=1 (recipes/sharding.py).

The checkpoint is examples/make_tiny_deepseek_v4.py's first 3 layers (HCA, CSA and sliding attention; two hash-routed
MoE layers, then a top-k one): 4 query heads in 2 output groups, 8 index heads, experts of width 32, so each rank
holds 2 heads and their sinks, 1 group, 4 index heads and 16 columns of every expert. The core: capacity 1, 16-row
chunks over the window of 8, 64 positions, prompt scoring. The TP=1 reference runs the same recipe's graph modules
eagerly (tests/_tp_cores.py ``eager_core``); the TP=2 core is exported (export validates every rank's graphs) and run
by tests/_tp_runner.py (rank 0 in a subprocess that starts rank 1), as tests/test_tensor_parallel.py runs its cores.

Values: each rank's experts' partial outputs are weighted and summed before the one reduction, and the indexer's
head sums are added per rank, so the hidden states round differently from TP=1 (as deepseek_v3's MoE does). The
greedy tokens, the alternatives' ids and order and the prompt rows' ranks are the same, and every logprob is within
``TOL`` of TP=1's (FP32; ``-s`` prints the worst difference). The prompts are the export test's, whose indexer
rankings it checks to be far from ties, so rounding cannot change an entry's choice.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _tp_cores import eager_core
from _tp_runner import as_json
from conftest import CoreCopy
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.registry import build_recipe
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from ignition.validate.core import validate_core

pytest.importorskip("transformers")

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
make_tiny = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny)

RUNNER = Path(__file__).with_name("_tp_runner.py")
CHUNK, MAX_SEQ = 16, 64
TOL = 1e-5  # FP32 logprobs of O(1)-O(10) magnitude: a wrong shard, head scale or reduction moves them by far more
# tests/test_deepseek_v4_export.py's sequences, whose indexer rankings it checks tie-free (ranking_gaps)
PROMPTS = ([(11 * i + 7) % 300 for i in range(40)],  # three chunks: 10 CSA entries of which each row keeps 3
           [(5 * i + 1) % 300 for i in range(21)])


def options(checkpoint: Path, ranks: int) -> ExportOptions:
    return ExportOptions(recipe="deepseek_v4", checkpoint=checkpoint, capacities=(1,), chunk_limit=CHUNK,
                         max_seq_len=MAX_SEQ, prompt_logprobs=True, tensor_parallel=ranks)


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    """(checkpoint, the TP=2 core, its manifest, the requests, TP=1's results, TP=2's results)."""
    root = tmp_path_factory.mktemp("dsv4-tp")
    checkpoint = make_tiny.make_checkpoint(root / "ckpt", layers=3)
    export_core(options(checkpoint, 2), root / "tp2")
    manifest = json.loads((root / "tp2" / "manifest.json").read_text())
    shard = manifest["tensor_parallel"]["vocab_shard"]
    ids = [0, shard - 1, shard, manifest["vocab_size"] - 1, 17]  # both sides of the shard boundary, the last id
    fields = [dict(prompt_ids=PROMPTS[0], max_tokens=6, logprobs=20, prompt_logprobs=20, ignore_eos=True),
              dict(prompt_ids=PROMPTS[1], max_tokens=4, logprob_token_ids=ids, ignore_eos=True)]
    with torch.no_grad():
        reference = [as_json(r) for r in Engine(eager_core(options(checkpoint, 1))).generate(
            [Request(**f) for f in fields])]
    (root / "requests.json").write_text(json.dumps(fields))
    done = subprocess.run([sys.executable, str(RUNNER), str(root / "tp2"), "2", "--requests",
                           str(root / "requests.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])["results"][0]
    return checkpoint, root / "tp2", manifest, fields, reference, results


def test_tp2_matches_tp1_generation_and_prompt_logprobs(cores):
    *_, fields, reference, results = cores
    worst = 0.0
    for ref, result in zip(reference, results, strict=True):
        assert result["error"] is None and result["tokens"] == ref["tokens"]  # the same greedy tokens
        for ref_entry, entry in zip(ref["entries"], result["entries"], strict=True):
            assert entry["id"] == ref_entry["id"]
            assert [i for i, _ in entry["top"]] == [i for i, _ in ref_entry["top"]]  # ids and order
            pairs = [(entry["logprob"], ref_entry["logprob"])] + [(v, w) for (_, v), (_, w) in
                                                                   zip(entry["top"], ref_entry["top"])]
            worst = max([worst] + [abs(v - w) for v, w in pairs])
    assert [i for i, _ in results[1]["entries"][0]["top"]] == fields[1]["logprob_token_ids"]  # caller order
    prompt, ref_prompt = results[0]["prompt"], reference[0]["prompt"]
    assert len(prompt) == len(PROMPTS[0]) and prompt[0] is None and ref_prompt[0] is None
    for entry, ref_entry in zip(prompt[1:], ref_prompt[1:], strict=True):
        assert (entry["id"], entry["rank"]) == (ref_entry["id"], ref_entry["rank"])
        assert [t["id"] for t in entry["top_logprobs"]] == [t["id"] for t in ref_entry["top_logprobs"]]
        pairs = [(entry["logprob"], ref_entry["logprob"])] + [
            (t["logprob"], u["logprob"]) for t, u in zip(entry["top_logprobs"], ref_entry["top_logprobs"])]
        worst = max([worst] + [abs(v - w) for v, w in pairs])
    print(f"deepseek_v4 TP=2 against TP=1: max |logprob difference| {worst:.3g}")
    assert worst < TOL


def test_shards_split_heads_groups_index_heads_and_experts(cores):
    """Query heads (wq_b rows), their sinks, output groups (wo_a rows, wo_b columns), index heads (the indexer's
    wq_b and weights_proj rows) and expert widths split; the K=V head, compressors, router and hyper-connections
    replicated; the state declared whole on every rank, as TP=1 declares it."""
    checkpoint, _, manifest, *_ = cores
    shards = manifest["tensor_parallel"]["shards"]
    expected = {
        "layers.0.wq_b": ("column", 0, [128, 32], [64, 32]),  # 4 heads x 32
        "layers.0.attn_sink": ("column", 0, [4], [2]),
        "layers.0.wo_a": ("column", 0, [32, 64], [16, 64]),  # 2 groups x 16 rows, each over 2 heads x 32
        "layers.0.wo_b": ("row", 1, [64, 32], [64, 16]),
        "layers.1.indexer.wq_b": ("column", 0, [128, 32], [64, 32]),  # 8 index heads x 16
        "layers.1.indexer.weights_proj": ("column", 0, [8, 64], [4, 64]),
        "layers.2.experts.3.w1": ("column", 0, [32, 64], [16, 64]),
        "layers.2.experts.3.w2": ("row", 1, [64, 32], [64, 16]),
        "layers.0.shared.w3": ("column", 0, [32, 64], [16, 64]),
    }
    for name, (kind, dim, full, shard) in expected.items():
        assert shards[name] == {"kind": kind, "dim": dim, "full": full, "shard": shard}, name
    for name in ("layers.0.wq_a", "layers.0.wkv", "layers.0.compressor.wkv", "layers.1.indexer.wkv",
                 "layers.1.indexer.ape", "layers.0.router", "layers.2.router_bias", "layers.0.tid2eid",
                 "layers.0.hc_attn_fn", "hc_head_fn", "final_norm"):
        assert shards[name]["kind"] == "replicated" and shards[name]["dim"] is None, name
    assert shards["lm_head"]["kind"] == shards["embed"]["kind"] == "vocabulary"
    single = {decl.name: decl.shape for decl in build_recipe(options(checkpoint, 1)).state}
    assert {s["name"]: s["shape"] for s in manifest["state"]} == single  # one K=V head: whole on every rank


def test_validate_core_passes_on_every_rank(cores):
    """validate-core loads and checks both ranks' graphs (collectives over 2 ranks); a rank count the heads do not
    divide is refused (TP-RANKS), one K=V head is not (every rank holds it whole)."""
    _, tp2, *_ = cores
    checked = CliRunner().invoke(app, ["validate-core", str(tp2)])
    assert checked.exit_code == 0, checked.output
    copy = CoreCopy(tp2.parent / "tampered")
    shutil.copytree(tp2, copy.root)
    copy.edit("manifest.json", lambda manifest: manifest["tensor_parallel"].update(ranks=3))
    found = [v for v in validate_core(copy.root, check_graphs=False).violations if v.rule == "TP-RANKS"]
    assert any("model.num_heads" in v.where for v in found) and not any("num_kv_heads" in v.where for v in found)


def test_sizes_that_do_not_divide_are_refused_by_field(cores):
    with pytest.raises(RecipeError) as error:
        build_recipe(options(cores[0], 3))
    for field in ("num_heads = 4", "o_groups = 2", "index_heads = 8", "moe.intermediate_size = 32"):
        assert field in str(error.value), str(error.value)


def test_scoring_cost_per_rank(cores):
    """``inspect-core --memory-budget`` on the sharded core: each rank's fixed bytes (the scored variant's prompt
    buffers, which every rank allocates, and that rank's own scored graph) and the KV tokens they displace from one
    device's budget; the state is whole per rank, so a token costs what it costs at TP=1."""
    _, tp2, manifest, *_ = cores
    budget = 1 << 22
    inspected = CliRunner().invoke(app, ["inspect-core", str(tp2), "--json", "--memory-budget", str(budget)])
    assert inspected.exit_code == 0, inspected.output
    memory = json.loads(inspected.output)["memory"]
    per_token = (32 + 16) * 4 // 4 + 32 * 4 // 8  # a CSA and an indexer entry every 4 positions, an HCA entry every 8
    assert memory["kv_bytes_per_token"] == per_token and memory["prompt_scoring_buffer_bytes"] > 0
    graphs = [(tp2 / entry["graphs"][f"scored.t{CHUNK}"]).stat().st_size
              for entry in manifest["tensor_parallel"]["rank_files"]]
    assert [rank["prompt_scoring_graph_bytes"] for rank in memory["ranks"]] == graphs
    for rank, graph in zip(memory["ranks"], graphs, strict=True):
        fixed = memory["prompt_scoring_buffer_bytes"] + graph
        assert rank["kv_tokens_with_scoring"] == (budget - fixed) // per_token
        assert rank["kv_tokens_without_scoring"] == budget // per_token
    assert memory["kv_tokens_with_scoring"] == min(rank["kv_tokens_with_scoring"] for rank in memory["ranks"])
    assert memory["kv_capacity_loss"] == max(rank["kv_capacity_loss"] for rank in memory["ranks"]) > 0
    print(f"scoring cost per rank: {[r['prompt_scoring_graph_bytes'] for r in memory['ranks']]} graph bytes, "
          f"{memory['prompt_scoring_buffer_bytes']} buffer bytes, {memory['kv_capacity_loss']:.1%} of {budget} bytes")
