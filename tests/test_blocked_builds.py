"""``benchmarks.blocked_builds``: two builds of the blocked product timed side by side, their outputs compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ignition.runtime.backends import blocked_linear

ROOT = Path(__file__).resolve().parents[1]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.blocked_builds", "--threads", "1", "--layers", "1",
                           "--repeats", "1", *arguments], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_a_commit_against_itself_times_every_path_and_finds_the_same_bits():
    if blocked_linear.unavailable() is not None or not (ROOT / ".git").exists():
        pytest.skip("needs the blocked product and the checkout's git history")
    done = _run("--old", "HEAD", "--rows", "1,3")
    assert done.returncode == 0, done.stderr[-2000:]
    for rows in (1, 3):
        for path in ("blocked (this checkout)", "blocked (HEAD)", "aten.linear"):
            assert f"rows    {rows}  {path}" in done.stdout
        assert f"rows    {rows}  the two builds' outputs bit-identical: yes" in done.stdout


def test_an_unknown_commit_is_named():
    if not (ROOT / ".git").exists():
        pytest.skip("needs the checkout's git history")
    done = _run("--old", "no-such-commit")
    assert done.returncode != 0 and "git show no-such-commit:ignition/runtime/backends/blocked_linear.c failed" \
        in done.stderr and "Traceback" not in done.stderr
