"""Prepared launchers belong to their core (issue 25): two prepared cores and one without logprobs, loaded side by
side under the emulated CUDA driver (tests/_launcher_emulation.py, Triton's interpreter), each keep their kernels.

The process-wide launcher slot this replaces broke exactly this: each load replaced it and a core without logprobs
removed it, so ``big`` ran ``small``'s kernels (or none) once ``small`` was loaded, as gpu_check's ``big_plain``
after ``big`` would have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ignition.components import device_reduction as D
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions

HELPER = Path(__file__).parent / "_launcher_emulation.py"


@pytest.fixture(scope="module")
def cores(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("per-core")
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), targets=("cuda:90",)), root / "big")
    export_core(ExportOptions(recipe="toy", capacities=(2,), targets=("cuda:90",)), root / "small")
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), logprobs=False), root / "plain")
    return root


def test_each_core_launches_its_own_kernels(cores):
    """Loaded big, plain (no logprobs), small; run big, plain, small, then big again from a fresh thread: every
    launch comes from the running core's own modules, with the primary context current on the launching thread,
    and every result equals the plain CPU replay's."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(HELPER), "--cores", *(str(cores / n) for n in ("big", "plain", "small"))],
                          capture_output=True, text=True, timeout=900, env=env, cwd=HELPER.parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"run0-big", "run1-plain", "run2-small", "run3-big", "driver", "probe"}
    assert {check: problems for check, problems in results.items() if problems} == {}


def test_a_binding_lasts_while_its_run_does_and_the_innermost_wins():
    device, outer, inner = torch.device("cuda", 3), object(), object()
    assert D.bound_launcher(device) is None
    with D.bind_launcher(device, outer):
        assert D.bound_launcher(device) is outer and D.bound_launcher(torch.device("cuda", 4)) is None
        with D.bind_launcher(device, inner):
            assert D.bound_launcher(device) is inner
        assert D.bound_launcher(device) is outer
    assert D.bound_launcher(device) is None


def test_an_unbound_device_op_names_the_fix(monkeypatch):
    monkeypatch.delenv(D.JIT_ENV, raising=False)
    logits = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match=r"reduce_logprobs on cpu: no prepared kernels are loaded.*load_core"):
        D._reduce_on_device(logits, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32),
                            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), None, None, 16, 0)
