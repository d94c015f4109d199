"""load_core reads each file it loads once and loads the bytes it hashed; the tensor-parallel runtime refusal.

Weights and graphs: the validator leaves their sha256 to the loader (``hashed_by_caller``), which hashes
the bytes it read and deserializes those same bytes, so a file swapped after the check changes nothing.
A compiled package needs a path: it is loaded from a private copy of the verified bytes.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ignition.cli import app
from ignition.runtime.load_stages import LOAD_SWITCH_INTERVAL
from ignition.runtime import core as core_module
from ignition.runtime.core import CoreLoadError, load_core
from ignition.runtime.parallel.group import ParallelOptionError, tensor_parallel

REFUSAL = ("--runtime onnxruntime replays single-rank cores only, so it cannot run --tensor-parallel 2; "
           "tensor parallelism is supported with --runtime torch (gloo on CPU, NCCL on CUDA)")

_OPENED: list[str] | None = None


def _audit(event: str, args) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only while _OPENED is a list


def test_load_core_opens_weights_and_each_graph_once(toy_core):
    global _OPENED
    _OPENED = []
    try:
        loaded = load_core(toy_core)
    finally:
        opened, _OPENED = _OPENED, None
    files = ["weights.safetensors"] + [f"graphs/{name}.pt2" for name in loaded.variants]
    assert {rel: opened.count(str(toy_core / rel)) for rel in files} == {rel: 1 for rel in files}, opened


def test_weights_swapped_after_their_check_are_not_the_ones_loaded(core_copy, monkeypatch):
    original = load_file(str(core_copy.root / "weights.safetensors"))
    check = core_module.check_loaded_weights

    def swap_then_check(*args):  # after the read and its hash, before anything uses the weights
        save_file({name: torch.zeros_like(t) for name, t in original.items()}, str(core_copy.root / "weights.safetensors"))
        return check(*args)

    monkeypatch.setattr(core_module, "check_loaded_weights", swap_then_check)
    loaded = load_core(core_copy.root)
    assert not torch.equal(load_file(str(core_copy.root / "weights.safetensors"))["lm_head.weight"],
                           original["lm_head.weight"])  # the swap happened
    assert all(torch.equal(loaded.weights[name], tensor) for name, tensor in original.items())


def test_weights_are_read_on_a_worker_thread_while_the_graphs_are_read(toy_core, monkeypatch):
    """The weights' read and hash overlap the graph reads: the worker is still reading when the first graph is read."""
    import threading

    import ignition.validate.graphs as graphs

    started, release, events = threading.Event(), threading.Event(), []
    read_weights, read_program = core_module._read_weights, graphs.read_program

    def slow_weights(*args):
        events.append(("weights", threading.current_thread() is threading.main_thread()))
        started.set()
        assert release.wait(30), "no graph was read while the weights were being read"
        return read_weights(*args)

    def graph_then_release(*args):
        assert started.wait(30)
        events.append(("graph", threading.current_thread() is threading.main_thread()))
        release.set()
        return read_program(*args)

    monkeypatch.setattr(core_module, "_read_weights", slow_weights)
    monkeypatch.setattr(graphs, "read_program", graph_then_release)
    loaded = load_core(toy_core)
    assert events[:2] == [("weights", False), ("graph", True)]
    assert loaded.variants and loaded.weights


def test_a_graph_refused_while_the_weights_are_read_is_reported_after_the_read_ends(toy_core, monkeypatch):
    import threading

    import ignition.validate.graphs as graphs

    finished = threading.Event()
    read_weights = core_module._read_weights
    monkeypatch.setattr(core_module, "_read_weights", lambda *args: (read_weights(*args), finished.set())[0])
    monkeypatch.setattr(graphs, "read_program", lambda *args: (_ for _ in ()).throw(CoreLoadError("graph refused")))
    with pytest.raises(CoreLoadError, match="graph refused"):
        load_core(toy_core)
    assert finished.is_set()  # no worker left reading the weights behind the error


def test_tampered_weights_are_refused_by_the_loader_hash(core_copy):
    path = core_copy.root / "weights.safetensors"
    save_file({name: t + 1 for name, t in load_file(str(path)).items()}, str(path))
    with pytest.raises(CoreLoadError, match=r"\[FILE-HASH\] weights\.safetensors: expected sha256 [0-9a-f]{64}, found"):
        load_core(core_copy.root)


def test_a_compiled_package_loads_from_a_private_copy_of_its_verified_bytes(core_copy, monkeypatch):
    """The package is swapped in the core after its hash was checked: the loader still gets the verified bytes."""
    verified = b"the verified package bytes"
    package = core_copy.root / "graphs" / "decode.c1.aoti.pt2"
    package.write_bytes(verified)
    core_copy.rehash("graphs/decode.c1.aoti.pt2")
    core_copy.edit("catalog.json", lambda catalog: core_copy.variant(catalog, "decode.c1").update(
        packages={"inductor": "graphs/decode.c1.aoti.pt2"}))
    core_copy.rehash("catalog.json")
    seen = {}

    def fake_load_compiled(path: Path):
        package.write_bytes(b"swapped in after the check")
        seen.update(path=path, data=path.read_bytes(), file_mode=stat.S_IMODE(path.stat().st_mode),
                    dir_mode=stat.S_IMODE(path.parent.stat().st_mode))
        return lambda buffers: ("compiled",)

    from ignition.runtime.backends import aoti
    monkeypatch.setattr(aoti, "load_package", fake_load_compiled)
    loaded = load_core(core_copy.root, trust_compiled=True)
    assert seen["data"] == verified and package.read_bytes() != verified
    assert not seen["path"].is_relative_to(core_copy.root)
    assert (seen["file_mode"], seen["dir_mode"]) == (0o600, 0o700)
    assert not seen["path"].parent.exists()  # the private copy is gone once loaded
    assert loaded.variants["decode.c1"].run({}) == ("compiled",)


def test_tensor_parallel_with_onnxruntime_is_refused_once_by_every_path(toy_core):
    with pytest.raises(ParallelOptionError) as refused:
        with tensor_parallel(toy_core, 2, runtime="onnxruntime"):
            pass
    assert str(refused.value) == REFUSAL
    with pytest.raises(CoreLoadError) as load_refused:
        load_core(toy_core, runtime="onnxruntime", tensor_parallel=2)
    assert str(load_refused.value) == REFUSAL  # LoadOptions refuses it before the core is read
    result = CliRunner().invoke(app, ["run", str(toy_core), "--prompt-ids", "1", "--runtime", "onnxruntime",
                                      "--tensor-parallel", "2"])
    assert result.exit_code == 2, result.output
    assert f"error: {REFUSAL}" in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("collecting", [True, False])
def test_a_load_pauses_the_collector_and_shortens_the_switch_interval_and_restores_both(toy_core, collecting):
    import gc

    seen = []
    was_enabled, interval = gc.isenabled(), sys.getswitchinterval()
    (gc.enable if collecting else gc.disable)()
    try:
        load_core(toy_core, progress=lambda stage, item: seen.append((stage, gc.isenabled(), sys.getswitchinterval())))
        assert gc.isenabled() is collecting and sys.getswitchinterval() == interval
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert seen and not any(enabled for _, enabled, _ in seen)
    assert all(s <= LOAD_SWITCH_INTERVAL for stage, _, s in seen if stage == "graphs")


def test_the_load_passes_its_file_cache_choice_to_the_weights_reader(toy_core, monkeypatch):
    seen = []
    real = core_module.read_verified_weights
    monkeypatch.setattr(core_module, "read_verified_weights",
                        lambda *args: (seen.append(args[-1]), real(*args))[1])
    load_core(toy_core)
    load_core(toy_core, drop_file_cache=False)
    assert seen == [True, False]


def test_run_takes_the_file_cache_choice_from_the_command_line(toy_core, monkeypatch):
    from typer.testing import CliRunner

    import ignition.cli as cli
    from ignition.cli import loading

    seen = []
    real_load = loading.load
    monkeypatch.setattr(loading, "load", lambda core, options: seen.append(options) or real_load(core, options))
    for flag in ("--keep-file-cache", "--drop-file-cache"):
        result = CliRunner().invoke(cli.app, ["run", str(toy_core), "--prompt-ids", "1,2", "--max-tokens", "1",
                                              "--device", "cpu", flag])
        assert result.exit_code == 0, result.output
    assert [options.drop_file_cache for options in seen] == [False, True]
