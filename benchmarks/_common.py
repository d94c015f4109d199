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


def run_json(core: str, arguments: list[str]) -> dict:
    """``ignition run CORE ARGUMENTS --json`` in a fresh process: its JSON object; exits with the output on failure."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "ignition.cli", "run", core, *arguments, "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def logprob_pairs(want: dict, got: dict):
    """(reference, other) logprob values of one ``run --json`` entry, after checking its ids and order agree."""
    assert want["id"] == got["id"], (want["id"], got["id"])
    assert [t["id"] for t in want["top_logprobs"]] == [t["id"] for t in got["top_logprobs"]], (want, got)
    yield want["logprob"], got["logprob"]
    yield from ((a["logprob"], b["logprob"]) for a, b in zip(want["top_logprobs"], got["top_logprobs"]))


def compared_values(want: dict, got: dict) -> dict[str, list[tuple[float, float]]]:
    """Two ``run --json`` results that must agree in tokens, logprob ids and order, prompt ids and ranks:
    their (reference, other) value pairs, ``generated`` and ``prompt`` (empty without prompt logprobs)."""
    assert [t["id"] for t in want["tokens"]] == [t["id"] for t in got["tokens"]], "greedy tokens differ"
    found = {"generated": [v for a, b in zip(want["tokens"], got["tokens"], strict=True) for v in logprob_pairs(a, b)],
             "prompt": []}
    for a, b in zip(want.get("prompt_logprobs") or [], got.get("prompt_logprobs") or [], strict=True):
        assert (a is None) == (b is None) and (a is None or a["rank"] == b["rank"]), (a, b)
        found["prompt"] += [] if a is None else list(logprob_pairs(a, b))
    return found
