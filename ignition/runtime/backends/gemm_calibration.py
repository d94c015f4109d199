"""Which product a CPU linear runs on, measured on this machine at load: oneDNN on a packed weight, the blocked product
(``blocked_linear``), or ``aten.linear``.

NOTE: neither path wins on every x86 CPU. On the AMD EPYC hosts this project was built on, oneDNN's packed product
read the Qwen3-0.6B weights 1.3-6x faster than MKL's FP32 ``aten.linear`` at 1 to 32 rows; on an Intel Xeon with
AVX-512 and AMX, MKL streamed them at 22.6 GB/s at one row against the packed product's 17.6. So the choice is made per
weight shape by timing both (``GemmPlan``), at the row counts the core's decode graphs run (its decode capacities;
``CALIBRATION_ROWS`` without them), and the result is kept
in a small JSON cache keyed by the CPU (its model and instruction set), the torch version and the shape
(``cache_path``): a machine pays a few hundred milliseconds once per shape, and each later load reads the cache
(timings taken while the host is oversubscribed are used for that load and not cached: ``quiet``). A BF16
weight's packed product takes the CPU's best BF16 kernels (AMX where present); it is a candidate only where it
returns ``aten.linear``'s bits (``packed_linear.keeps_bits``). The blocked BF16 product sums in FP32 in its own
order and rounds once, so where the calibration picks it a BF16 core's roundings are its own, tested no further
from the exact product than ``aten.linear``'s (BF16 promises no bits against transformers across CPUs). One choice
per weight shape, not per row count: a weight used both ways would be held twice (its raw and its packed copy), so
the shape takes the path whose times, each relative to the faster path at that row count, sum lowest.

The packed path is several paths: oneDNN reorders a weight for a row count (``_reorder_linear_weight``'s batch-size
hint), and which layout streams fastest at decode's rows is the machine's too. On one AMD EPYC host a weight
reordered for eight rows took 1.21-1.34x the time of the one-row layout at one row, and the one-row layout took
1.20-1.34x the eight-row one's at eight rows (``benchmarks.row_layouts``); so each layout of ``PACK_LAYOUTS`` is a
path of its own (``packed@1``, ``packed@8``), timed beside ``aten.linear``, and the weight is packed once, in the
chosen layout. The row counts weigh alike, so
the choice follows what the core serves: a core that decodes one lane at a time packs for one row (on that host
the 28-layer Qwen3-0.6B shape then decoded 8.3 tokens/s against 7.0), while a core with capacities 1, 8 and 32 keeps
the eight-row layout, which reads the LM head 1.5x faster at eight rows. FP32 and BF16 weights have one more path,
the blocked product (``BLOCKED``), one layout for every row count, compiled for the CPU at load where a C compiler is
(``blocked_linear.unavailable`` says why not); on that host it ran the same core's decode rounds 0.91x, 0.84x and
0.99x as long as the eight-row layout at batches 1, 8 and 32 (``benchmarks.core_ab --old-gemm packed --new-gemm
blocked``), and the calibration picks it for every Qwen3-0.6B shape at capacities 1, 8 and 32.

A BF16 or FP16 core's attention products (``bmm``) are timed the same way, in their dtype against FP32 copies
rounded once (``batched_products``; ``GemmPlan.batched_path``, the key window at ``WINDOW_PROBE`` positions).

``LoadOptions.gemm`` chooses the mode once, at load: ``calibrate`` (the default), or ``packed`` / ``blocked`` /
``aten`` to force one path wherever the dtype allows it; ``LinearPacks`` asks ``GemmPlan.path`` once per weight as
it rewrites the graphs, and nothing re-decides while a core runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from ignition.catalog.enums import Operation
from ignition.runtime.backends import blocked_linear
from ignition.runtime.backends.batched_products import BATCHED_DTYPES, WIDENED, widened_bmm
from ignition.runtime.backends.host_cache import cache_dir, cpu_key, cpu_model

CALIBRATE, PACKED, BLOCKED, ATEN = "calibrate", "packed", "blocked", "aten"
GEMM_MODES = (CALIBRATE, PACKED, BLOCKED, ATEN)
CALIBRATION_ROWS = (1, 8)
"""Decode at one lane and at eight: the row counts timed where a load names none (``GemmPlan(rows=...)``: a core's
decode capacities)."""
PACK_LAYOUTS = CALIBRATION_ROWS
"""The row counts a packed weight's layout may be reordered for: each is a path of its own (``packed_path``)."""
FORCED_LAYOUT = max(PACK_LAYOUTS)
"""The layout ``gemm="packed"`` (nothing timed) reorders for, where the dtype allows it."""
CALIBRATION_BYTES = 64 << 20
"""A larger weight is timed on its first rows up to this size, and a smaller one on as many copies as fit in it
(``CALIBRATION_COPIES`` at most), one call on each, back to back, a round: past every L2 and most L3 caches, so the
products stream their weights from memory one after another as a decode step's layers do, while a shape takes tens
of milliseconds, not seconds, to time.
NOTE: timed on one copy, a 4-12 MiB projection of the Qwen3-0.6B shape was read from a 32 MiB L3 after the first
call, and the calibration picked products by their speed from cache, not from memory."""
CALIBRATION_COPIES = 16
CALIBRATION_REPEATS = 7
"""Rounds of one call per path, the paths interleaved; each path's best round counts: on a shared host a call can
wait a whole time slice at a thread barrier (tens of milliseconds), which the best of several rounds leaves out."""
CACHE_VERSION = 4
"""4: a small weight is timed on copies past the caches, back to back (``CALIBRATION_COPIES``); 3: the blocked
product is a path
(``BLOCKED``), and an entry is reused only where it timed the paths this load offers; 2: the packed paths name their
layout (``packed@R``) and a key its row counts."""
WINDOW_PROBE = 256
"""The extent a batched product's dynamic dimension (the key window) is timed at."""
_lock = threading.Lock()


def cache_path() -> Path:
    """The calibration's file in the machine's cache directory (``host_cache.cache_dir``)."""
    return cache_dir() / "gemm-calibration.json"


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
"""The variables that cap the instruction set ATen, oneDNN and MKL dispatch to (``ONEDNN_MAX_CPU_ISA=AVX2`` and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` run the AVX2 family's kernels on an AVX-512 CPU): a calibration under a cap is
another machine's."""


def machine_key() -> str:
    """What a calibration is valid for: this CPU (``host_cache.cpu_key``) under this torch (its oneDNN and MKL),
    thread count, instruction-set caps (``ISA_LIMITS`` that are set) and build of the blocked product
    (``blocked_linear.build_id``: another source or compiler times otherwise)."""
    caps = "".join(f" | {name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name))
    return f"{cpu_key()} | torch {torch.__version__} | {torch.get_num_threads()} threads{caps} | blocked " \
           f"{blocked_linear.build_id()}"


def shape_key(shape, dtype: torch.dtype, rows=CALIBRATION_ROWS) -> str:
    """A calibration's cache key: the weight's dtype and shape, and the row counts it was timed at."""
    return f"{str(dtype).removeprefix('torch.')} {shape[0]}x{shape[1]} at rows {','.join(map(str, rows))}"


def quiet() -> bool:
    """Whether the host was not oversubscribed over the last minute (load average at most its CPUs): only then is
    a calibration cached. NOTE: on a host running more threads than cores, a multi-threaded product waits a time
    slice at its barrier (measured here at a load average of 11 on 2 cores: 40-55 ms for a 4 MiB product that takes
    0.1 ms), so such timings say more about the neighbours than about the kernels."""
    try:
        return os.getloadavg()[0] <= len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # no load average (not Linux): trust the best-of rounds
        return True


def _best_seconds(products: dict, repeats: int = CALIBRATION_REPEATS) -> dict[str, float]:
    """Each product's best time over ``repeats`` interleaved rounds, after one untimed call each."""
    for product in products.values():
        product()  # first touch: page faults, oneDNN's primitive cache
    best = {name: float("inf") for name in products}
    for _ in range(repeats):
        for name, product in products.items():
            started = time.perf_counter()
            product()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def packed_path(layout: int) -> str:
    """The path of oneDNN's product on a weight reordered for ``layout`` rows."""
    return f"{PACKED}@{layout}"


def path_layout(path: str) -> int | None:
    """The row count a path's weight is reordered for by oneDNN: None for ``aten.linear`` and the blocked product
    (no oneDNN reorder); ``packed`` alone is ``FORCED_LAYOUT``'s."""
    if path in (ATEN, BLOCKED):
        return None
    if path == PACKED:
        return FORCED_LAYOUT
    family, _, rows = path.partition("@")
    if family != PACKED or not rows.isdigit() or int(rows) < 1:
        raise ValueError(f"unknown GEMM path {path!r}; expected {ATEN}, {BLOCKED}, {PACKED} or {PACKED}@<rows>")
    return int(rows)


def pack(path: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the form ``path``'s product reads: oneDNN's reorder for ``packed@R``, the blocks for
    ``blocked`` (``aten`` reads the weight as it is)."""
    return blocked_linear.pack(weight) if path == BLOCKED else \
        torch.ops.mkldnn._reorder_linear_weight(weight, path_layout(path))


def decode_rows(variants: list[dict]) -> tuple[int, ...]:
    """The row counts a core's decode graphs run (the capacities of its catalog's decode ``variants``), which a
    calibration weighs alike; ``CALIBRATION_ROWS`` for a core without decode graphs."""
    rows = sorted({entry["capacity"] for entry in variants if entry["operation"] == Operation.DECODE})
    return tuple(rows) or CALIBRATION_ROWS


def time_paths(shape, dtype: torch.dtype, paths, rows=CALIBRATION_ROWS) -> dict[str, dict[str, float]]:
    """Best seconds of ``x [rows, in] @ w.T`` for each of ``paths`` (``aten``, ``packed@R``, ``blocked``) and each row
    count, on random weights of ``shape`` (``[out, in]``; its first rows only, past ``CALIBRATION_BYTES``; copies of
    a smaller one up to that size, called in turn): ``{str(rows): {path: seconds}}``."""
    out_features, in_features = shape
    element = torch.empty((), dtype=dtype).element_size()
    kept = max(1, min(out_features, CALIBRATION_BYTES // (element * in_features)))
    copies = max(1, min(CALIBRATION_COPIES, CALIBRATION_BYTES // (element * in_features * kept)))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.empty(kept, in_features, dtype=torch.float32).uniform_(-0.05, 0.05, generator=generator).to(dtype)
               for _ in range(copies)]
    packs = {path: [pack(path, weight) for weight in weights] for path in paths if path != ATEN}
    timings = {}
    for count in rows:
        x = torch.randn(count, in_features, generator=generator).to(dtype)

        def product(path, x=x):
            """One call on each copy, back to back (as a decode step's layers stream their weights)."""
            if path == ATEN:
                return lambda: [torch.nn.functional.linear(x, weight) for weight in weights]
            if path == BLOCKED:
                return lambda: [blocked_linear.graph_linear(x, packed, None, kept) for packed in packs[path]]
            return lambda: [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                            for packed in packs[path]]
        best = _best_seconds({path: product(path) for path in paths})
        timings[str(count)] = {path: seconds / copies for path, seconds in best.items()}
    return timings


def batched_shapes(first, second) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``bmm``'s operand shapes as timed: each extent an int as it is, a symbolic one (the key window) at
    ``WINDOW_PROBE``."""
    def extent(value) -> int:
        return value if isinstance(value, int) else WINDOW_PROBE
    return tuple(map(extent, first)), tuple(map(extent, second))


def time_batched(first, second, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Best seconds of ``bmm(a [B, M, K], b [B, K, N])`` in ``dtype`` (``aten``) and on FP32 copies rounded back
    (``fp32``), on random operands of those shapes: ``{"batched": {path: seconds}}`` (``choose``'s form)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator).to(dtype) for shape in (first, second))
    return {"batched": _best_seconds({ATEN: lambda: torch.bmm(a, b), WIDENED: lambda: widened_bmm(a, b)})}


def choose(timings: dict[str, dict[str, float]]) -> str:
    """The path whose times, each over the faster one's at its row count, sum lowest (ties: ``aten``)."""
    paths = sorted(next(iter(timings.values())))
    cost = {path: sum(per[path] / max(min(per.values()), 1e-12) for per in timings.values()) for path in paths}
    return min(paths, key=lambda path: (cost[path], path != ATEN))


class GemmPlan:
    """The path of each weight shape's linear on this machine, decided once per shape at load (``path``).

    ``mode``: ``calibrate`` (time, or read the cache), ``packed``, ``blocked`` or ``aten`` (forced where the dtype
    allows it, else ``aten.linear``). ``allowed(dtype)``: whether a weight of that dtype may leave ``aten.linear`` at
    all here (``LinearPacks`` also passes the oneDNN layouts whose product it may use and whether the blocked product
    may run the dtype; default: every dtype).
    ``rows``: the row counts the paths are timed at, each weighing alike (the core's decode capacities)."""

    def __init__(self, mode: str = CALIBRATE, allowed=None, cache: Path | None = None, rows=CALIBRATION_ROWS):
        if mode not in GEMM_MODES:
            raise ValueError(f"unknown GEMM mode {mode!r}; expected one of {', '.join(GEMM_MODES)}")
        rows = tuple(sorted(set(rows)))
        if not rows or any(isinstance(count, bool) or not isinstance(count, int) or count < 1 for count in rows):
            raise ValueError(f"GEMM calibration rows must be positive integers, got {rows!r}")
        self.mode = mode
        self.rows = rows
        self.allowed = allowed or (lambda dtype: True)
        self.cache = cache_path() if cache is None else cache
        self.choices: dict[tuple[str, tuple[str, ...]], str] = {}  # (shape key, paths) -> path, this load
        self.measured: list[str] = []  # the shape keys this load timed (not found in the cache)

    def path(self, shape, dtype: torch.dtype, layouts=PACK_LAYOUTS, blocked: bool = False) -> str:
        """The path of a linear on a weight of ``shape`` and ``dtype`` on this machine: ``aten``, ``packed@R`` with R
        one of ``layouts`` (the oneDNN layouts whose product may run it), or ``blocked`` where ``blocked`` (the
        blocked product may run it)."""
        layouts = tuple(layouts)
        if self.mode == ATEN or not (layouts or blocked) or not self.allowed(dtype):
            return ATEN
        if self.mode == PACKED:
            return packed_path(FORCED_LAYOUT if FORCED_LAYOUT in layouts else max(layouts)) if layouts else ATEN
        if self.mode == BLOCKED:
            return BLOCKED if blocked else ATEN
        key = shape_key(shape, dtype, self.rows)
        paths = (*(packed_path(rows) for rows in layouts), *((BLOCKED,) if blocked else ()), ATEN)
        if (key, paths) not in self.choices:
            self.choices[key, paths] = self._calibrated(key, paths, lambda: time_paths(tuple(shape), dtype, paths,
                                                                                       self.rows))
        return self.choices[key, paths]

    def layout(self, shape, dtype: torch.dtype, layouts=PACK_LAYOUTS) -> int | None:
        """The row count a weight of ``shape`` and ``dtype`` is packed for by oneDNN on this machine, one of
        ``layouts``; None: it stays on ``aten.linear``."""
        return path_layout(self.path(shape, dtype, layouts))

    def packs(self, shape, dtype: torch.dtype, layouts=PACK_LAYOUTS) -> bool:
        """Whether a linear on a weight of ``shape`` and ``dtype`` runs packed by oneDNN on this machine."""
        return self.layout(shape, dtype, layouts) is not None

    def batched_path(self, first, second, dtype: torch.dtype) -> str:
        """The path of ``bmm`` on ``dtype`` operands of shapes ``first`` and ``second`` (extents, a symbolic one
        as a string) on this machine: ``fp32`` where the calibration timed it faster, ``aten`` otherwise and in
        every forced mode (``gemm`` ``packed``, ``blocked`` or ``aten`` names a linear's path, and leaves the batched
        products as the graph has them)."""
        if self.mode != CALIBRATE or dtype not in BATCHED_DTYPES:
            return ATEN
        first, second = batched_shapes(first, second)
        key = f"bmm {str(dtype).removeprefix('torch.')} {'x'.join(map(str, first))} @ {'x'.join(map(str, second))}"
        paths = (WIDENED, ATEN)
        if (key, paths) not in self.choices:
            self.choices[key, paths] = self._calibrated(key, paths, lambda: time_batched(first, second, dtype))
        return self.choices[key, paths]

    def _calibrated(self, key: str, paths: tuple[str, ...], timer) -> str:
        """The cached choice among ``paths`` for ``key`` on this machine, else ``choose(timer())``, cached."""
        with _lock:  # one load times at a time: two would share the memory bandwidth they measure
            machine = machine_key()
            entry = self._read().get(machine, {}).get(key, {})
            timed = entry.get("seconds")
            if isinstance(timed, dict) and timed and all(isinstance(per, dict) and set(per) == set(paths)
                                                         for per in timed.values()) and entry.get("choice") in paths:
                return entry["choice"]
            timings = timer()
            choice = choose(timings)
            self.measured.append(key)
            if quiet():  # a busy host's timings serve this load only: the next one times again
                data = self._read()
                data.setdefault(machine, {})[key] = {"choice": choice, "seconds": timings}
                self._write(data)
            return choice

    def _read(self) -> dict:
        try:
            data = json.loads(self.cache.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        return {k: v for k, v in data.get("machines", {}).items() if isinstance(v, dict)}

    def _write(self, machines: dict) -> None:
        """Atomically; a cache that cannot be written (a read-only home) only means timing again next load."""
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.cache.with_name(f"{self.cache.name}.{os.getpid()}.tmp")
            scratch.write_text(json.dumps({"version": CACHE_VERSION, "machines": machines}, indent=1,
                                          sort_keys=True) + "\n")
            os.replace(scratch, self.cache)
        except OSError:
            pass


__all__ = ["ATEN", "BLOCKED", "CALIBRATE", "CALIBRATION_ROWS", "FORCED_LAYOUT", "GEMM_MODES", "GemmPlan", "ISA_LIMITS",
           "PACKED", "PACK_LAYOUTS", "WINDOW_PROBE", "batched_shapes", "cache_path", "choose", "cpu_model",
           "decode_rows", "machine_key", "pack", "packed_path", "path_layout", "time_batched", "time_paths"]
