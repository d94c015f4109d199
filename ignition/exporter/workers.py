"""Capturing variants in worker processes, one variant at a time each, when the export is large enough to pay.

``torch.export`` is single-threaded Python: at Qwen3-0.6B's shape (28 layers) the five default variants took
42 s of a 65 s export, one after another, on a 2-core machine. Each worker here (a ``spawn``ed process: a forked
one would inherit torch's thread pools) builds the recipe once from the same ``ExportOptions``, captures the
variants it is handed and saves each ``.pt2`` into the staging directory; the parent only names the variants
and collects the timings. The archives are the ones the serial path writes, byte for byte
(tests/test_capture_workers.py compares the core digests). ``capture_jobs`` decides how many workers.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

PARALLEL_CAPTURE_BYTES = 256 << 20
"""Weights from this size up make ``capture_jobs`` start workers by default: below it a variant captures in a
few seconds, and a worker's start (importing torch, building the recipe) costs as much."""


CAPTURE_ORDER = ("PACKED_PREFILL", "MIXED", "SCORED_PREFILL", "SPECULATIVE_VERIFY", "PREFILL", "DECODE")
"""Operations from the longest capture to the shortest (Qwen3-0.6B's shape on 2 cores: packed 30 s, prefill 23 s,
each decode 16 s). The workers take variants in this order, so the longest start first and the short ones fill
in behind them; in catalog order a worker was left with prefill and then packed, 59 s against the other's 38 s."""


def capture_order(graphs) -> list[str]:
    """The variant names in ``CAPTURE_ORDER`` (catalog order within one operation)."""
    rank = {name: index for index, name in enumerate(CAPTURE_ORDER)}
    ordered = sorted(graphs, key=lambda graph: rank.get(graph.variant.operation.name, len(rank)))
    return [graph.variant.name for graph in ordered]


class CaptureWorkerError(RuntimeError):
    """A worker could not capture a variant (the message names it and the cause), or a worker died."""


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def capture_jobs(options, build) -> int:
    """Worker processes for this export: 1 (capture in this process) when the export keeps its programs in
    memory for a later stage (``--onnx``, ``--compile``) or captures rank shards (``--tensor-parallel``), or has
    one variant; else ``options.capture_jobs`` when given, or one per available core when the weights reach
    ``PARALLEL_CAPTURE_BYTES``; never more than the variants."""
    if options.onnx or options.compile or build.parallel is not None or len(build.graphs) < 2:
        return 1
    if options.capture_jobs is not None:
        return max(1, min(options.capture_jobs, len(build.graphs)))
    weight_bytes = sum(t.numel() * t.element_size() for t in build.weights.values())
    if weight_bytes < PARALLEL_CAPTURE_BYTES:
        return 1
    return max(1, min(available_cores(), len(build.graphs)))


def capture_in_workers(options, names: list[str], staging: Path, check_launches: bool, jobs: int,
                       progress, meanwhile=None, captured=None) -> dict[str, float]:
    """Capture and save the variants ``names`` with ``jobs`` workers; returns ``capture:<name>`` seconds.
    ``meanwhile()``, if given, runs here while the workers capture (the export writes the weights then); what it
    raises cancels the captures. ``captured(name)``, if given, runs here as each variant's file is saved, while
    the workers go on with the rest (the export reads each file ahead of its validation then). ``CaptureWorkerError``
    names the first variant that failed (the others are cancelled)."""
    seconds: dict[str, float] = {}
    progress("capture", f"{len(names)} variants in {jobs} worker processes")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(_capture_variant, options, name, str(staging), check_launches): name
                   for name in names}
        try:
            if meanwhile is not None:
                meanwhile()
            for count, future in enumerate(as_completed(futures), 1):
                name = futures[future]
                try:
                    taken, problem = future.result()
                except BrokenProcessPool:
                    raise CaptureWorkerError(f"variant {name}: a capture worker process died (out of memory?); "
                                             "export with --jobs 1 to capture in this process") from None
                if problem is not None:
                    raise CaptureWorkerError(f"variant {name}: {problem}")
                seconds[name] = taken
                progress("capture", f"variant {count} of {len(names)} captured: {name} ({taken:.1f} s)")
                if captured is not None:
                    captured(name)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return {f"capture:{name}": seconds[name] for name in names}


_BUILDS: dict = {}  # in a worker: the recipe built once from the parent's options


def _capture_variant(options, name: str, staging: str, check_launches: bool) -> tuple[float, str | None]:
    """In a worker: capture variant ``name`` and save it under ``staging``; (seconds, None) or (0, the
    problem)."""
    import torch

    from ignition.exporter.saving import save_program
    from ignition.exporter.tracing import capture
    from ignition.recipes.registry import build_recipe

    started = time.perf_counter()
    try:
        torch.set_num_threads(1)  # tracing runs Python, not kernels; the workers share the cores
        build = _BUILDS.get("build")
        if build is None:
            build = _BUILDS["build"] = build_recipe(options)
        graph = next(g for g in build.graphs if g.variant.name == name)
        program = capture(graph, build.weights)
        if check_launches:
            from ignition.exporter.prepare import check_captured_launches
            mismatch = check_captured_launches(build, graph, program)
            if mismatch:
                return 0.0, mismatch
        save_program(program, Path(staging), graph.variant.graph_file)
    except Exception as exc:  # reported by the parent, naming the variant
        return 0.0, f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - started, None
