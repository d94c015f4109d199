"""Export wall time of the example model's default catalog, per stage.

Creates the tiny Qwen3 checkpoint of ``examples/make_tiny_qwen3.py`` in a temporary directory and
exports it with the CLI defaults (decode capacities 1,2,4,8, prefill chunk limit 256, max_seq_len
512, T=8, logprobs on). Stages: build (config + weights load), prepare (kernels; none without
--targets), capture per variant, write, validate. Target: under 60 s on a 2-core CPU machine.

    python -m benchmarks.export_time [--repeat 3] [--targets cuda:90] [--compile inductor]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

TARGET_SECONDS = 60.0
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen3.py"


def make_example_checkpoint(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_checkpoint(directory)


def export_once(checkpoint: Path, out: Path, targets: tuple[str, ...], compile: str | None) -> dict[str, float]:
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    options = ExportOptions(recipe="qwen3", checkpoint=checkpoint, targets=targets, compile=compile)
    return export_core(options, out, overwrite=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="exports to time (the first one includes warm-up)")
    parser.add_argument("--targets", default="", help="kernel targets to prepare, e.g. cuda:90")
    parser.add_argument("--compile", default=None, help="also compile every variant: inductor")
    args = parser.parse_args()
    targets = tuple(t for t in args.targets.split(",") if t)
    with tempfile.TemporaryDirectory(prefix="ignition-bench-") as scratch:
        started = time.perf_counter()
        checkpoint = make_example_checkpoint(Path(scratch) / "tiny-qwen3")
        print(f"example checkpoint: {time.perf_counter() - started:.2f} s (not part of the export)")
        for run in range(args.repeat):
            started = time.perf_counter()
            timings = export_once(checkpoint, Path(scratch) / "core", targets, args.compile)
            total = time.perf_counter() - started
            print(f"\nexport {run + 1}/{args.repeat}: {total:.2f} s wall "
                  f"({'within' if total < TARGET_SECONDS else 'OVER'} the {TARGET_SECONDS:.0f} s target)")
            for stage, seconds in timings.items():
                print(f"  {stage:<28} {seconds:8.2f} s")


if __name__ == "__main__":
    main()
