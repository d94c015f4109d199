"""The cores gpu-check loads: which are exported where, from which checkpoint, with which options.

``CARRIED`` cores are exported on the preparing machine (``make gpu-check DRY=1``: torch 2.13, Triton 3.9)
into ``build/gpu-check-cores`` and carried to the GPU (torch 2.11, Triton 3.6): the path across versions.
``FRESH`` cores are exported on the GPU machine itself by the ``export`` step. Every core is small: the
device tool carries at most 64 MiB, wheelhouse and working tree included.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CARRIED_DIR = ROOT / "build" / "gpu-check-cores"
CARRIED_TARGETS = ("cuda:90",)  # the H200 (compute capability 9.0)
QWEN3_VOCABULARY = 151936
VOCABULARY_LOGIT_SCALE = 2.0  # wider random logits: greedy near-ties between implementations stay rare

_TINY_QWEN3 = dict(recipe="qwen3", checkpoint="tiny-qwen3", capacities=(1, 4), chunk_limit=64, max_seq_len=256,
                   prompt_logprobs=True)
_TINY_QWEN3_BF16 = dict(_TINY_QWEN3, dtype="bfloat16")  # the production dtype: float32 logits reduced (N6)
CARRIED: dict[str, dict] = {
    "toy": dict(recipe="toy", capacities=(1, 4)),
    "qwen3": _TINY_QWEN3,
    "qwen3-bf16": _TINY_QWEN3_BF16,
}
FRESH: dict[str, dict] = {
    "qwen3": _TINY_QWEN3,
    "qwen3-bf16": _TINY_QWEN3_BF16,
    "vocabulary": dict(recipe="qwen3", checkpoint="vocabulary", capacities=(1, 4), chunk_limit=64, max_seq_len=256),
}
PREPARED = "prepared.json"  # beside the carried cores: the versions that exported them


def tiny_qwen3_checkpoint(out: Path) -> Path:
    """examples/make_tiny_qwen3.py's checkpoint (vocabulary 320, with a tokenizer)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from make_tiny_qwen3 import make_checkpoint

    return make_checkpoint(out)


def vocabulary_checkpoint(out: Path) -> Path:
    """The tiny Qwen3 shape with Qwen3's vocabulary of 151,936 (no tokenizer), fp32, embedding scaled up."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from make_tiny_qwen3 import build_model

    model = build_model(QWEN3_VOCABULARY, 0, torch.float32, seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(VOCABULARY_LOGIT_SCALE)  # tied: the LM head too
    model.save_pretrained(out)
    return out


CHECKPOINTS = {"tiny-qwen3": tiny_qwen3_checkpoint, "vocabulary": vocabulary_checkpoint}


def export(spec: dict, out: Path, targets: tuple[str, ...], checkpoints: Path) -> Path:
    """Export the core ``spec`` describes into ``out`` (replaced) with kernels for ``targets``."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    options = dict(spec)
    checkpoint = options.pop("checkpoint", None)
    if checkpoint is not None:
        path = checkpoints / checkpoint
        if not (path / "config.json").is_file():
            CHECKPOINTS[checkpoint](path)
        options["checkpoint"] = path
    export_core(ExportOptions(targets=targets, **options), out, overwrite=True)
    return out


def versions() -> dict[str, str]:
    import torch
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit.stdout.strip() if commit.returncode == 0 else ""}


def prepare_carried(out: Path = DEFAULT_CARRIED_DIR, log=print) -> dict:
    """Export every ``CARRIED`` core into ``out`` with kernels for ``CARRIED_TARGETS``; the ``prepared.json``."""
    import tempfile
    import time

    out.mkdir(parents=True, exist_ok=True)
    exported = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-checkpoints-") as checkpoints:
        for name, spec in CARRIED.items():
            started = time.perf_counter()
            export(spec, out / name, CARRIED_TARGETS, Path(checkpoints))
            exported[name] = {"seconds": round(time.perf_counter() - started, 1), "bytes": _size(out / name)}
            log(f"exported carried core {name} in {exported[name]['seconds']} s "
                f"({exported[name]['bytes'] / 2**20:.2f} MiB)")
    prepared = dict(versions(), targets=list(CARRIED_TARGETS), cores=exported)
    (out / PREPARED).write_text(json.dumps(prepared, indent=1) + "\n")
    return prepared


def read_prepared(directory: Path) -> dict | None:
    path = directory / PREPARED
    return json.loads(path.read_text()) if path.is_file() else None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu.cores NAME OUT --targets cuda:90 --checkpoints DIR``: export one FRESH core."""
    import argparse

    parser = argparse.ArgumentParser(description="export one of gpu-check's FRESH cores")
    parser.add_argument("name", choices=sorted(FRESH))
    parser.add_argument("out", type=Path)
    parser.add_argument("--targets", required=True, help="kernel targets, comma-separated (cuda:90)")
    parser.add_argument("--checkpoints", type=Path, required=True, help="where checkpoints are made or found")
    args = parser.parse_args(argv)
    export(FRESH[args.name], args.out, tuple(args.targets.split(",")), args.checkpoints)
    print(f"exported {args.name} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
