"""benchmarks/machine.py: the CPU model, the ISA flags, the streaming-GEMV read bandwidth and the weight-streaming
floor a CPU benchmark reports (on small sizes here; ``benchmarks/realsize.py`` runs them at Qwen3-0.6B's)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.machine import (RELIED_FLAGS, BandwidthProbe, cpu_flags, floor_bandwidths, floor_fraction, floor_line,
                                floor_targets, gemv_bandwidth, header, relied_flags, weight_bytes)

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile hypervisor
processor\t: 1
flags\t\t: fpu
"""


def test_the_flags_relied_on_come_from_the_first_cpu_in_table_order():
    flags = cpu_flags(CPUINFO)
    assert "hypervisor" in flags and "amx_bf16" in flags
    assert relied_flags(flags) == ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert relied_flags(cpu_flags("model name : x\n")) == []
    assert set(relied_flags(cpu_flags())) <= set(RELIED_FLAGS)


def test_the_gemv_probe_measures_both_products():
    rates = gemv_bandwidth(nbytes=4 << 20, width=256, repeats=3)
    assert {"aten", "best"} <= set(rates) and rates["best"] == max(v for k, v in rates.items() if k != "best")
    assert all(1e8 < rate < 1e13 for rate in rates.values())  # 0.1 GB/s to 10 TB/s: bytes over seconds, not a slip


def test_a_probe_measures_again_on_its_weight_and_reports_the_spread():
    probe = BandwidthProbe(nbytes=4 << 20, width=256, repeats=3)
    first, second = probe.measure("start"), probe.measure("before batch 1")
    assert [label for label, _ in probe.samples] == ["start", "before batch 1"]
    assert probe.samples[1][1] is second and first["best"] == max(v for k, v in first.items() if k != "best")
    low, high = sorted(rates["best"] / 1e9 for rates in (first, second))
    assert probe.spread() == f"{low:.1f}-{high:.1f} GB/s over 2 probes"


def test_each_batch_is_put_against_the_faster_probe_beside_it():
    assert floor_bandwidths({1: 30e9, 8: 40e9}, {1: 35e9, 8: 28e9}) == {1: 35e9, 8: 40e9}
    assert floor_bandwidths({32: 30e9}, {}) == {32: 30e9}  # no probe after: the one before
    # at batch 1 a 50 ms floor (24 GB/s) and 18 tok/s is 90%; the same rate against a faster probe (30 GB/s) is 72%
    rates = {(1, None): (18.0, 14.0)}
    found = {t: m for t, m, _ in floor_targets(rates, 1_200_000_000, {1: 30e9})}
    assert found["decode batch 1 at least 85% of the weight-streaming floor"] == "72% at worst"


def test_a_row_at_the_floor_is_one_and_half_as_fast_is_a_half():
    # 1.2 GB of weights at 24 GB/s: 50 ms a step, 20 steps a second
    assert floor_fraction(20.0, 1, 1_200_000_000, 24e9) == pytest.approx(1.0)
    assert floor_fraction(80.0, 8, 1_200_000_000, 24e9) == pytest.approx(0.5)  # 10 steps a second at batch 8
    assert floor_line(1_200_000_000, 24e9) == "weight-streaming floor: 1.200 GB of weights at 24.0 GB/s = 50.0 ms " \
                                              "a decode step"


def test_the_floor_targets_judge_the_rows_a_run_has():
    rates = {(1, None): (18.0, 14.0), (1, 5): (17.5, 14.2), (8, None): (150.0, 90.0), (8, 5): (140.0, 95.0)}
    found = {target: (measured, met) for target, measured, met in floor_targets(rates, 1_200_000_000, 24e9)}
    assert found == {
        "decode batch 1 at least 85% of the weight-streaming floor": ("88% at worst", True),
        "decode batch 1 at least 1.2x HF eager (every logprobs setting)": ("1.23x at worst", True),
        "decode batch 8 at least 1.5x HF eager (every logprobs setting)": ("1.47x at worst", False)}
    slow = dict((t, met) for t, _, met in floor_targets({(1, None): (16.0, 14.0)}, 1_200_000_000, 24e9))
    assert slow == {"decode batch 1 at least 85% of the weight-streaming floor": False,
                    "decode batch 1 at least 1.2x HF eager (every logprobs setting)": False}
    assert floor_targets({}, 1, 1.0) == []


def test_a_tiny_cores_weights_and_the_header(toy_core):
    from ignition.runtime.core import load_core

    core = load_core(toy_core)
    assert weight_bytes(core.weights) == sum(t.numel() * t.element_size() for t in core.weights.values()) > 0
    assert weight_bytes({"w": torch.zeros(3, 4, dtype=torch.bfloat16)}) == 24
    text = header(2, {"aten": 20e9, "packed": 25e9, "best": 25e9})
    assert text.startswith("CPU: ") and "2 threads" in text and "ISA flags relied on: " in text
    assert "25.0 GB/s (aten 20.0, packed 25.0)" in text
