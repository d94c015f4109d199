"""What one gpu-check step reports: assertions, metrics and tables, rewritten to its result file as they come.

A step that is killed at its timeout has still written every assertion it reached. ``step_main`` runs a
step function under the common arguments and turns an unexpected exception into a failed assertion
(with the traceback's tail in the log), so a step never ends without saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def site_dir(work: Path) -> Path:
    """Where the install step's ``--target`` fallback puts the carried wheels (absent when pip installed them)."""
    return work / "site"


def with_site(work: Path, env: dict | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the checkout and ``site_dir(work)`` on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH"), str(site_dir(work))]))
    return env


class Record:
    """The result file of one step: ``{"assertions": [...], "metrics": {...}, "tables": [...]}``."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data = {"assertions": [], "metrics": {}, "tables": []}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        ok = bool(ok)
        self.data["assertions"].append({"name": name, "ok": ok, "detail": str(detail)})
        print(f"[{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
        self._flush()
        return ok

    def metric(self, key: str, value) -> None:
        self.data["metrics"][key] = value
        print(f"[metric] {key} = {json.dumps(value, default=str)}", flush=True)
        self._flush()

    def table(self, title: str, header: list[str], rows: list[list]) -> None:
        self.data["tables"].append({"title": title, "header": header, "rows": rows})
        print(f"[table] {title}\n  " + " | ".join(header), flush=True)
        for row in rows:
            print("  " + " | ".join(str(c) for c in row), flush=True)
        self._flush()

    @contextmanager
    def attempt(self, name: str):
        """Runs the block; an exception becomes the failed assertion ``name`` and the step goes on."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc()
            self.check(name, False, f"{type(exc).__name__}: {str(exc)[:2000]}")

    @property
    def ok(self) -> bool:
        return all(a["ok"] for a in self.data["assertions"])

    def _flush(self) -> None:
        if self.path is None:
            return
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(scratch, self.path)


@dataclass(frozen=True, slots=True)
class Context:
    """Where a step finds its inputs: the carried cores, the wheelhouse, and its own work folder."""

    cores: Path  # exported on the preparing machine (``--dry-run``), carried in
    wheelhouse: Path
    work: Path  # this run's scratch: cores exported here, checkpoints

    def carried(self, name: str) -> Path:
        return self.cores / name

    def fresh(self, name: str) -> Path:
        return self.work / "cores" / name


def step_main(run) -> None:
    """Parse the common step arguments, call ``run(context, record)``, exit 0 only if every assertion held."""
    parser = argparse.ArgumentParser(description=(run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else None)
    parser.add_argument("--cores", type=Path, default=ROOT / "build" / "gpu-check-cores")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / "build" / "wheelhouse")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-check-work")
    parser.add_argument("--result", type=Path, default=None, help="the step's result JSON")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    record = Record(args.result)
    try:
        run(Context(args.cores, args.wheelhouse, args.work), record)
    except Exception as exc:  # the step itself broke: say where, fail, and let the next step run
        traceback.print_exc()
        record.check("the step ran to completion", False, f"{type(exc).__name__}: {str(exc)[:2000]}")
    if not record.data["assertions"]:
        record.check("the step asserted something", False, "no assertion was recorded")
    sys.exit(0 if record.ok else 1)
