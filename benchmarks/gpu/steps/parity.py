"""CUDA against CPU on the carried cores (exported elsewhere, older torch here) and a freshly exported one.

For each core: the CPU results (the torch reference reduction); the CUDA-graph load's capture coverage and
results (FP32: ``compare``; BF16: ``compare_low_precision``); replays must add only the launches of variants that
run eagerly. Then two cores are loaded
eagerly on the one GPU at once, and each forward must make exactly the launches its catalog lists, with
results still matching the CPU's: a second core must not take the first one's kernels.
"""

from __future__ import annotations

import time

from benchmarks.gpu.record import step_main


def run(context, record) -> None:
    import torch

    from benchmarks.gpu.cores import read_prepared

    if not record.check("CUDA is available", torch.cuda.is_available()):
        return
    prepared = read_prepared(context.cores) or {}
    record.metric("carried_exported_with", {k: prepared.get(k) for k in ("torch", "triton", "python", "commit")})
    record.metric("loaded_with", {"torch": torch.__version__})
    cores = {"qwen3 (carried)": context.carried("qwen3"), "qwen3 (exported here)": context.fresh("qwen3"),
             "qwen3 bf16 (carried)": context.carried("qwen3-bf16"),
             "qwen3 bf16 (exported here)": context.fresh("qwen3-bf16"), "toy (carried)": context.carried("toy")}
    expected, rows = {}, []
    for label, path in cores.items():
        if record.check(f"{label}: the core is there", (path / "manifest.json").is_file(), str(path)):
            with record.attempt(f"{label}: loads and runs on CPU and CUDA"):
                rows.append(_one_core(record, label, path, expected))
    record.table("loads (s) and generation (ms) per core", ["core", "CPU load", "CUDA load", "launches at load",
                                                            "CUDA generate ms"], rows)
    with record.attempt("two cores loaded eagerly at once run"):
        _two_cores(context, record, expected)


def _one_core(record, label, path, expected) -> list:
    """CPU results, then the CUDA-graph load: capture coverage, parity, launches during replay; a table row."""
    from ignition.runtime.core import load_core

    from benchmarks.gpu.replay import (capture_coverage, compare, compare_low_precision, generate, launch_count,
                                       requests_for, variant_launches)

    started = time.perf_counter()
    cpu = load_core(path, device="cpu")
    requests = requests_for(cpu)
    expected[label] = (requests, generate(cpu, requests)[0])
    cpu_load = time.perf_counter() - started
    del cpu
    started = time.perf_counter()
    loaded = load_core(path, device="cuda")
    cuda_load = time.perf_counter() - started
    record.check(f"{label}: every capturable variant is captured", *capture_coverage(loaded))
    before = launch_count(loaded)
    results, submissions, seconds = generate(loaded, requests)
    if loaded.manifest["model"]["dtype"] == "float32":
        ok, detail, _ = compare(results, expected[label][1])
        record.check(f"{label}: CUDA graphs match CPU (same ids, values within 2e-5)", ok, detail)
    else:
        ok, detail, _ = compare_low_precision(results, expected[label][1])
        record.check(f"{label}: CUDA graphs match CPU (tokens up to near ties, values within two BF16 ulps)",
                     ok, detail)
    eager = set(loaded.variants) - set(loaded.capture.captured if loaded.capture else ())
    want = submissions.launches(variant_launches(path), only=eager)
    got = launch_count(loaded) - before
    record.check(f"{label}: replays add only the eager variants' launches", got == want,
                 f"{got} launches during generation, expected {want}; submissions {dict(submissions.counts)}")
    row = [label, f"{cpu_load:.1f}", f"{cuda_load:.1f}", before, f"{seconds * 1e3:.0f}"]
    record.metric(f"{label}: seconds", {"cpu_load": row[1], "cuda_load": row[2], "generate_ms": row[4]})
    return row


def _two_cores(context, record, expected) -> None:
    """Both carried cores loaded eagerly on the GPU at once, the second loaded last and run first."""
    from ignition.runtime.core import load_core

    from benchmarks.gpu.replay import compare, generate, launch_count, variant_launches

    labels = {"toy (carried)": context.carried("toy"), "qwen3 (carried)": context.carried("qwen3")}
    if not all(label in expected for label in labels):
        return
    loaded = {label: load_core(path, device="cuda", eager=True) for label, path in labels.items()}
    for label in reversed(list(labels)):
        requests, cpu_results = expected[label]
        before = launch_count(loaded[label])
        results, submissions, _ = generate(loaded[label], requests)
        want = submissions.launches(variant_launches(labels[label]))
        got = launch_count(loaded[label]) - before
        record.check(f"{label}, eager beside the other core: each forward makes its catalog's launches",
                     got == want > 0, f"{got} launches, expected {want} for submissions {dict(submissions.counts)}")
        ok, detail, _ = compare(results, cpu_results)
        record.check(f"{label}, eager beside the other core: matches CPU", ok, detail)


if __name__ == "__main__":
    step_main(run)
