"""The Triton interpreter checks' subprocess, shared by tests/test_triton_logprobs.py and tests/test_triton_vocabulary.py.

A check script (tests/_triton_interp_check.py, tests/_triton_vocabulary_check.py) runs its cases under
TRITON_INTERPRET=1 in its own process (the interpreter must be enabled before Triton is imported and breaks
torch.export in the same process) and prints one JSON line per case: ``{"case": name, "failures": [...]}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def case_names(helper: Path) -> list[str]:
    """The ``CASE_NAMES`` of a check script, read without running its cases."""
    spec = importlib.util.spec_from_file_location(f"{helper.stem}_names", helper)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASE_NAMES)


def interpreted_cases(helper: Path) -> dict[str, list[str]]:
    """Each case's failures from one interpreter run of ``helper``; fails the test if the run broke."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(helper)], env=env, cwd=helper.parent.parent, capture_output=True,
                          text=True, timeout=600)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case"]] = record["failures"]
    if done.returncode != 0 or not results:
        pytest.fail(f"interpreter run failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return results
