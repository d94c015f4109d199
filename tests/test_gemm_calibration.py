"""runtime/backends/gemm_calibration.py: each weight shape's CPU product (oneDNN packed or ``aten.linear``) chosen
by timing both once per CPU model, cached, honoured by the load, and forced by ``LoadOptions.gemm``. The mechanism
is tested, not which path wins here."""

from __future__ import annotations

import json

import pytest
import torch

from ignition.runtime.backends import gemm_calibration
from ignition.runtime.backends import blocked_linear
from ignition.runtime.backends.gemm_calibration import (ATEN, BLOCKED, FORCED_LAYOUT, PACK_LAYOUTS, PACKED, GemmPlan,
                                                        choose, decode_rows, machine_key, packed_path, path_layout,
                                                        time_paths)
from ignition.runtime.backends.host_cache import cpu_key, cpu_model
from ignition.runtime.backends.packed_linear import packing_available
from ignition.runtime.options import LoadOptionError, LoadOptions

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linear")
ANY = staticmethod(lambda dtype: True)
P1, P8 = packed_path(1), packed_path(8)


def _timed(per_shape: dict[tuple, dict[str, dict[str, float]]], calls: list):
    """A ``time_paths`` that returns ``per_shape``'s seconds; a path asked for and not given there takes 1 s."""
    def fake(shape, dtype, paths, rows=gemm_calibration.CALIBRATION_ROWS):
        calls.append(tuple(shape))
        return {count: {path: per.get(path, 1.0) for path in paths} for count, per in per_shape[tuple(shape)].items()}
    return fake


def test_the_faster_path_summed_over_row_counts_relative_to_the_best_wins():
    assert choose({"1": {P8: 1.0, ATEN: 2.0}, "8": {P8: 3.0, ATEN: 2.5}}) == P8  # 1 + 1.2 < 2 + 1
    assert choose({"1": {P8: 2.0, ATEN: 1.0}, "8": {P8: 1.0, ATEN: 1.1}}) == ATEN  # 2 + 1 > 1 + 1.1
    assert choose({"1": {P8: 1.0, ATEN: 1.0}}) == ATEN  # a tie keeps aten.linear
    # each layout is a path of its own: the one reordered for a row competes at every row count
    assert choose({"1": {P1: 1.0, P8: 1.3, ATEN: 2.0}, "8": {P1: 1.1, P8: 1.0, ATEN: 2.0}}) == P1  # 2.1 < 2.3
    assert choose({"1": {P1: 1.0, P8: 1.1, ATEN: 2.0}, "8": {P1: 2.0, P8: 1.0, ATEN: 2.0}}) == P8  # 3 > 2.1


def test_a_path_names_its_layout():
    assert [path_layout(path) for path in (ATEN, BLOCKED, PACKED, P1, P8)] == [None, None, FORCED_LAYOUT, 1, 8]
    assert PACK_LAYOUTS == gemm_calibration.CALIBRATION_ROWS and FORCED_LAYOUT in PACK_LAYOUTS
    for bad in ("packed@0", "packed@x", "mkl", "aten@1", "blocked@8"):
        with pytest.raises(ValueError, match=f"unknown GEMM path '{bad}'; expected aten, blocked, packed or "
                                             "packed@<rows>"):
            path_layout(bad)


def test_measured_choices_are_honoured_cached_and_reused(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed({
        (512, 1024): {"1": {P8: 1e-3, ATEN: 2e-3}, "8": {P8: 1e-3, ATEN: 2e-3}},
        (1024, 512): {"1": {P8: 3e-3, ATEN: 2e-3}, "8": {P8: 3e-3, ATEN: 2e-3}}}, calls))
    cache = tmp_path / "cache" / "gemm.json"
    plan = GemmPlan("calibrate", allowed=lambda dtype: True, cache=cache)
    assert plan.packs((512, 1024), torch.float32) and not plan.packs((1024, 512), torch.float32)
    assert plan.packs((512, 1024), torch.float32)  # decided once a load
    assert calls == [(512, 1024), (1024, 512)]
    assert plan.measured == ["float32 512x1024 at rows 1,8", "float32 1024x512 at rows 1,8"]
    saved = json.loads(cache.read_text())
    assert saved["machines"][machine_key()]["float32 512x1024 at rows 1,8"]["choice"] == P8
    assert saved["machines"][machine_key()]["float32 1024x512 at rows 1,8"]["seconds"]["8"][ATEN] == 2e-3
    again = GemmPlan("calibrate", allowed=lambda dtype: True, cache=cache)  # the next load reads the cache
    assert again.packs((512, 1024), torch.float32) and not again.packs((1024, 512), torch.float32)
    assert calls == [(512, 1024), (1024, 512)] and again.measured == []
    monkeypatch.setattr(gemm_calibration, "machine_key", lambda: "another CPU | torch x | 2 threads")
    other = GemmPlan("calibrate", allowed=lambda dtype: True, cache=cache)  # another CPU model times for itself
    other.packs((512, 1024), torch.float32)
    assert calls[-1] == (512, 1024) and len(json.loads(cache.read_text())["machines"]) == 2


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch):
    """The cache is written only when the host was not oversubscribed; these tests pin the cache, so the host is."""
    monkeypatch.setattr(gemm_calibration, "quiet", lambda: True)


def test_a_busy_hosts_timings_serve_the_load_and_are_not_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed({(64, 64): {"1": {P8: 1.0, ATEN: 2.0}}}, calls))
    monkeypatch.setattr(gemm_calibration, "quiet", lambda: False)
    assert GemmPlan("calibrate", cache=tmp_path / "c.json").packs((64, 64), torch.float32)
    assert not (tmp_path / "c.json").exists()
    assert GemmPlan("calibrate", cache=tmp_path / "c.json").packs((64, 64), torch.float32) and len(calls) == 2
    monkeypatch.undo()  # the real ``quiet``: load average against the CPUs this process may run on
    monkeypatch.setattr(gemm_calibration.os, "getloadavg", lambda: (11.4, 9.5, 7.0))
    monkeypatch.setattr(gemm_calibration.os, "sched_getaffinity", lambda pid: {0, 1})
    assert gemm_calibration.quiet() is False
    monkeypatch.setattr(gemm_calibration.os, "getloadavg", lambda: (1.5, 1.0, 0.9))
    assert gemm_calibration.quiet() is True


def test_the_row_counts_timed_are_the_loads_and_key_the_cache(tmp_path, monkeypatch):
    """A plan times the paths at its row counts (a core's decode capacities), each weighing alike, and caches the
    choice under them: the same shape at other row counts is another calibration. At one row the layout for one row
    wins here; with 8 and 32 rows beside it, the layout for eight does."""
    seen = []

    def fake(shape, dtype, paths, rows=gemm_calibration.CALIBRATION_ROWS):
        seen.append(tuple(rows))
        per_row = {1: {P1: 1.0, P8: 1.5, ATEN: 3.0}, 8: {P1: 2.0, P8: 1.0, ATEN: 3.0},
                   32: {P1: 3.0, P8: 1.0, ATEN: 3.0}}
        return {str(count): per_row[count] for count in rows}

    monkeypatch.setattr(gemm_calibration, "time_paths", fake)
    cache = tmp_path / "c.json"
    assert GemmPlan("calibrate", cache=cache, rows=(1,)).layout((64, 64), torch.float32) == 1
    assert GemmPlan("calibrate", cache=cache, rows=(32, 8, 1, 8)).layout((64, 64), torch.float32) == 8
    assert seen == [(1,), (1, 8, 32)]
    assert sorted(json.loads(cache.read_text())["machines"][machine_key()]) == [
        "float32 64x64 at rows 1", "float32 64x64 at rows 1,8,32"]
    assert GemmPlan("calibrate", cache=cache, rows=(1,)).layout((64, 64), torch.float32) == 1 and len(seen) == 2
    for bad in ((), (0, 8), (True,), (1.5,)):
        with pytest.raises(ValueError, match="GEMM calibration rows must be positive integers"):
            GemmPlan("calibrate", rows=bad)
    variants = [{"capacity": 8, "operation": 2}, {"capacity": 1, "operation": 2}, {"capacity": 256, "operation": 1},
                {"capacity": 8, "operation": 2}]  # decode c8, c1; a prefill chunk of 256 rows is not decode
    assert decode_rows(variants) == (1, 8) and decode_rows(variants[2:3]) == gemm_calibration.CALIBRATION_ROWS


def test_a_corrupt_or_unwritable_cache_only_means_timing_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed(
        {(64, 64): {"1": {P8: 1.0, ATEN: 2.0}}}, calls))
    (tmp_path / "bad.json").write_text("{not json")
    assert GemmPlan("calibrate", allowed=lambda dtype: True, cache=tmp_path / "bad.json").packs((64, 64), torch.float32)
    (tmp_path / "file").write_text("")
    blocked = GemmPlan("calibrate", allowed=lambda dtype: True, cache=tmp_path / "file" / "gemm.json")
    assert blocked.packs((64, 64), torch.float32) and len(calls) == 2


def test_forced_modes_and_disallowed_dtypes_time_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_calibration, "time_paths", lambda *a, **k: pytest.fail("timed a forced choice"))
    assert GemmPlan(PACKED, allowed=lambda dtype: True, cache=tmp_path / "c.json").packs((8, 8), torch.float32)
    forced = GemmPlan(BLOCKED, cache=tmp_path / "c.json")
    assert forced.path((8, 8), torch.float32, (1, 8), blocked=True) == BLOCKED
    assert forced.path((8, 8), torch.bfloat16, (1, 8), blocked=False) == ATEN  # not for the dtype: aten.linear
    assert GemmPlan(PACKED).path((8, 8), torch.float32, (), blocked=True) == ATEN
    assert not GemmPlan(ATEN, allowed=lambda dtype: True, cache=tmp_path / "c.json").packs((8, 8), torch.float32)
    never = GemmPlan("calibrate", allowed=lambda dtype: False, cache=tmp_path / "c.json")  # e.g. BF16 rounding apart
    assert not never.packs((8, 8), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown GEMM mode 'fast'"):
        GemmPlan("fast")


def test_every_products_layout_is_timed_on_this_machine():
    paths = (P1, P8, ATEN) if blocked_linear.unavailable() else (P1, P8, BLOCKED, ATEN)
    timings = time_paths((256, 512), torch.float32, paths, rows=(1, 8))
    assert set(timings) == {"1", "8"}
    assert all(set(per) == set(paths) and all(0 < s < 1 for s in per.values()) for per in timings.values())
    assert choose(timings) in paths


def test_a_cached_choice_stands_only_for_the_paths_it_timed(tmp_path, monkeypatch):
    """A calibration timed without the blocked product (no compiler then) is timed again once the product can run:
    the cached choice was never measured against it."""
    calls = []
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed({(64, 64): {"1": {P8: 1.0, ATEN: 2.0}}}, calls))
    cache = tmp_path / "c.json"
    assert GemmPlan("calibrate", cache=cache, rows=(1,)).path((64, 64), torch.float32, (8,)) == P8
    assert GemmPlan("calibrate", cache=cache, rows=(1,)).path((64, 64), torch.float32, (8,)) == P8 and len(calls) == 1
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed(
        {(64, 64): {"1": {P8: 1.0, BLOCKED: 0.5, ATEN: 2.0}}}, calls))
    again = GemmPlan("calibrate", cache=cache, rows=(1,))
    assert again.path((64, 64), torch.float32, (8,), blocked=True) == BLOCKED and len(calls) == 2
    assert again.layout((64, 64), torch.float32, (8,)) == 8  # asked without the blocked product: timed apart


def test_the_load_option_is_validated_and_travels_to_worker_ranks():
    assert LoadOptions.create("cpu").gemm == "calibrate"
    options = LoadOptions.create("cpu", gemm=ATEN)
    assert LoadOptions.from_json(options.to_json()).gemm == ATEN
    with pytest.raises(LoadOptionError, match="--gemm must be one of calibrate, packed, blocked, aten, got 'fastest'"):
        LoadOptions.create("cpu", gemm="fastest")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("gemm")
    save_checkpoint(TinyCase("qwen3", torch.float32, True, 300), root / "ckpt")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1,), chunk_limit=8,
                              max_seq_len=32), root / "core")
    return root / "core"


def _packed_weights(loaded) -> set[tuple[int, ...]]:
    """The shapes of the weights some graph multiplies by packed (its ``_packed_*`` constants)."""
    return {tuple(tensor.shape) for variant in loaded.variants.values()
            for name, tensor in variant.runner.graph_module.named_buffers() if name.startswith("_packed_")}


def test_the_load_follows_the_plan_per_shape_and_the_forced_modes(core, tmp_path, monkeypatch):
    from ignition.runtime.backends import packed_linear
    from ignition.runtime.core import load_core

    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)  # the tiny core's weights are all calibrated
    monkeypatch.setenv("IGNITION_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(shape, dtype, paths, rows=gemm_calibration.CALIBRATION_ROWS):
        """Square weights stream fastest reordered for one row, up to 4x taller ones for eight, others on the
        blocked product where it is offered (on aten where not)."""
        calls.append(tuple(shape))
        assert set(paths) - {BLOCKED} == {P1, P8, ATEN} and tuple(rows) == (1,)  # the core's one decode capacity
        assert (BLOCKED in paths) is (blocked_linear.unavailable() is None)
        best = P1 if shape[0] == shape[1] else P8 if shape[0] < 4 * shape[1] else BLOCKED if BLOCKED in paths \
            else ATEN
        return {"1": {path: 1.0 if path == best else 2.0 for path in paths}}

    reorders = {}  # weight shape -> the rows its packed copy was reordered for
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda weight, rows: reorders.setdefault(tuple(weight.shape), rows) and reorder(weight, rows))
    monkeypatch.setattr(gemm_calibration, "time_paths", fake)
    calibrated = _packed_weights(load_core(core))
    shapes = set(calls)
    assert len(calls) == len(shapes) > 1  # each shape timed once
    tall = {shape for shape in shapes if shape[0] >= 4 * shape[1]}
    assert tall  # the LM head
    blocks = {shape for shape in calibrated if len(shape) == 3}  # a blocked copy: [ceil(N / 16), K, 16]
    plain = load_core(core, pack_linears=False).weights
    row_parallel = {(-(-w.shape[0] // 16), w.shape[1], 16) for name, w in plain.items()
                    if name.endswith(("o_proj", "down_proj"))}  # their leaves: blocked, untimed
    assert row_parallel and len(calls) == len(shapes)
    assert blocks == ({(-(-n // 16), k, 16) for n, k in tall} | row_parallel if blocked_linear.unavailable() is None
                      else set())
    assert calibrated - blocks == {shape for shape in shapes if shape[0] < 4 * shape[1]}
    assert calibrated and calibrated != shapes
    assert reorders == {shape: 1 if shape[0] == shape[1] else 8 for shape in calibrated - blocks}  # in its layout
    assert {1, 8} <= set(reorders.values())
    assert _packed_weights(load_core(core)) == calibrated and len(calls) == len(shapes)  # from the cache
    reorders.clear()
    assert _packed_weights(load_core(core, gemm=PACKED)) == shapes
    assert set(reorders.values()) == {FORCED_LAYOUT}
    assert _packed_weights(load_core(core, gemm=ATEN)) == set()
    assert len(calls) == len(shapes)


def test_every_shape_from_the_floor_up_is_timed_not_assumed(tmp_path, monkeypatch):
    """The size at which oneDNN's packed product pays is the machine's: from ``PACK_MIN_ELEMENTS`` up, each shape's
    path is what its timings say (a square 256 x 256, which one AMD EPYC ran faster on ``aten.linear``, packs where
    the packed product times faster); under it nothing is timed."""
    from ignition.runtime.backends import packed_linear

    side = int(packed_linear.PACK_MIN_ELEMENTS ** 0.5)
    calls = []
    monkeypatch.setattr(gemm_calibration, "time_paths", _timed({
        (side, side): {"1": {P8: 1e-5, ATEN: 2e-5}, "8": {P8: 1e-5, ATEN: 2e-5}},
        (2 * side, side): {"1": {P8: 3e-5, ATEN: 2e-5}, "8": {P8: 3e-5, ATEN: 2e-5}}}, calls))
    packs = packed_linear.LinearPacks(gemm=GemmPlan("calibrate", allowed=lambda dtype: True, cache=tmp_path / "c.json"))
    assert packs._packs((side, side), torch.float32) and not packs._packs((2 * side, side), torch.float32)
    assert not packs._packs((side - 1, side), torch.float32)  # under the floor: aten.linear, untimed
    assert calls == [(side, side), (2 * side, side)]
    assert packed_linear.PACK_MIN_ELEMENTS <= 1 << 16  # no floor above a few hundred KiB: those sizes are timed


def test_an_instruction_set_cap_or_another_blocked_build_is_another_machine(monkeypatch):
    plain = machine_key()
    build = f" | blocked {blocked_linear.build_id()}"
    assert plain.endswith(build)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert machine_key() == plain.removesuffix(build) + " | ONEDNN_MAX_CPU_ISA=AVX2 | MKL_ENABLE_INSTRUCTIONS=AVX2" + build
    monkeypatch.setattr(blocked_linear, "build_id", lambda: "another")  # the product's source or compiler changed
    assert machine_key().endswith(" | blocked another")


def test_two_cpus_of_one_model_name_are_two_machines():
    # a virtual machine names an AVX2 Zen 2 and an AVX-512 Zen 4 "AMD EPYC" alike: the instruction set tells them apart
    zen2 = "processor\t: 0\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\nstepping\t: 0\nflags\t\t: fma avx2\n"
    zen4 = zen2.replace("23", "25").replace("49", "17").replace("avx2", "avx2 avx512f avx512_bf16")
    assert cpu_model(zen2) == cpu_model(zen4) == "AMD EPYC"
    assert cpu_key(zen2) != cpu_key(zen4)
    assert cpu_key(zen2) != cpu_key(zen2.replace("fma avx2", "fma avx2 avx512f"))  # the flags alone differ
    assert cpu_key(zen2) == cpu_key(zen2.replace("fma avx2", "avx2 fma"))  # in another order, the same CPU
    assert cpu_key(zen2).startswith("AMD EPYC (23/49/0; flags ")
    assert machine_key().startswith(cpu_key() + " | ")


_EMULATED = """\
import json, sys, torch
from pathlib import Path
from ignition.runtime.backends.gemm_calibration import GemmPlan, machine_key, quiet
plan = GemmPlan("calibrate", cache=Path(sys.argv[1]))
choice = plan.packs((512, 512), torch.float32)
print(json.dumps([machine_key(), choice, plan.measured, quiet()]))
"""


def test_the_avx2_familys_kernels_calibrate_apart_on_a_wider_cpu(tmp_path):
    """Under oneDNN's and MKL's AVX2 cap (what an AVX2 server runs) a calibration times its own products and keeps
    them under its own key, beside this machine's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    caps = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    done = subprocess.run([sys.executable, "-c", _EMULATED, str(tmp_path / "c.json")], capture_output=True,
                          text=True, timeout=300, env=os.environ | caps | {"PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    key, choice, measured, quiet = json.loads(done.stdout.strip().splitlines()[-1])
    assert " | ONEDNN_MAX_CPU_ISA=AVX2 | MKL_ENABLE_INSTRUCTIONS=AVX2 | blocked " in key and key != machine_key()
    assert measured == ["float32 512x512 at rows 1,8"]
    if quiet:  # cached only where the host was quiet
        saved = json.loads((tmp_path / "c.json").read_text())["machines"]
        assert (saved[key]["float32 512x512 at rows 1,8"]["choice"] != ATEN) is choice
