"""Start-up time of a core: `ignition run CORE "Hello" --max-tokens 1` end to end, and `load_core` alone.

Every measurement runs in a fresh process (start-up is what a user waits for), with
``OMP_NUM_THREADS`` = ``--threads``; the best of ``--repeat`` runs is reported (the machine is
shared; the best is the least disturbed), wall seconds and the process's CPU seconds. Without
``--core`` the example is exported first as ``make demo`` does it (tiny Qwen3, default catalog,
``--prompt-logprobs``). ``--checkout DIR`` times another checkout of Ignition (put on
``PYTHONPATH``) on the same core, e.g. the commit before a change.

    python -m benchmarks.startup [--core DIR] [--checkout DIR] [--repeat 3] [--threads 2] [--load-only]
                                 [--compare checkouts|huge-pages]

``--load-only`` times ``load_core`` alone, the checkouts alternated round by round (so each sees the same machine),
and prints every run's seconds, their median, the child's page faults (GiB of fresh 4 KiB pages it touched; a huge
page counts as one) and its kernel CPU seconds. ``--load-only --compare huge-pages`` alternates this checkout with
and without transparent huge pages for torch's allocator (``ignition.HUGE_PAGES_VARIABLE``, which torch reads at a
process's first CPU allocation).

Last, an A/B in one process: CPU seconds of ``torch.export.load`` of every graph without and with
the schema-hint cache (the main start-up saving; see ``ignition/validate/graphs.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD_ONLY = """
import json, sys, time
started = time.perf_counter()
from ignition.runtime.core import load_core
imported = time.perf_counter()
core = load_core(sys.argv[1])
print(json.dumps({"import_s": imported - started, "load_s": time.perf_counter() - imported,
                  "stages": getattr(core, "timings", None)}))
"""


def timed(command: list[str], env: dict, cwd: Path) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of one process run in ``cwd`` (first on its sys.path)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def measure(core: Path, checkout: Path, repeat: int, threads: int) -> dict:
    env = os.environ | {"PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    run = [sys.executable, "-m", "ignition.cli", "run", str(core), "Hello", "--max-tokens", "1"]
    load = [sys.executable, "-c", LOAD_ONLY, str(core)]
    runs = [timed(run, env, checkout)[:2] for _ in range(repeat)]
    loads = []
    for _ in range(repeat):
        wall, cpu, out = timed(load, env, checkout)
        loads.append((json.loads(out)["load_s"], cpu, json.loads(out)))
    best_load = min(loads, key=lambda x: x[0])
    return {"run_wall": min(r[0] for r in runs), "run_cpu": min(r[1] for r in runs),
            "load_s": best_load[0], "load_process_cpu": min(x[1] for x in loads),
            "stages": best_load[2]["stages"]}


def alternated_loads(core: Path, sides: list[tuple[str, Path, dict]], repeat: int, threads: int) -> None:
    """``load_core`` in a fresh process per run, the sides (label, checkout, extra environment) alternated each round:
    each run's seconds, the median per side, the loading process's minor page faults (a fault on a huge page counts
    once) and its kernel CPU seconds (mostly those faults), and the median run's stages."""
    results: dict[str, list[tuple[float, dict, float, float]]] = {label: [] for label, _, _ in sides}
    load = [sys.executable, "-c", LOAD_ONLY, str(core)]
    for _ in range(repeat):
        for label, checkout, extra in sides:
            env = os.environ | {"PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)} | extra
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            _, _, out = timed(load, env, checkout)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            faults = (after.ru_minflt - before.ru_minflt) * resource.getpagesize()
            found = json.loads(out)
            results[label].append((found["load_s"], found["stages"] or {}, faults / 2**30,
                                   after.ru_stime - before.ru_stime))
    print("| side | `load_core` s, each run | median s | page faults, GiB of 4 KiB pages | kernel CPU s, each run "
          "| stages of the median run (s) |")
    print("|---|---|---|---|---|---|")
    for label, runs in results.items():
        ordered = sorted(runs, key=lambda run: run[0])
        seconds, stages, faults, _ = ordered[len(ordered) // 2]
        stages = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        print(f"| {label} | {', '.join(f'{run[0]:.2f}' for run in runs)} | {seconds:.2f} | {faults:.2f} | "
              f"{', '.join(f'{run[3]:.1f}' for run in runs)} | {stages} |", flush=True)


def deserialization(core: Path, repeat: int) -> tuple[float, float]:
    """CPU seconds of ``torch.export.load`` of every graph of ``core`` in this process, without and with
    the schema-hint cache of ``ignition/validate/graphs.py`` (best of ``repeat`` alternated runs, after one warm-up load):
    an A/B under the same machine load, which the process timings above cannot give on a shared machine."""
    import io
    import typing

    import torch
    from torch._export.serde import serialize

    import ignition  # noqa: F401  (registers the ops the graphs call)
    from ignition.validate.graphs import _cache_schema_hints

    catalog = json.loads((core / "catalog.json").read_bytes())
    data = [(core / v["graph"]).read_bytes() for v in catalog["variants"]]
    torch.export.load(io.BytesIO(data[0]))

    def cpu_seconds() -> float:
        started = time.process_time()
        for blob in data:
            torch.export.load(io.BytesIO(blob))
        return time.process_time() - started

    _cache_schema_hints()
    cached_typing = serialize.typing
    assert cached_typing is not typing, "this torch looks schema hints up differently; nothing to compare"
    plain, cached = [], []
    for _ in range(repeat):  # alternated, so both see the same machine load
        serialize.typing = typing
        plain.append(cpu_seconds())
        serialize.typing = cached_typing
        cached.append(cpu_seconds())
    return min(plain), min(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path, help="core to time (default: export the example)")
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout to time on the same core (repeatable); this one always")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--load-only", action="store_true",
                        help="time load_core alone, the checkouts alternated; no `run`, no deserialization A/B")
    parser.add_argument("--compare", choices=("checkouts", "huge-pages"), default="checkouts",
                        help="with --load-only: huge-pages alternates this checkout with torch's allocator on "
                             "transparent huge pages (ignition.HUGE_PAGES_VARIABLE) and not")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        core = args.core
        if core is None:
            sys.path.insert(0, str(ROOT))
            from benchmarks._common import example_checkpoint, export
            core = export(example_checkpoint(Path(tmp)), Path(tmp) / "core", prompt_logprobs=True)
        if args.load_only:
            print(f"core {core}, OMP_NUM_THREADS={args.threads}, {args.repeat} alternated rounds")
            if args.compare == "huge-pages":
                from ignition import HUGE_PAGES_VARIABLE  # here: importing Ignition sets it for other checkouts' runs

                sides = [("huge pages", ROOT, {HUGE_PAGES_VARIABLE: "1"}),
                         ("4 KiB pages", ROOT, {HUGE_PAGES_VARIABLE: "0"})]
            else:
                sides = [(str(checkout), checkout.resolve(), {}) for checkout in [*args.checkout, ROOT]]
            alternated_loads(core, sides, args.repeat, args.threads)
            return
        print(f"core {core}, OMP_NUM_THREADS={args.threads}, best of {args.repeat}")
        print("| checkout | `run` wall s | `run` CPU s | `load_core` s | load process CPU s | load stages (s) |")
        print("|---|---|---|---|---|---|")
        for checkout in [*args.checkout, ROOT]:
            m = measure(core, checkout.resolve(), args.repeat, args.threads)
            stages = ", ".join(f"{k} {v:.2f}" for k, v in m["stages"].items()) if m["stages"] else "-"
            print(f"| {checkout} | {m['run_wall']:.2f} | {m['run_cpu']:.2f} | {m['load_s']:.2f} | "
                  f"{m['load_process_cpu']:.2f} | {stages} |", flush=True)
        plain, cached = deserialization(core, args.repeat)
        print(f"\ntorch.export.load of all graphs, CPU s in one process: {plain:.2f} without the schema-hint "
              f"cache, {cached:.2f} with it ({plain / cached:.1f}x)")


if __name__ == "__main__":
    main()
