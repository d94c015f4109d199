"""benchmarks/checkout_ab.py at a tiny size against HEAD itself: a worktree of HEAD and this checkout each export a
tiny Qwen3 and time it in fresh processes, each under its own ``ignition``; the pairs alternate their order, their
ratios are sane (the same code on both sides), both sides generate the same tokens, and the worktree is gone
afterwards."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_checkout_ab_times_head_against_this_checkout(tmp_path):
    from tests._decoder_cores import TinyCase, save_checkpoint

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no revision to make a worktree of")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 300), tmp_path / "ckpt", reload=False)
    work, report_file = tmp_path / "work", tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkout_ab", "HEAD", str(tmp_path / "ckpt"), "--export-args",
         "--recipe qwen3 --capacities 1 --chunk-limit 8 --max-seq-len 32 --no-packed-prefill", "--batches", "1",
         "--pairs", "2", "--steps", "3", "--threads", "1", "--work", str(work), "--json", str(report_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["batch 1 pair 1 (old first)", "batch 1 pair 2 (new first)",
                                                      "batch 1"]
    report = json.loads(report_file.read_text())
    pairs = report["pairs"]["1"]
    assert len(pairs) == 2 and all(pair["same_tokens"] for pair in pairs)
    assert all(0.2 < pair["ratio"] < 5 and pair["ratio"] == pair["new"] / pair["old"] for pair in pairs)
    assert report["median_ratio"]["1"] == statistics.median(pair["ratio"] for pair in pairs)
    assert lines[-1] == f"batch 1: median new/old {report['median_ratio']['1']:.3f} over 2 pairs"
    assert report["ignition"]["old"] == str(work.resolve() / "old-tree" / "ignition" / "__init__.py")
    assert report["ignition"]["new"] == str(ROOT / "ignition" / "__init__.py")
    assert (work / "old-core" / "manifest.json").is_file() and (work / "new-core" / "manifest.json").is_file()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert str(work / "old-tree") not in worktrees and not (work / "old-tree").exists()
