"""catalog/softmax_order.py: the softmax row length from which ATen sums lane by lane is measured on the machine,
never assumed, and BF16 attention's short forwards (``recipes/attention.SHORT_ROW``) keep transformers' softmax bits
with it: here, and under the other ISA families' dispatch where this CPU can run it (``ATEN_CPU_CAPABILITY``). A
BF16 core records the length it was traced for, and a load on a CPU that sums at another length warns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VECTOR_FLOATS = {"AVX512": 16, "AVX2": 8, "DEFAULT": None}
"""ATen's FP32 vector under each x86 dispatch (``Vectorized<float>::size()``), None: the ``DEFAULT`` kernels' sums
take every row in order. What the probe must find; a change in ATen's reduction shows here first."""
WINDOW = 64  # a key window of two 32-position granules
ROWS = 48


def _softmax_report() -> dict:
    """This process's dispatch, the probe's length, ``SHORT_ROW``, and the key extents (1 to ``WINDOW``) whose rows
    ``_softmax_in_order`` over the window does not give transformers' bits for (its FP32 softmax of the BF16 scores of
    the forward's keys alone), each over ``ROWS`` seeded rows."""
    from ignition.catalog.softmax_order import lane_boundary
    from ignition.recipes.attention import SHORT_ROW, _softmax_in_order, short_forwards

    generator = torch.Generator().manual_seed(0)
    wrong = []
    for extent in range(1, WINDOW + 1):
        scores = torch.randn(ROWS, WINDOW, generator=generator).to(torch.bfloat16)
        scores[:, extent:] = torch.finfo(torch.bfloat16).min  # the keys past the forward, masked as the graph masks
        ours = _softmax_in_order(scores, short_forwards(torch.tensor(extent)))
        theirs = torch.softmax(scores[:, :extent], dim=-1, dtype=torch.float32)
        if not (torch.equal(ours[:, :extent], theirs) and not ours[:, extent:].any()):
            wrong.append(extent)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "boundary": lane_boundary(),
            "short_row": SHORT_ROW, "wrong": wrong}


def _check(report: dict) -> None:
    if report["capability"] not in VECTOR_FLOATS:
        pytest.skip(f"no expected vector length for the {report['capability']} dispatch")
    assert report["boundary"] == VECTOR_FLOATS[report["capability"]], report
    assert report["short_row"] == (report["boundary"] or 2), report
    assert report["wrong"] == [], f"extents whose softmax differs from transformers': {report}"


def test_short_forwards_keep_transformers_softmax_bits_here():
    _check(_softmax_report())


EMULATED = {"AVX512": ("avx2", "default"), "AVX2": ("default",)}
"""The other families' dispatch a CPU of each family can run."""


@pytest.mark.parametrize("family", ["avx2", "default"])
def test_the_other_families_dispatch_is_measured_too(family):
    here = torch.backends.cpu.get_cpu_capability()
    if family not in EMULATED.get(here, ()):
        pytest.skip(f"the {here} dispatch cannot emulate {family}")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=os.environ | {"ATEN_CPU_CAPABILITY": family, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["capability"] == family.upper()
    _check(report)


def test_a_mismatch_says_which_forwards_and_what_to_do(monkeypatch):
    from ignition.catalog import softmax_order

    monkeypatch.setattr(softmax_order, "lane_boundary", lambda: 8)
    message = softmax_order.short_row_mismatch(16)
    assert "rows of 16 or more" in message and "from 8 keys here" in message and "fewer than 16 keys" in message
    assert "ATEN_CPU_CAPABILITY" in message
    assert softmax_order.short_row_mismatch(8) is None
    assert softmax_order.short_row_mismatch(None) is None  # an FP32 core (or an older one) records none
    monkeypatch.setattr(softmax_order, "lane_boundary", lambda: None)  # every row in order: any length keeps the bits
    assert softmax_order.short_row_mismatch(16) is None


def test_a_bf16_core_records_its_short_row_and_a_load_checks_it(core_copy, monkeypatch):
    """The exporter's model section of a BF16 core records ``SHORT_ROW`` (an FP32 one nothing: its attention is the
    fused kernel); a core recording this machine's length loads quietly, one recording another warns."""
    from ignition.catalog import softmax_order
    from ignition.exporter.export import model_section
    from ignition.recipes.attention import SHORT_ROW
    from ignition.runtime.core import load_core

    assert model_section({"dtype": "bfloat16"}) == {"dtype": "bfloat16", "softmax_short_row": SHORT_ROW}
    assert SHORT_ROW == softmax_order.short_row()
    assert model_section({"dtype": "float32"}) == {"dtype": "float32"}
    core_copy.edit("manifest.json", lambda manifest: manifest["model"].update(softmax_short_row=SHORT_ROW))
    with warnings.catch_warnings(record=True) as caught:  # the machine it was exported on: no warning
        warnings.simplefilter("always")
        assert load_core(core_copy.root).spec.model.softmax_short_row == SHORT_ROW
    assert not [w for w in caught if "lane by lane" in str(w.message)]
    monkeypatch.setattr(softmax_order, "lane_boundary", lambda: SHORT_ROW * 2)
    with pytest.warns(UserWarning, match=f"rows of {SHORT_ROW} or more keys lane by lane"):
        load_core(core_copy.root)


if __name__ == "__main__":  # the emulation tests' child: this process's report
    print(json.dumps(_softmax_report()))
