"""The six prepared launches of the vocabulary-sharded reduction: kernels and launch plan.

One interpreter subprocess (tests/_triton_vocabulary_check.py) runs the Triton stages against the
torch reference stages at TP=2 and TP=4, gathers emulated by concatenation. The export with
``--tensor-parallel 2 --targets cuda:90``, its kernel table, validate-core and the prepared launcher
(emulated CUDA driver) are tested on the sharded core of tests/test_tensor_parallel.py.

Sharded prompt scoring's seven launches run in the same interpreter subprocess (the ``score_*`` cases);
its launch plan, export preparation per row block, capture check and KERNEL-SHARDED coverage are tested
here on the exporter's own plan without an export, and its prepared launcher on the seven cubins of one
row block compiled for cuda:90 (emulated driver).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _interpreted import case_names, interpreted_cases

from ignition.catalog.contract import NATURAL_K
from ignition.catalog.parallel import VOCABULARY_LAUNCHES
from ignition.components.vocabulary_logprobs import STAGE_OPS

HELPER = Path(__file__).with_name("_triton_vocabulary_check.py")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    return interpreted_cases(HELPER)


@pytest.mark.parametrize("case", case_names(HELPER))
def test_triton_stages_write_the_reference_words(interpreted, case):
    assert case in interpreted, f"case {case} did not run"
    assert interpreted[case] == [], "\n".join(interpreted[case])


def test_launch_plan_follows_the_catalog_and_ignores_the_rank():
    from ignition.components.triton_vocabulary import vocabulary_launch_plan

    plan = vocabulary_launch_plan(4, 37984, 4, NATURAL_K, True, torch.bfloat16)  # qwen3's vocabulary at TP=4
    assert [spec.name for spec in plan] == [f"vocab.{launch.name}" for launch in VOCABULARY_LAUNCHES]
    assert [launch.stage for launch in VOCABULARY_LAUNCHES] == ["statistics"] * 2 + ["candidates"] * 3 + ["merge"]
    assert [launch.before for launch in VOCABULARY_LAUNCHES if launch.before] == ["logprob_statistics",
                                                                                   "logprob_candidates"]
    tile, tiles = plan[0].constexprs["TILE"], plan[0].grid[1]
    assert (tiles - 1) * tile < 37984 <= tiles * tile and plan[3].grid == (4, tiles)
    for spec in plan:  # every parameter typed; constexprs exactly the "constexpr" parameters
        assert list(spec.signature) == spec.kernel.arg_names
        assert {n for n, t in spec.signature.items() if t == "constexpr"} == set(spec.constexprs)
        assert "vocab_start" not in spec.constexprs and "shard_lanes" not in spec.constexprs
    assert vocabulary_launch_plan(4, 37984, 4, NATURAL_K, True, torch.bfloat16) == plan  # no hidden state
    for args in [(0, 10, 2, 5, False, torch.float32), (2, 10, 0, 5, False, torch.float32),
                 (2, 10, 2, NATURAL_K + 1, False, torch.float32), (2, 10, 2, 5, False, torch.float64)]:
        with pytest.raises(ValueError, match="vocabulary_launch_plan"):
            vocabulary_launch_plan(*args)


def test_importing_ignition_registers_the_sharded_cuda_kernels():
    """The CUDA implementations of the three stage ops come with ``import ignition`` (device_reduction.py imports
    no Triton; tests/test_device.py proves serving never imports it)."""
    import ignition  # noqa: F401

    for op in ("vocab_shard_statistics", "vocab_shard_candidates", "merge_vocabulary_logprobs"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ignition::{op}", "CUDA"), op
    assert set(STAGE_OPS) == {launch.stage for launch in VOCABULARY_LAUNCHES}


def test_cuda_stage_ops_refuse_bad_layouts_and_missing_launchers(monkeypatch):
    """What the CUDA stage ops check before any launch (exercised on CPU tensors and a made-up device)."""
    from ignition.components import device_reduction as D

    rows = 3
    with pytest.raises(ValueError, match=r"statistics must be \[ranks \* 3, 256\].*requested must be int32"):
        D.check_stage_args("vocab_shard_candidates", rows, statistics=torch.zeros(5, 256),
                           requested=torch.ones(rows, dtype=torch.int64))
    with pytest.raises(ValueError, match="unit vocabulary stride"):
        D.check_stage_args("vocab_shard_statistics", rows, logits=torch.zeros(8, rows).t())
    D.check_stage_args("merge_vocabulary_logprobs", rows, statistics=torch.zeros(2 * rows, 256),
                       candidates=torch.zeros(2 * rows, 256), requested=torch.ones(rows, dtype=torch.int32))
    _refuses_missing_launchers(monkeypatch, D._vocabulary_launcher, "vocab_shard_statistics",
                               "merge_vocabulary_logprobs")


def _refuses_missing_launchers(monkeypatch, select, first_op: str, second_op: str) -> None:
    """``select`` (a sharded launcher lookup of device_reduction) on a made-up device: no launcher bound
    without the JIT opt-in, then a single-rank core's launcher bound."""
    from ignition.components import device_reduction as D

    device = torch.device("cuda", 7)
    monkeypatch.delenv(D.JIT_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{first_op} on cuda:7: no prepared kernels are loaded"):
        select(device, first_op)
    with D.bind_launcher(device, lambda *args: None):  # a single-rank core's launcher, bound while its graph runs
        with pytest.raises(RuntimeError, match=f"{second_op} on cuda:7: the loaded core's prepared kernels are "
                                               f"single-rank"):
            select(device, second_op)
    with pytest.raises(RuntimeError, match="no prepared kernels are loaded"):  # the binding ended with the block
        select(device, first_op)


@pytest.mark.cuda
def test_triton_stages_on_the_gpu_match_the_reference():
    """On a GPU: the same stage checks with the kernels compiled for the device (Triton JIT)."""
    env = dict(os.environ, IGNITION_TRITON_JIT="1")
    done = subprocess.run([sys.executable, str(HELPER), "--device", "cuda"], env=env, cwd=HELPER.parent.parent,
                          capture_output=True, text=True, timeout=600)
    failures = {r["case"]: r["failures"] for r in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert done.returncode == 0 and failures and not any(failures.values()), (failures, done.stderr[-3000:])


# ---- sharded prompt scoring: plan, export preparation, KERNEL-SHARDED, prepared launcher ----
def _scored_variant(rows: int, ranks: int = 2, vocab_shard: int = 912, dtype: str = "float32"):
    """A sharded SCORED_PREFILL variant of ``rows`` prompt rows as the exporter sees it, and its build."""
    from types import SimpleNamespace

    from ignition.catalog.buffers import PROMPT_TARGETS
    from ignition.catalog.enums import Operation
    from ignition.catalog.model import BufferDecl
    from ignition.components.prompt_scoring import prompt_arguments

    decls, _, scoring = prompt_arguments(rows)
    variant = SimpleNamespace(name=f"scored.t{rows}", operation=Operation.SCORED_PREFILL, capacity=rows,
                              arguments=decls + [BufferDecl("chunk_length", "int64", [1])],
                              layout={"logprobs": {"k": NATURAL_K, "explicit_ids": False}, "prompt_logprobs": scoring})
    assert scoring["targets"] == PROMPT_TARGETS
    build = SimpleNamespace(model={"dtype": dtype}, parallel=SimpleNamespace(ranks=ranks, vocab_shard=vocab_shard))
    return build, SimpleNamespace(variant=variant)


def _catalog_entry(variant, launches: list[str]) -> dict:
    return {"name": variant.name, "operation": int(variant.operation), "capacity": variant.capacity,
            "arguments": [a.to_json() for a in variant.arguments], "contract": {"layout": variant.layout},
            "launches": launches}


def _table(plan) -> dict:
    from ignition.exporter.kernels import launch_key

    return {"targets": ["cuda:90"], "kernels": [{"key": launch_key(s), "name": s.name, "target": "cuda:90",
                                                 "constexprs": dict(s.constexprs), "grid": list(s.grid)} for s in plan]}


def test_scoring_launch_plan_follows_the_catalog():
    from ignition.catalog.parallel import SCORING_LAUNCHES
    from ignition.components.triton_scoring import scoring_launch_plan
    from ignition.components.workspaces import stage_launches

    plan = scoring_launch_plan(64, 37984, 4, torch.bfloat16)
    assert [spec.name for spec in plan] == [f"score.{launch.name}" for launch in SCORING_LAUNCHES]
    assert [len(stage_launches(plan, s, SCORING_LAUNCHES)) for s in ("statistics", "candidates", "merge")] == [2, 4, 1]
    assert [launch.before for launch in SCORING_LAUNCHES if launch.before] == ["prompt_statistics",
                                                                               "prompt_candidates"]
    tile, tiles = plan[0].constexprs["TILE"], plan[0].grid[1]
    assert (tiles - 1) * tile < 37984 <= tiles * tile
    assert [spec.grid for spec in plan] == [(64, tiles), (64,), (64,), (64, tiles), (64, tiles), (64,), (64,)]
    assert plan[1].constexprs["SELECT"] == plan[3].constexprs["SELECT"] == plan[5].constexprs["PAIRS"] == NATURAL_K
    for spec in plan:
        assert list(spec.signature) == spec.kernel.arg_names
        assert {n for n, t in spec.signature.items() if t == "constexpr"} == set(spec.constexprs)
        assert "vocab_start" not in spec.constexprs and "shard_lanes" not in spec.constexprs
    for args in [(0, 10, 2, torch.float32), (65, 10, 2, torch.float32), (4, 10, 0, torch.float32),
                 (4, 10, 2, torch.float64)]:
        with pytest.raises(ValueError, match="scoring_launch_plan"):
            scoring_launch_plan(*args)


def test_export_prepares_the_scoring_launches_of_each_row_block():
    """A scored sharded variant of C=100 rows: the six generation launches, then seven for the 64-row block
    and seven for the 36-row remainder (scoring_row_blocks)."""
    from ignition.exporter.prepare import variant_plan

    build, graph = _scored_variant(100)
    plan = variant_plan(build, graph)
    assert [spec.name.split(".")[0] for spec in plan] == ["vocab"] * 6 + ["score"] * 14
    assert [spec.grid[0] for spec in plan[6:]] == [64] * 7 + [36] * 7
    assert all(spec.constexprs.get("RANKS", 2) == 2 for spec in plan)
    build, graph = _scored_variant(64)
    assert len(variant_plan(build, graph)) == 13
    graph.variant.layout["prompt_logprobs"] = None  # an unscored variant: generation only
    assert len(variant_plan(build, graph)) == 6


def test_kernel_sharded_checks_the_scoring_launches():
    from ignition.exporter.kernels import launch_key
    from ignition.exporter.prepare import variant_plan
    from ignition.validate.kernels import check_sharded_launches

    build, graph = _scored_variant(100)
    plan = variant_plan(build, graph)
    keys = [launch_key(spec) for spec in plan]
    manifest = {"tensor_parallel": {"ranks": 2, "vocab_shard": 912}}
    table = _table(plan)
    assert check_sharded_launches(manifest, [_catalog_entry(graph.variant, keys)], table) == []
    missing = check_sharded_launches(manifest, [_catalog_entry(graph.variant, keys[:13])], table)
    assert [v.rule for v in missing] == ["KERNEL-SHARDED"] and "score.merge" in missing[0].message
    wrong = _table(plan)
    wrong["kernels"][12]["constexprs"]["RANKS"] = 4  # score.merge of the 64-row block
    wrong["kernels"][15]["grid"][0] = 64  # score.tile_stats of the 36-row block
    messages = [v.message for v in check_sharded_launches(manifest, [_catalog_entry(graph.variant, keys)], wrong)]
    assert any("RANKS=4" in m for m in messages) and any("36 scored rows" in m for m in messages), messages
    single = check_sharded_launches({}, [_catalog_entry(graph.variant, keys[6:13])], table)
    assert [v.rule for v in single] == ["KERNEL-SHARDED"]


def test_prepared_scoring_launcher_drives_the_kernels_exactly(tmp_path):
    """Two ranks' PreparedVocabulary.scoring against the emulated CUDA driver (tests/_launcher_emulation.py,
    --scoring): the seven cubins of a 5-row block compiled for cuda:90 from the export's own plan, parameters,
    grid and threads from the table, exchange and prompt-row words equal to the reference stages'."""
    from ignition.exporter.kernels import launch_key, prepare_kernels
    from ignition.exporter.prepare import variant_plan

    build, graph = _scored_variant(5)
    plan = variant_plan(build, graph)
    table = prepare_kernels(plan[6:], ["cuda:90"], tmp_path)  # generation launches are not loaded here
    (tmp_path / "kernels.json").write_text(json.dumps(table))
    features = {"allow_logprobs": True, "explicit_ids": False, "prompt_logprobs": True}
    section = {"ranks": 2, "vocab_shard": 912, "group": "0", "rank_files": []}
    (tmp_path / "manifest.json").write_text(json.dumps({  # what the launcher reads (the typed Manifest's fields)
        "recipe": "toy", "vocab_size": 1823, "vocab_padded": 1824, "k": 20, "weights": "weights.safetensors",
        "features": features, "model": {"dtype": "float32"}, "tensor_parallel": section, "catalog": "catalog.json",
        "files": {}, "state": []}))
    entry = _catalog_entry(graph.variant, [launch_key(spec) for spec in plan])
    (tmp_path / "catalog.json").write_text(json.dumps({"variants": [entry]}))
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_launcher_emulation.py")), "--scoring",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"scoring-rows5", "launches"}
    assert {case: problems for case, problems in results.items() if problems} == {}


def test_cuda_scoring_ops_refuse_bad_layouts_and_missing_launchers(monkeypatch):
    from ignition.components import device_reduction as D
    from ignition.components.vocabulary_logprobs import SCORING_STAGE_OPS

    import ignition  # noqa: F401

    for op in ("score_shard_statistics", "score_shard_candidates", "merge_prompt_scores"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ignition::{op}", "CUDA"), op
    assert set(SCORING_STAGE_OPS) == {"statistics", "candidates", "merge"}
    with pytest.raises(ValueError, match=r"statistics must be \[ranks \* 3, 64\].*statistics must be int32.*"
                                         r"targets must be int32 \[3\]"):
        D.check_stage_args("score_shard_candidates", 3, 64, statistics=torch.zeros(5, 64),
                           targets=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"out must be int32 \[\.\.\., 43\].*out_rows must be int64"):
        D.check_stage_args("merge_prompt_scores", 3, 64, out=torch.zeros(2, 3, 42, dtype=torch.int32),
                           out_rows=torch.arange(3, dtype=torch.int32))
    _refuses_missing_launchers(monkeypatch, D._scoring_launcher, "score_shard_statistics", "merge_prompt_scores")


@pytest.mark.cuda
def test_sharded_scoring_ops_on_the_gpu_match_the_cpu_reference(monkeypatch):
    """On a GPU (Triton JIT): the three scoring ops through torch's CUDA dispatch at TP=2, gathers by
    concatenation, against the torch stages on the CPU: exchange 2 and the prompt rows word for word
    given the CPU's exchanges (libdevice expf/logf are torch CUDA's, not the CPU's: lse within an ulp),
    so ids and ranks are compared exactly and values within 2 ulp of lse."""
    from ignition.components import vocabulary_logprobs as V

    monkeypatch.setenv("IGNITION_TRITON_JIT", "1")
    ops, vocab, width, rows = torch.ops.ignition, 1823, 912, 9
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, 2 * width, generator=g) * 3
    logits[:, vocab:] = 1e4
    logits[1, :vocab:5] = 2.0
    targets = torch.tensor([1822, 0, 911, 912, -1, vocab, 5, 1500, 700], dtype=torch.int32)
    parts = [logits[:, r * width:(r + 1) * width].contiguous() for r in range(2)]
    out = {d: torch.full((2, rows, 43), 0x5A5A5A5A, dtype=torch.int32, device=d) for d in ("cpu", "cuda")}
    gathered = {}
    for device in ("cpu", "cuda"):
        x = [p.to(device) for p in parts]
        t = targets.to(device)
        stats = torch.cat([ops.score_shard_statistics(p, t, r * width, vocab) for r, p in enumerate(x)])
        cands = torch.cat([ops.score_shard_candidates(p, stats, t, r * width, vocab) for r, p in enumerate(x)])
        ops.merge_prompt_scores(stats, cands, t, out[device], torch.arange(rows, device=device) + rows, vocab, width)
        gathered[device] = stats.cpu()
    assert torch.equal(gathered["cuda"][:, [0, 2]], gathered["cpu"][:, [0, 2]])  # word 1: the mass (tile sums)
    got, want = out["cuda"].cpu(), out["cpu"]
    ids = [0, 2] + list(range(3, 43, 2))
    assert torch.equal(got[:, :, ids], want[:, :, ids]) and (got[0] == 0x5A5A5A5A).all()
    floats = gathered["cpu"].view(2, rows, 64).view(torch.float32)
    lse = V.global_normalization(floats[:, :, 0], floats[:, :, 1])
    values = [1] + list(range(4, 43, 2))
    a, b = got[1][:, values].contiguous().view(torch.float32), want[1][:, values].contiguous().view(torch.float32)
    bound = 2.0**-22 * (lse.abs()[:, None] + b.abs())  # 2 ulp of lse and of the value
    assert ((a - b).abs() <= bound).logical_or(a.view(torch.int32) == b.view(torch.int32)).all()


def test_capture_check_compares_each_scored_block_with_its_prepared_launches():
    """check_captured_launches on a scored sharded variant: one score_shard_statistics node per row block,
    each with the block's [rows, vocab_shard] logits of the model dtype (a fake program: no export)."""
    from types import SimpleNamespace

    from ignition.exporter.prepare import check_captured_launches

    build, graph = _scored_variant(100)
    graph.variant.launches = ["prepared"]
    build.vocab_padded = 1824

    def node(op, rows, width=912, dtype=torch.float32):
        value = SimpleNamespace(meta={"val": torch.empty(rows, width, dtype=dtype, device="meta")})
        return SimpleNamespace(op="call_function", target=getattr(torch.ops.ignition, op).default, args=[value])

    program = SimpleNamespace(graph=SimpleNamespace(nodes=[node("vocab_shard_statistics", 1)]))
    scored = [node("score_shard_statistics", 64), node("score_shard_statistics", 36)]
    program.graph.nodes += scored
    assert check_captured_launches(build, graph, program) is None
    scored[1] = node("score_shard_statistics", 36, dtype=torch.bfloat16)
    program.graph.nodes[-1] = scored[1]
    assert "row blocks [(64, 912, torch.float32), (36, 912, torch.float32)]" in check_captured_launches(
        build, graph, program)
    program.graph.nodes.pop()
    assert "the graph scores [(64, 912, torch.float32)]" in check_captured_launches(build, graph, program)
