"""Shared set-up of the end-to-end benchmarks: the tiny Qwen3 example exported into a temp dir."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def example_checkpoint(directory: Path) -> Path:
    from make_tiny_qwen3 import make_checkpoint
    return make_checkpoint(directory / "tiny-qwen3")


def export(checkpoint: Path, out: Path, **options) -> Path:
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    export_core(ExportOptions(recipe="qwen3", checkpoint=checkpoint, **options), out, overwrite=True)
    return out


def best_of(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls (the machine is shared; the best is the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
