"""`make gpu-check`: the first-run script for a CUDA machine, inside a deadline of ``plan.DEADLINE_S`` (560 s).

On the GPU machine (the checkout on PYTHONPATH, build/wheelhouse and build/gpu-check-cores carried in)::

    python -m benchmarks.gpu_check             # every step of benchmarks/gpu/plan.py, in order

Each step runs as its own subprocess under its timeout (``plan.step_timeout``), its output going to the
console and ``log.txt``; the step records assertions, metrics and tables, and ``results.json`` and
``results.md`` are rewritten after every step, so a run cut short still says how far it got. Everything is
written to ``$OUT`` when that is set, else to ``build/gpu-check``. The exit status is 0 only when every
step passed every assertion.

Here, on the preparing machine (CPU)::

    python -m benchmarks.gpu_check --dry-run   # = make gpu-check DRY=1

builds or checks the wheelhouse, checks that it covers every import the GPU steps make, exports the
carried cores, imports every step, prints the plan and verifies its budgets fit the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.gpu.plan import DEADLINE_S, PLAN, Step, budget_problems, step_timeout
from benchmarks.gpu.record import with_site

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "gpu-check"


class Log:
    """Lines to the console and ``log.txt`` at once."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.file.write(line + "\n")


def run_step(step: Step, timeout_s: float, arguments: list[str], result: Path, log: Log, work: Path) -> dict:
    """One step in its own process group, killed with everything it started when ``timeout_s`` passes."""
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", step.module, *arguments, "--result", str(result)]
    env = dict(with_site(work), PYTHONUNBUFFERED="1")  # with the install step's --target fallback, if it ran
    log(f"=== step {step.name} (timeout {timeout_s:.0f} s): {step.summary}")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", start_new_session=True)
    reader = threading.Thread(target=lambda: [log(f"[{step.name}] {line.rstrip()}") for line in process.stdout])
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(process)
    reader.join(timeout=10)
    seconds = time.perf_counter() - started
    recorded = json.loads(result.read_text()) if result.is_file() else {"assertions": [], "metrics": {}, "tables": []}
    if timed_out:
        recorded["assertions"].append({"name": f"finished within {timeout_s:.0f} s", "ok": False,
                                       "detail": "killed at its timeout with every process it started"})
    passed = process.returncode == 0 and recorded["assertions"] and all(a["ok"] for a in recorded["assertions"])
    status = "timeout" if timed_out else "passed" if passed else "failed"
    log(f"=== step {step.name}: {status} in {seconds:.1f} s (exit {process.returncode})")
    return dict(name=step.name, summary=step.summary, budget_s=step.budget_s, timeout_s=round(timeout_s, 1),
                seconds=round(seconds, 1), status=status, returncode=process.returncode, **recorded)


def _kill_group(process: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_plan(plan: tuple[Step, ...], out: Path, arguments: list[str], work: Path,
             deadline_s: float = DEADLINE_S) -> dict:
    """Every step of ``plan`` in order under ``deadline_s``; the results, also written to ``out``."""
    log = Log(out / "log.txt")
    results = {"command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu_check", *sys.argv[1:]]),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "deadline_s": deadline_s,
               "budgets_s": sum(s.budget_s for s in plan), "steps": [], "ok": False}
    started = time.perf_counter()
    for index, step in enumerate(plan):
        timeout_s = step_timeout(plan, index, time.perf_counter() - started, deadline_s)
        if timeout_s < 1:
            log(f"=== step {step.name}: skipped, the deadline leaves no time for it")
            results["steps"].append(dict(name=step.name, summary=step.summary, budget_s=step.budget_s, timeout_s=0,
                                         seconds=0, status="skipped", returncode=None, metrics={}, tables=[],
                                         assertions=[{"name": "ran before the deadline", "ok": False,
                                                      "detail": f"deadline {deadline_s:g} s"}]))
        else:
            results["steps"].append(run_step(step, timeout_s, arguments, work / "results" / f"{step.name}.json", log,
                                                  work))
        results["seconds"] = round(time.perf_counter() - started, 1)
        results["ok"] = all(s["status"] == "passed" for s in results["steps"]) and len(results["steps"]) == len(plan)
        write_results(out, results)
    log(summary(results))
    return results


def write_results(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(results))


def summary(results: dict) -> str:
    lines = [f"gpu-check: {'PASSED' if results['ok'] else 'FAILED'} in {results.get('seconds', 0)} s "
             f"(deadline {results['deadline_s']:g} s)"]
    for step in results["steps"]:
        held = sum(a["ok"] for a in step["assertions"])
        lines.append(f"  {step['name']:<12} {step['status']:<8} {step['seconds']:>6} s of {step['timeout_s']:>5} s  "
                     f"{held}/{len(step['assertions'])} assertions")
        lines += [f"      FAILED {a['name']}" + (f": {a['detail'][:300]}" if a["detail"] else "")
                  for a in step["assertions"] if not a["ok"]]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    lines = ["# gpu-check results", "", f"`{results['command']}`, started {results['started']}; "
             f"{'passed' if results['ok'] else 'FAILED'} in {results.get('seconds', 0)} s "
             f"(deadline {results['deadline_s']:g} s).", "",
             "| step | status | seconds | timeout | assertions held |", "|---|---|---|---|---|"]
    for step in results["steps"]:
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {step['timeout_s']} | "
                     f"{sum(a['ok'] for a in step['assertions'])}/{len(step['assertions'])} |")
    for step in results["steps"]:
        lines += ["", f"## {step['name']}: {step['status']}", "", step["summary"], ""]
        lines += [f"- {'ok' if a['ok'] else '**FAILED**'} {a['name']}" + (f": {a['detail']}" if a["detail"] else "")
                  for a in step["assertions"]]
        for table in step.get("tables", []):
            lines += ["", f"**{table['title']}**", "", "| " + " | ".join(table["header"]) + " |",
                      "|" + "---|" * len(table["header"])]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
        if step.get("metrics"):
            lines += ["", "```json", json.dumps(step["metrics"], indent=1, default=str), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT, else build/gpu-check)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check-work",
                        help="scratch: cores and checkpoints made on this machine (never under --out)")
    parser.add_argument("--cores", type=Path, default=ROOT / "build" / "gpu-check-cores",
                        help="the carried cores (made by --dry-run on the preparing machine)")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / "build" / "wheelhouse")
    parser.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU only: wheelhouse, import coverage, carried cores, step imports, plan and budgets")
    parser.add_argument("--no-export", action="store_true", help="with --dry-run: keep the carried cores as they are")
    args = parser.parse_args(argv)
    if args.dry_run:
        from benchmarks.gpu.dry_run import dry_run

        return dry_run(args.wheelhouse, args.cores, export=not args.no_export)
    plan = PLAN
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in {s.name for s in PLAN}]
        if unknown or not wanted:
            parser.error(f"--only: unknown step {', '.join(unknown) or '(none given)'}; the steps are "
                         f"{', '.join(s.name for s in PLAN)}")
        plan = tuple(s for s in PLAN if s.name in wanted)
    problems = budget_problems(plan, DEADLINE_S)
    if problems:
        parser.error("; ".join(problems))
    out = args.out or Path(os.environ.get("OUT") or DEFAULT_OUT)
    for folder in (out, args.work):
        if folder.exists() and not folder.is_dir():
            parser.error(f"{folder} exists and is not a folder")
    if args.work.resolve().is_relative_to(out.resolve()):
        parser.error(f"--work {args.work} must not lie under the results folder {out} (cores would be sent back)")
    out.mkdir(parents=True, exist_ok=True)
    (args.work / "results").mkdir(parents=True, exist_ok=True)
    arguments = ["--cores", str(args.cores), "--wheelhouse", str(args.wheelhouse), "--work", str(args.work)]
    return 0 if run_plan(plan, out, arguments, args.work)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
