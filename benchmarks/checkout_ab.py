"""Decode steps of two checkouts, each exporting and running its own core: an A/B across commits and core formats.

``python -m benchmarks.checkout_ab REV CHECKPOINT --export-args "--recipe qwen3 --capacities 1,8" --batches 1,8
--pairs 10 --threads 2`` makes a detached ``git worktree`` of revision ``REV`` in a temporary directory (the *old*
tree; the *new* one is this checkout, its uncommitted changes included), exports ``CHECKPOINT`` with each tree
(``python -m ignition.cli export-core`` under that tree's ``PYTHONPATH``, the same ``--export-args``), then, for each
batch, runs ``--pairs`` pairs of fresh processes, one a side, old first in even pairs and new first in odd ones. Each
process loads its tree's core under its tree's ``ignition``, admits the batch's requests (``[lane + 1, 7, 9, 11]``,
greedy, ``max_tokens`` 28, ``ignore_eos``), prefills them and runs 3 warm-up rounds (``benchmarks._steps``
``warmed_engine``), then times ``--steps`` (20) ``engine.step()`` rounds and reports their median. Each pair's ratio is
new over old; the output is one line a pair and, per batch, the median of its pairs' ratios. ``benchmarks/core_ab.py``
alternates rounds in one process, which is finer but needs both cores loadable by one ``ignition``; a pair of fresh
processes seconds apart leaves only the host's drift between them, which the alternation and the median of pairs even
out. ``--json FILE`` also writes every pair's medians and ratios. The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEASURED = "checkout_ab: "
"""The prefix of a measuring process's one result line (JSON after it)."""


def measure(core: Path, batch: int, steps: int, threads: int) -> dict:
    """One side of a pair, in its own process: the median of ``steps`` decode rounds of ``batch`` lanes on ``core``
    (seconds), the ``ignition`` that ran them and the lanes' generated tokens so far."""
    import torch

    torch.set_num_threads(threads)
    import ignition
    from _steps import decode_requests, lane_prompts, timed_steps, warmed_engine  # this checkout's, beside this file
    from ignition.runtime.core import load_core

    engine = warmed_engine(load_core(core), decode_requests(lane_prompts(batch), None, steps))
    seconds = timed_steps(engine, steps)
    tokens = [list(state.generated) for state in engine.running]  # every lane's tokens so far (greedy: both sides')
    return {"median_s": statistics.median(seconds), "steps": len(seconds), "ignition": ignition.__file__,
            "tokens": tokens}


def run_side(tree: Path, core: Path, batch: int, steps: int, threads: int) -> dict:
    """``measure`` in a fresh process whose ``ignition`` is ``tree``'s."""
    command = [sys.executable, str(HERE / "checkout_ab.py"), "--measure", str(core), "--batch", str(batch),
               "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    lines = [line for line in done.stdout.splitlines() if line.startswith(MEASURED)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"checkout_ab: measuring {core} at batch {batch} under {tree} failed "
                           f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1][len(MEASURED):])


def export(tree: Path, checkpoint: Path, out: Path, export_args: list[str]) -> None:
    """``checkpoint`` exported to ``out`` by ``tree``'s ``ignition`` (``python -m ignition.cli export-core``)."""
    command = [sys.executable, "-m", "ignition.cli", "export-core", str(checkpoint), "--out", str(out),
               "--overwrite", *export_args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)))
    if done.returncode != 0:
        raise RuntimeError(f"checkout_ab: export under {tree} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")


def old_tree(revision: str, directory: Path) -> Path:
    """A detached ``git worktree`` of ``revision`` at ``directory`` (``remove_tree`` removes it)."""
    done = subprocess.run(["git", "worktree", "add", "--detach", str(directory), revision], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"checkout_ab: git worktree add {revision} failed: {done.stderr.strip()}")
    return directory


def remove_tree(directory: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(directory)], cwd=ROOT, capture_output=True)


def compare(revision: str, checkpoint: Path, export_args: list[str], batches: list[int], pairs: int, steps: int,
            threads: int, work: Path) -> dict:
    """Every batch's pairs: ``{batch: [{"old": seconds, "new": seconds, "ratio": new / old}, ...]}``, the medians of
    the ratios and which ``ignition`` each side ran."""
    tree = old_tree(revision, work / "old-tree")
    try:
        cores = {"old": work / "old-core", "new": work / "new-core"}
        trees = {"old": tree, "new": ROOT}
        for side in ("old", "new"):
            export(trees[side], checkpoint, cores[side], export_args)
        report = {"revision": revision, "pairs": {}, "median_ratio": {}, "ignition": {}}
        for batch in batches:
            rows = []
            for pair in range(pairs):
                order = ("old", "new") if pair % 2 == 0 else ("new", "old")
                measured = {side: run_side(trees[side], cores[side], batch, steps, threads) for side in order}
                report["ignition"] = {side: measured[side]["ignition"] for side in order}
                rows.append({"old": measured["old"]["median_s"], "new": measured["new"]["median_s"],
                             "ratio": measured["new"]["median_s"] / measured["old"]["median_s"],
                             "same_tokens": measured["old"]["tokens"] == measured["new"]["tokens"]})
                print(f"batch {batch} pair {pair + 1} ({order[0]} first): old {rows[-1]['old'] * 1e3:.2f} ms, "
                      f"new {rows[-1]['new'] * 1e3:.2f} ms, new/old {rows[-1]['ratio']:.3f}"
                      + ("" if rows[-1]["same_tokens"] else " (the sides generated different tokens)"), flush=True)
            report["pairs"][batch] = rows
            report["median_ratio"][batch] = statistics.median(row["ratio"] for row in rows)
            print(f"batch {batch}: median new/old {report['median_ratio'][batch]:.3f} over {pairs} pairs", flush=True)
        return report
    finally:
        remove_tree(tree)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", nargs="?", help="the old side's git revision")
    parser.add_argument("checkpoint", nargs="?", type=Path, help="the Hugging Face checkpoint both sides export")
    parser.add_argument("--export-args", default="--recipe qwen3 --capacities 1,8",
                        help="export-core options, the same for both sides (one string)")
    parser.add_argument("--batches", default="1,8", help="lanes of each measured batch, comma-separated")
    parser.add_argument("--pairs", type=int, default=10, help="pairs of processes (old, new) per batch")
    parser.add_argument("--steps", type=int, default=20, help="timed decode rounds per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="directory for the worktree and the cores "
                        "(default: a temporary one, removed)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # one side, in a fresh process
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be at least 1")
    if args.measure is not None:
        print(MEASURED + json.dumps(measure(args.measure, args.batch, args.steps, args.threads)), flush=True)
        return
    if args.revision is None or args.checkpoint is None:
        parser.error("REV and CHECKPOINT are required")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated lane counts, found {args.batches!r}")
    if args.pairs < 1 or not batches or min(batches) < 1:
        parser.error("--pairs and every batch must be at least 1")
    with tempfile.TemporaryDirectory(prefix="checkout-ab-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        try:
            report = compare(args.revision, args.checkpoint.resolve(), shlex.split(args.export_args), batches,
                             args.pairs, args.steps, args.threads, work.resolve())
        except RuntimeError as exc:
            sys.exit(f"error: {exc}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
