"""Cores replayed on CUDA with the prepared kernels (marker ``cuda``; skipped without a GPU).

CUDA vs CPU replay and CUDA-graph replay vs eager (same ids and order, values within 2e-5: eager narrows the
windows the graphs replay at full extent), no compilation during replay, prompt scoring on CUDA, and a core refused
for lacking the device's architecture.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import CoreLoadError, load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request

pytestmark = pytest.mark.cuda
TOL = 2e-5
OTHER_TARGETS = {"cuda:90": "cuda:120", "cuda:120": "cuda:90"}


def _device_target() -> str:
    from ignition.runtime.launchers.reduction import target_name

    return target_name(torch.cuda.get_device_capability())


@pytest.fixture(scope="module")
def cores(tmp_path_factory) -> dict[str, Path]:
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("cuda-cores")
    target = _device_target()
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), targets=(target,)), root / "toy")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 300), root / "ckpt")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4, 8), chunk_limit=200,
                              max_seq_len=512, prompt_logprobs=True, targets=(target,)), root / "qwen3")
    return {"toy": root / "toy", "qwen3": root / "qwen3"}


def _requests(vocab: int) -> list[Request]:
    prompts = [[1, 2, 3], [7] * 20, list(range(5, 70)), [11, 13]]
    return [Request(prompt_ids=p, max_tokens=12, logprobs=5, ignore_eos=True) for p in prompts[:3]] + \
        [Request(prompt_ids=prompts[3], max_tokens=12, logprob_token_ids=[0, vocab - 1, 5, 3], ignore_eos=True)]


def _generate(core: Path, device: str, eager: bool = False):
    loaded = load_core(core, device=device, eager=eager)
    return loaded, Engine(loaded).generate(_requests(loaded.vocab_size))


def _assert_same(cuda_results, cpu_results):
    for cuda, cpu in zip(cuda_results, cpu_results):
        assert cuda.error is None and cpu.error is None
        assert cuda.token_ids == cpu.token_ids
        for a, b in zip(cuda.entries, cpu.entries):
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert abs(a.logprob - b.logprob) <= TOL
            assert max((abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)), default=0.0) <= TOL


@pytest.mark.parametrize("name", ["toy", "qwen3"])
def test_cuda_replay_matches_cpu_replay(cores, name):
    loaded, cuda = _generate(cores[name], "cuda")
    _, cpu = _generate(cores[name], "cpu")
    _assert_same(cuda, cpu)
    assert loaded.reduction is not None and loaded.reduction.launch_count > 0  # the prepared cubins ran
    assert loaded.capture is not None and loaded.capture.captured
    report = loaded.memory_report()
    assert report["capture_pool_bytes"] >= 0 and report["device_reserved_bytes"] >= report["device_allocated_bytes"]


@pytest.mark.parametrize("name", ["toy", "qwen3"])
def test_graph_replay_matches_eager(cores, name):
    """Captured graphs replay at their full window extents, eager runs narrow the windows to the live context: the
    products differ in shape, so their FP32 sums may round apart. Same ids and order, values within 2e-5."""
    _, graphs = _generate(cores[name], "cuda")
    _, eager = _generate(cores[name], "cuda", eager=True)
    _assert_same(graphs, eager)


def test_nothing_compiles_during_cuda_replay(cores):
    """Triton cannot even be imported: the reduction can only be the core's prepared cubins."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None
        from ignition.runtime.core import load_core
        from ignition.runtime.engine import Engine
        from ignition.runtime.requests import Request
        loaded = load_core({str(cores["qwen3"])!r}, device="cuda")
        (result,) = Engine(loaded).generate([Request(prompt_ids=[1, 2, 3], max_tokens=8, logprobs=20)])
        assert result.error is None and len(result.entries) == 8, result
        assert loaded.reduction.launch_count > 0
        assert not any(name.startswith("triton") for name in sys.modules if sys.modules[name] is not None)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_prompt_scoring_on_cuda(cores):
    prompt = list(range(3, 250))
    results = {}
    for device in ("cuda", "cpu"):
        loaded = load_core(cores["qwen3"], device=device)
        (results[device],) = Engine(loaded).generate([Request(prompt_ids=prompt, max_tokens=2, prompt_logprobs=5)])
    cuda, cpu = results["cuda"].prompt_entries, results["cpu"].prompt_entries
    assert len(cuda) == len(cpu) == len(prompt) and cuda[0] is None
    for a, b in zip(cuda[1:], cpu[1:]):
        assert a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) <= TOL
        assert abs(a["rank"] - b["rank"]) <= 1  # near-ties within TOL may swap
        assert [t["id"] for t in a["top_logprobs"]][:1] == [t["id"] for t in b["top_logprobs"]][:1]


def test_core_without_the_devices_architecture_is_refused(tmp_path):
    target = _device_target()
    other = OTHER_TARGETS.get(target, "cuda:120")
    export_core(ExportOptions(recipe="toy", capacities=(1,), targets=(other,)), tmp_path / "core")
    major, minor = torch.cuda.get_device_capability()
    with pytest.raises(CoreLoadError, match=rf"compute capability {major}\.{minor} .*{other}"):
        load_core(tmp_path / "core", device="cuda")


def test_core_without_prepared_kernels_is_refused(toy_core):
    with pytest.raises(CoreLoadError, match="exported without --targets"):
        load_core(toy_core, device="cuda")


def test_two_cores_on_one_gpu_keep_their_own_kernels(cores, toy_core_no_logprobs):
    """Each core's eager variants launch its own prepared kernels, whatever was loaded after it (a core without
    logprobs included): the launcher is bound per core, not one slot per device."""
    big = load_core(cores["qwen3"], device="cuda", eager=True)
    small = load_core(cores["toy"], device="cuda", eager=True)
    plain = load_core(toy_core_no_logprobs, device="cuda", eager=True)
    assert plain.reduction is None
    for loaded, name in ((big, "qwen3"), (small, "toy"), (big, "qwen3")):
        before = loaded.reduction.launch_count
        _assert_same(Engine(loaded).generate(_requests(loaded.vocab_size)), _generate(cores[name], "cpu")[1])
        assert loaded.reduction.launch_count > before
    (result,) = Engine(plain).generate([Request(prompt_ids=[1, 2], max_tokens=4)])
    assert result.error is None and len(result.token_ids) == 4


def test_an_engine_thread_launches_and_reads_back(cores):
    """The engine's own thread (no CUDA context of its own until something binds one) drives prepared launches
    and the pitched readback."""
    import threading

    loaded = load_core(cores["qwen3"], device="cuda", eager=True)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("results", Engine(loaded).generate(
        _requests(loaded.vocab_size))), name="engine")
    thread.start()
    thread.join()
    _assert_same(out["results"], _generate(cores["qwen3"], "cpu")[1])
