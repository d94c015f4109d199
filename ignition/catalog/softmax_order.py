"""Where ATen's CPU softmax stops summing a row one element after another, measured on this machine.

NOTE: ATen's CPU softmax reduces a row shorter than its FP32 vector one element after another, and a longer one lane
by lane (``vec_reduce_all``); the vector is what ATen's dispatch picked (``torch.backends.cpu.get_cpu_capability()``:
16 lanes under AVX-512, 8 under AVX2; no vectorized order at all under ``DEFAULT``). BF16/FP16 attention keeps
transformers' rounding of short forwards by softmaxing them over their first ``short_row() - 1`` keys
(``recipes/attention.py``, ``SHORT_ROW``), so that length is taken from the machine, never assumed: ``lane_boundary``
finds it by softmaxing rows with and without one masked key past them (a masked key adds an exact zero, which
changes no sum taken in order, while the first length summed lane by lane regroups the same values). The graphs are
traced with the value, so the exporter records it in the manifest (``model.softmax_short_row``) and a load on a CPU
whose ATen sums at another length warns (``short_row_mismatch``). ``ATEN_CPU_CAPABILITY`` (``avx2``, ``avx512``,
``default``, set before torch starts) emulates another ISA family's dispatch on a CPU that has the instructions, for
an export meant for that family and for the tests.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

PROBE_LIMIT = 64
"""Row lengths probed, 2 to this: past every x86 vector of FP32 (16 lanes) with room for wider ones."""
PROBE_ROWS = 64
"""Seeded random rows a length is probed on: a regrouped sum rounds differently in some of them (at 16 lanes, about
half of the rows)."""
SEQUENTIAL_SHORT_ROW = 2
"""``short_row`` where no probed length sums lane by lane: every row sums in order, which keeps transformers' bits
whatever the length, so the short forwards (a single key) cost nothing."""


@cache
def lane_boundary() -> int | None:
    """The shortest softmax row ATen sums lane by lane here (BF16 scores, FP32 softmax: transformers' eager
    attention), or None when every length up to ``PROBE_LIMIT`` sums one element after another."""
    generator = torch.Generator().manual_seed(0)
    masked = torch.finfo(torch.bfloat16).min
    for length in range(2, PROBE_LIMIT + 1):
        live = torch.randn(PROBE_ROWS, length - 1, generator=generator).to(torch.bfloat16)
        padded = torch.softmax(F.pad(live, (0, 1), value=masked), dim=-1, dtype=torch.float32).narrow(-1, 0, length - 1)
        if not torch.equal(padded, torch.softmax(live, dim=-1, dtype=torch.float32)):
            return length
    return None


def short_row() -> int:
    """``SHORT_ROW`` for graphs traced on this machine: ``lane_boundary``, or ``SEQUENTIAL_SHORT_ROW``."""
    return lane_boundary() or SEQUENTIAL_SHORT_ROW


def short_row_mismatch(recorded: int | None) -> str | None:
    """Why a core whose BF16/FP16 attention was traced for ``recorded`` (``model.softmax_short_row``; None: not
    recorded, an FP32 core or an older one) softmaxes some short forwards in another order than transformers does on
    this machine; None when it does not (equal lengths, or a machine that sums every row in order)."""
    here = lane_boundary()
    if recorded is None or here is None or recorded == here:
        return None
    return (f"this core's BF16/FP16 attention was exported for a CPU whose softmax sums rows of {recorded} or more "
            f"keys lane by lane, and ATen sums from {here} keys here ({torch.backends.cpu.get_cpu_capability()}): "
            f"forwards over fewer than {max(recorded, here)} keys may round some probabilities differently from "
            f"transformers' BF16 eager attention (within BF16 fidelity, not bit for bit). Export the core on this "
            f"CPU's ISA family to keep transformers' bits (ATEN_CPU_CAPABILITY selects it, e.g. avx2)")


__all__ = ["PROBE_LIMIT", "SEQUENTIAL_SHORT_ROW", "lane_boundary", "short_row", "short_row_mismatch"]
