"""``python -m benchmarks.gpu_check --dry-run`` (``make gpu-check DRY=1``): the CPU half, on the preparing machine.

1. the plan: its budgets sum to less than the deadline;
2. the wheelhouse: built when missing, then checked (files, size, and an install closure per CPython);
3. coverage: every import the GPU steps and ``pytest -m cuda`` make is on the image or in the wheelhouse;
4. the carried cores: exported again with this machine's torch and Triton, kernels for ``CARRIED_TARGETS``;
5. every step module imports;
6. what the device tool would carry (tracked files, wheelhouse, cores) fits its 64 MiB.

Each part prints one line, ok or the problems; the exit status is 0 only when every part is ok.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu.plan import DEADLINE_S, PLAN, budget_problems, render

ROOT = Path(__file__).resolve().parents[2]
TOOL_CARRY_LIMIT = 64 * 2**20  # the device tool's limit on the tree it sends, carried paths included


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def tracked_bytes() -> int:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return _size(ROOT / "ignition") + _size(ROOT / "tests") + _size(ROOT / "docs")
    return sum((ROOT / name).stat().st_size for name in done.stdout.split("\0") if name and (ROOT / name).is_file())


def dry_run(wheelhouse: Path, cores: Path, export: bool = True, log=print) -> int:
    """The CPU half of gpu-check; 0 when every part is ok."""
    from benchmarks.gpu import imports
    from benchmarks.gpu import wheelhouse as wheels

    failed = []

    def part(name: str, problems: list[str]) -> None:
        log(f"[{'ok' if not problems else 'FAIL'}] {name}")
        for problem in problems:
            log(f"    {problem}")
        if problems:
            failed.append(name)

    log(render(PLAN, DEADLINE_S))
    part(f"the budgets sum to {sum(s.budget_s for s in PLAN)} s, under the {DEADLINE_S} s deadline",
         budget_problems(PLAN, DEADLINE_S))
    try:
        if not (wheelhouse / wheels.MANIFEST).is_file():
            log(f"{wheelhouse} has no manifest: building it (pip download)")
            wheels.build(wheelhouse, log=log)
        manifest = wheels.read_manifest(wheelhouse)
        part(f"wheelhouse {wheelhouse}: {len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 2**20:.2f} MiB, "
             f"installs on CPython {', '.join(wheels.PYTHONS)}", wheels.check(wheelhouse))
        part("every import of the GPU steps and the cuda tests is on the image or in the wheelhouse",
             imports.coverage_problems(manifest))
    except wheels.WheelhouseError as exc:
        part("the wheelhouse", [str(exc)])
    if export:
        from benchmarks.gpu.cores import prepare_carried

        started = time.perf_counter()
        try:
            prepared = prepare_carried(cores, log=log)
            part(f"carried cores exported into {cores} in {time.perf_counter() - started:.0f} s (torch "
                 f"{prepared['torch']}, Triton {prepared['triton']}, targets {', '.join(prepared['targets'])})", [])
        except Exception as exc:  # the export's own error names the problem
            part("carried cores exported", [f"{type(exc).__name__}: {exc}"])
    modules = [step.module for step in PLAN] + ["benchmarks.gpu.serve_probe"]
    done = subprocess.run([sys.executable, "-c", "import importlib, sys\nfor m in sys.argv[1:]: "
                           "importlib.import_module(m)", *modules], cwd=ROOT, capture_output=True, text=True)
    part(f"the {len(modules)} step modules import", [done.stderr.strip()[-1500:]] if done.returncode else [])
    carried = tracked_bytes() + _size(wheelhouse) + _size(cores)
    part(f"the device tool would carry {carried / 2**20:.1f} MiB (tracked files, wheelhouse, cores) of "
         f"{TOOL_CARRY_LIMIT / 2**20:.0f} MiB", [] if carried <= TOOL_CARRY_LIMIT else ["over the limit"])
    log(f"dry run: {'ok' if not failed else 'FAILED: ' + '; '.join(failed)}")
    return 1 if failed else 0
