"""Device-neutral cores on the CPU: device choice, program moves, the launcher's tables, readback geometry.

What needs a GPU lives in test_cuda_replay.py (marker ``cuda``); everything that can be proven
without one is proven here.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ignition.catalog.contract import POINTER_DIVISIBILITY, SCRATCH_POINTERS
from ignition.catalog.manifest import Manifest
from ignition.catalog.model import BufferDecl
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.device import foreign_devices, move_program
from ignition.runtime.cuda_driver import resolve_device
from ignition.runtime.launchers.reduction import (LauncherError, ReductionShape, pack_params, reduction_shapes,
                                                 select_target)
from ignition.runtime.transfer import pitched_rows

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
META = torch.device("meta")


@pytest.fixture(scope="module")
def prepared_core(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "toy"
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), targets=("cuda:90",)), out)
    return out


def _programs(core: Path) -> dict:
    catalog = json.loads((core / "catalog.json").read_text())
    return {entry["name"]: (torch.export.load(core / entry["graph"]), entry) for entry in catalog["variants"]}


@NO_CUDA
def test_device_choice_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("spec", ["tpu", "gpu", "cuda:x", "", "mps"])
def test_unknown_devices_are_refused(spec):
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


@NO_CUDA
@pytest.mark.parametrize("device,message", [("cuda", "torch sees no CUDA device"), ("tpu", "unknown device")])
def test_cli_device_errors_are_clean(toy_core, device, message):
    result = CliRunner().invoke(app, ["run", str(toy_core), "--prompt-ids", "1,2", "--device", device])
    assert result.exit_code == 2  # a usage error (issue 24): exit 2, like every bad option
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("reader", ["torch.export.load", "program_reader"])
def test_programs_follow_their_inputs_device(toy_core, reader):
    """Moved (torch.export's pass for an ExportedProgram; for the programs load_core runs, validate/program_reader.py,
    every device argument retargeted and lifted constants moved), nothing is left on the capture device and every
    graph replays on another device (meta: shapes only)."""
    from ignition.validate.graphs import read_graph

    for name, (program, entry) in _programs(toy_core).items():
        if reader == "program_reader":
            found, program = read_graph(toy_core / entry["graph"], entry)
            assert found == [], name
        assert foreign_devices(program, META), f"{name}: the check must see the capture device"
        moved = move_program(program, META)
        assert foreign_devices(moved, META) == []
        buffers = {a["name"]: BufferDecl.from_json(a).empty(META) for a in entry["arguments"]}
        (tokens,) = moved.module()(buffers)
        assert tokens.device == META, name


def test_kernel_target_selection():
    assert select_target((9, 0), ["cuda:120", "cuda:90"]) == "cuda:90"
    assert select_target((12, 0), ["cuda:120", "cuda:90"]) == "cuda:120"
    with pytest.raises(LauncherError, match=r"compute capability 9\.0 \(kernel target cuda:90\).*cuda:120"):
        select_target((9, 0), ["cuda:120"], "cuda:0")
    with pytest.raises(LauncherError, match="exported without --targets"):
        select_target((9, 0), [])


def test_reduction_shapes_name_every_variants_launches(prepared_core):
    manifest = json.loads((prepared_core / "manifest.json").read_text())
    catalog = json.loads((prepared_core / "catalog.json").read_text())
    shapes = reduction_shapes(Manifest.from_json(manifest), catalog)
    assert set(shapes) == {ReductionShape(rows, 256, 250, 20, True, "float32") for rows in (1, 4)}
    table = json.loads((prepared_core / "kernels.json").read_text())
    keys = {entry["key"] for entry in table["kernels"]}
    for launches in shapes.values():
        assert [key.rsplit(".", 1)[0] for key in launches] == \
            ["logprobs.tile_stats", "logprobs.row_normalization", "logprobs.tile_candidates", "logprobs.merge"]
        assert set(launches) <= keys
    for variant in catalog["variants"]:
        variant["launches"] = []
    with pytest.raises(LauncherError, match="lists no prepared launches"):
        reduction_shapes(Manifest.from_json(manifest), catalog)


def test_launch_parameters_follow_the_signature(prepared_core):
    """Non-constexpr arguments in signature order, typed, then the null scratch pointers."""
    table = json.loads((prepared_core / "kernels.json").read_text())
    entry = next(e for e in table["kernels"] if e["name"] == "logprobs.merge")
    runtime = [p for p in entry["signature"] if p["type"] != "constexpr"]
    values = {p["name"]: (0x1000 + 16 * i if p["type"].startswith("*") else 7 + i) for i, p in enumerate(runtime)}
    array, holders = pack_params(entry["signature"], values)
    assert len(array) == len(runtime) + SCRATCH_POINTERS
    for i, param in enumerate(runtime):
        kind = ctypes.c_void_p if param["type"].startswith("*") else ctypes.c_int32
        assert kind.from_address(array[i]).value == values[param["name"]], param["name"]
    assert [ctypes.c_void_p.from_address(array[-1 - i]).value for i in range(SCRATCH_POINTERS)] == \
        [None] * SCRATCH_POINTERS


def test_prepared_binaries_record_and_enforce_pointer_divisibility(prepared_core):
    """Every pointer parameter was compiled with tt.divisibility=16 (as the JIT compiles an aligned call), the table
    says so, and packing refuses an address that breaks it before any launch."""
    table = json.loads((prepared_core / "kernels.json").read_text())
    for entry in table["kernels"]:
        for param in entry["signature"]:
            assert param.get("divisibility") == (POINTER_DIVISIBILITY if param["type"].startswith("*") else None), \
                (entry["name"], param)
    entry = next(e for e in table["kernels"] if e["name"] == "logprobs.merge")
    runtime = [p for p in entry["signature"] if p["type"] != "constexpr"]
    values = {p["name"]: (0x1000 + 16 * i if p["type"].startswith("*") else 7 + i) for i, p in enumerate(runtime)}
    pointer = next(p["name"] for p in runtime if p["type"].startswith("*"))
    with pytest.raises(LauncherError, match=rf"launch logprobs.merge: {pointer} = 0x1008 is not a multiple of 16"):
        pack_params(entry["signature"], values | {pointer: 0x1008}, "launch logprobs.merge")


class ContextDriver:
    """The driver's per-thread current context, and nothing else."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        import threading
        self.local, self.sets = threading.local(), 0

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        return (0,)

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return 0, ordinal

    def cuDevicePrimaryCtxRetain(self, device):  # noqa: N802
        return 0, 0xC0 + device

    def cuDevicePrimaryCtxRelease(self, device):  # noqa: N802
        return (0,)

    def cuCtxGetCurrent(self):  # noqa: N802
        return 0, getattr(self.local, "context", 0)

    def cuCtxSetCurrent(self, context):  # noqa: N802
        self.sets += 1
        self.local.context = context
        return (0,)


def test_the_primary_context_is_made_current_on_any_thread_and_the_previous_one_restored():
    import threading

    from ignition.runtime.cuda_driver import PrimaryContext

    driver = ContextDriver()
    context = PrimaryContext(torch.device("cpu"), driver)
    seen = {}

    def engine_thread():  # a thread that never touched the driver: no context at all
        previous = context.make_current()
        seen["during"] = driver.cuCtxGetCurrent()[1]
        context.restore(previous)
        seen["after"] = driver.cuCtxGetCurrent()[1]
        driver.local.context = 0xC7  # another device's context current here
        previous = context.make_current()
        seen["swapped"] = driver.cuCtxGetCurrent()[1]
        context.restore(previous)
        seen["restored"] = driver.cuCtxGetCurrent()[1]

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == {"during": 0xC0, "after": 0xC0, "swapped": 0xC0, "restored": 0xC7}
    sets = driver.sets
    driver.local.context = 0xC0
    assert context.make_current() is None and driver.sets == sets  # already current: one query, no switch


def _emulated_pitched_copy(host_base: torch.Tensor, host: torch.Tensor, source_base: torch.Tensor,
                           view: torch.Tensor) -> None:
    """What cuMemcpy2DAsync does with pitched_rows' geometry, on the raw bytes of the two base tensors."""
    rows, row_bytes, src_pitch = pitched_rows(view)
    _, _, dst_pitch = pitched_rows(host)
    src = source_base.view(torch.uint8).view(-1)
    dst = host_base.view(torch.uint8).view(-1)
    src_offset, dst_offset = view.storage_offset() * view.element_size(), host.storage_offset() * host.element_size()
    for row in range(rows):
        s, d = src_offset + row * src_pitch, dst_offset + row * dst_pitch
        dst[d:d + row_bytes] = src[s:s + row_bytes]


@pytest.mark.parametrize("frame,width", [(0, 2), (1, 12), (1, 258)])
def test_pitched_readback_geometry(frame, width):
    payload = torch.randint(-2**31, 2**31 - 1, (2, 4, 3, 258), dtype=torch.int32)  # [frames, cap, T, 258]
    host = torch.zeros(4, 3, 258, dtype=torch.int32)
    _emulated_pitched_copy(host, host[:, :, :width], payload, payload[frame, :, :, :width])
    assert torch.equal(host[:, :, :width], payload[frame, :, :, :width])
    assert not host[:, :, width:].any()  # nothing beyond W is copied


def test_pitched_rows_refuses_uneven_views():
    with pytest.raises(ValueError, match="unit-stride"):
        pitched_rows(torch.zeros(4, 6)[:, ::2])
    with pytest.raises(ValueError, match="not evenly spaced"):
        pitched_rows(torch.zeros(2, 4, 3, 8)[:, :2])


def test_serving_never_imports_triton(toy_core):
    """Load and generate with logprobs in a process where importing Triton fails."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        from ignition.runtime.core import load_core
        from ignition.runtime.engine import Engine
        from ignition.runtime.requests import Request
        engine = Engine(load_core({str(toy_core)!r}, device="cpu"))
        (result,) = engine.generate([Request(prompt_ids=[1, 2], max_tokens=4, logprobs=5)])
        assert result.error is None and len(result.entries) == 4, result
        assert all(len(entry.top) == 5 for entry in result.entries)
        assert not any(name.startswith("ignition.components.triton") for name in sys.modules)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_prepared_launcher_drives_the_kernels_exactly(prepared_core):
    """The launcher's real driver calls, run by an emulated driver in Triton's interpreter, write
    exactly the reference's words (both reduction shapes; int64, int32 and strided chosen ids)."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "_launcher_emulation.py"), str(prepared_core)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {f"rows{r}-{kind}" for r in (1, 4) for kind in ("int64", "int32", "strided")} | {"launches"}
    assert {case: problems for case, problems in results.items() if problems} == {}


def test_references_allocate_on_their_inputs_device():
    """The torch references (the reduction, and scoring, which CUDA runs until its kernels land) create
    every tensor on the logits' device: with factories defaulting to meta, CPU inputs give the same words."""
    from ignition.catalog.contract import PROMPT_ROW_WIDTH
    from ignition.components.logprobs import reduce_logprobs_reference
    from ignition.components.prompt_scoring import score_rows_reference

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40000, generator=g).to(torch.bfloat16)
    logits[1, :300] = 2.0  # ties at the top
    chosen = torch.tensor([0, 1, 2, 3, 4, 39999])
    requested = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int32)
    token_ids = torch.randint(-1, 40001, (6, 128), generator=g, dtype=torch.int32)
    counts = torch.tensor([0, 0, 0, 5, 128, 0], dtype=torch.int32)
    targets = torch.tensor([5, -1, 39999, 0, 7, 40000], dtype=torch.int32)
    rows, outs = torch.arange(6), []
    for default in (torch.device("cpu"), META):
        out = torch.zeros(6, 258, dtype=torch.int32)
        scores = torch.zeros(6, PROMPT_ROW_WIDTH, dtype=torch.int32)
        with default:
            reduce_logprobs_reference(logits, chosen, requested, out, rows, token_ids, counts, 39990, 20)
            score_rows_reference(logits, targets, scores, rows, 39990)
        outs.append((out, scores))
    assert outs[0][0].any() and outs[0][1].any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
