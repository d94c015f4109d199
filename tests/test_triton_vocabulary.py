"""The six prepared launches of the vocabulary-sharded reduction: kernels and launch plan.

One interpreter subprocess (tests/_triton_vocabulary_check.py) runs the Triton stages against the
torch reference stages at TP=2 and TP=4, gathers emulated by concatenation. The export with
``--tensor-parallel 2 --targets cuda:90``, its kernel table, validate-core and the prepared launcher
(emulated CUDA driver) are tested on the sharded core of tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ignition.catalog.contract import NATURAL_K
from ignition.catalog.parallel import VOCABULARY_LAUNCHES
from ignition.components.vocabulary_logprobs import STAGE_OPS

HELPER = Path(__file__).with_name("_triton_vocabulary_check.py")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(HELPER)], env=env,
                          cwd=HELPER.parent.parent, capture_output=True, text=True, timeout=600)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case"]] = record["failures"]
    if done.returncode != 0 or not results:
        pytest.fail(f"interpreter run failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return results


def _stage_cases() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_triton_vocabulary_check_names", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASE_NAMES)


@pytest.mark.parametrize("case", _stage_cases())
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
    device = torch.device("cuda", 7)
    monkeypatch.delenv(D.JIT_ENV, raising=False)
    with pytest.raises(RuntimeError, match="no prepared kernels are loaded"):
        D._vocabulary_launcher(device, "vocab_shard_statistics")
    D.install_reduction(device, lambda *args: None)  # a single-rank core's launcher
    try:
        with pytest.raises(RuntimeError, match="single-rank"):
            D._vocabulary_launcher(device, "merge_vocabulary_logprobs")
    finally:
        D.install_reduction(device, None)


@pytest.mark.cuda
def test_triton_stages_on_the_gpu_match_the_reference():
    """On a GPU: the same stage checks with the kernels compiled for the device (Triton JIT)."""
    env = dict(os.environ, IGNITION_TRITON_JIT="1")
    done = subprocess.run([sys.executable, str(HELPER), "--device", "cuda"], env=env, cwd=HELPER.parent.parent,
                          capture_output=True, text=True, timeout=600)
    failures = {r["case"]: r["failures"] for r in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert done.returncode == 0 and failures and not any(failures.values()), (failures, done.stderr[-3000:])
