"""CUDA-graph capture failures stop the load (runtime/graphs.py), checked on CPU with a fake ``torch.cuda``.

torch can leave capture state behind after a failed capture (the stream still capturing, the caching allocator
still routing allocations into the graph's pool, the capture stream still current), so falling back to eager
replay would break later captures and ``empty_cache``: a failed capture raises ``CaptureError`` (a
``CoreLoadError``) suggesting ``--eager`` after undoing that state, and a program that fails its first eager
run names the variant and the cause. ``FakeCuda`` keeps exactly that state, as torch's C++ side does.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ignition.catalog.enums import Operation, Role
from ignition.catalog.model import BufferDecl
from ignition.runtime import graphs
from ignition.runtime.core import LoadedVariant
from ignition.runtime.graphs import CaptureError, GraphReplay, capture_variants
from ignition.runtime.verified import CoreLoadError

POOL = (0, 7)


class FakeGraph:
    """A CUDA graph whose capture_begin/capture_end change FakeCuda's state the way torch's C++ CUDAGraph does."""

    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.pool, self.replays, self.was_reset = cuda, None, 0, False

    def capture_begin(self, pool=None):
        self.cuda.capturing, self.pool = self.cuda.current, pool
        self.cuda.routing.add(pool)

    def capture_end(self):
        invalidated = self.cuda.invalidated
        self.cuda.capturing, self.cuda.invalidated = None, False
        if invalidated or self.cuda.end_raises:  # torch < 2.12 raises here before it stops routing to the pool
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.cuda.routing.discard(self.pool)

    def replay(self):
        self.replays += 1

    def reset(self):
        self.was_reset = True


class FakeCuda:
    """The slice of ``torch.cuda`` that ``capture_variants`` calls, with the state a capture leaves: the current
    stream, the stream being captured, and the pools the caching allocator routes allocations into."""

    def __init__(self, end_raises: bool = False):
        self.end_raises = end_raises
        self.default = SimpleNamespace(name="default", wait_stream=lambda other: None)
        self.current, self.capturing, self.invalidated = self.default, None, False
        self.routing: set = set()
        self.graphs: list[FakeGraph] = []

    def graph_pool_handle(self):
        return POOL

    def synchronize(self, device=None):
        pass

    def memory_reserved(self, device=None):
        return 0

    def empty_cache(self):
        if self.routing:
            raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED")

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        return SimpleNamespace(name="side", wait_stream=lambda other: None)

    def current_stream(self, device=None):
        return self.current

    def is_current_stream_capturing(self):
        return self.capturing is not None and self.capturing is self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def CUDAGraph(self):  # noqa: N802
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    def end_allocate_to_pool(self, device_index, pool):
        self.routing.remove(pool)  # KeyError when nothing routes there, as torch's TORCH_CHECK raises


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(**options) -> FakeCuda:
        fake = FakeCuda(**options)
        monkeypatch.setattr(graphs.torch, "cuda", fake)
        monkeypatch.setattr(graphs.torch._C, "_cuda_endAllocateToPool", fake.end_allocate_to_pool, raising=False)
        return fake
    return install


def _variant(run, name="decode.c2"):
    arguments = [BufferDecl("x", "float32", [2], Role.INPUT)]
    return LoadedVariant(name, Operation.DECODE, 2, arguments, {}, {}, run, {"x": torch.ones(2)})


def _program(*targets):
    return SimpleNamespace(graph=SimpleNamespace(nodes=[SimpleNamespace(target=t) for t in targets]))


def _raising_under_capture(fake: FakeCuda, seen: list):
    def run(buffers):
        seen.append("capture" if fake.capturing else "eager")
        if fake.capturing:
            fake.invalidated = True
            raise RuntimeError("operation not permitted when stream is capturing")
        return (buffers["x"] * 2,)
    return run


def test_a_failed_capture_stops_the_load_suggests_eager_and_leaves_no_capture_state(fake_cuda):
    fake = fake_cuda()
    seen = []
    variant = _variant(_raising_under_capture(fake, seen))
    original = variant.run
    with pytest.raises(CoreLoadError, match=r"decode\.c2: CUDA-graph capture failed .*stream is capturing.*--eager"
                       ) as caught:
        capture_variants({"decode.c2": variant}, {"decode.c2": _program()}, {}, torch.device("cpu"))
    assert isinstance(caught.value, CaptureError)
    assert variant.run is original and not isinstance(variant.run, GraphReplay)  # no replay, and no eager fallback
    assert seen == ["eager"] * graphs.WARMUP_RUNS + ["capture"]  # never run again after the failure
    assert fake.capturing is None and fake.current is fake.default  # capture ended, previous stream current again
    assert fake.routing == set() and fake.graphs[0].was_reset  # the allocator no longer routes into the pool
    fake.empty_cache()  # what a leftover capture would break


def test_a_capture_invalidated_at_its_end_is_cleaned_up_too(fake_cuda):
    """torch before 2.12 raises in capture_end without ending the pool routing: the load undoes it."""
    fake = fake_cuda(end_raises=True)
    variant = _variant(lambda buffers: (buffers["x"] * 2,))
    with pytest.raises(CaptureError, match=r"previous error during capture\); load with --eager"):
        capture_variants({"decode.c2": variant}, {"decode.c2": _program()}, {}, torch.device("cpu"))
    assert fake.capturing is None and fake.current is fake.default and fake.routing == set()
    fake.empty_cache()


def test_a_program_that_fails_its_first_eager_run_is_named(fake_cuda):
    fake_cuda()

    def broken(buffers):
        raise RuntimeError("Expected all tensors to be on the same device, but found cpu and cuda:0\nmore")
    with pytest.raises(CaptureError, match=r"decode\.c2 fails its first eager run on cpu: RuntimeError: Expected all "
                                           r"tensors to be on the same device, but found cpu and cuda:0$"):
        capture_variants({"decode.c2": _variant(broken)}, {"decode.c2": _program()}, {}, torch.device("cpu"))


def test_warm_up_zeroes_inputs_and_a_good_capture_replays(fake_cuda):
    fake = fake_cuda()
    seen = []
    variant = _variant(lambda buffers: seen.append(buffers["x"].clone()))
    state = {"k_cache": torch.ones(3)}
    report = capture_variants({"decode.c2": variant}, {"decode.c2": _program()}, state, torch.device("cpu"))
    assert report.captured == ["decode.c2"] and isinstance(variant.run, GraphReplay)
    assert len(seen) == graphs.WARMUP_RUNS + 1 and all(torch.equal(x, torch.zeros(2)) for x in seen)
    assert torch.equal(state["k_cache"], torch.zeros(3))  # warm-up writes are wiped
    assert fake.routing == set() and fake.current is fake.default
    variant.run(variant.buffers)
    assert fake.graphs[0].replays == 1


def test_an_uncapturable_variant_still_runs_once_on_the_device_and_is_reported(fake_cuda):
    fake_cuda()
    runs = []
    variant = _variant(lambda buffers: runs.append(1), name="scored.t16")
    report = capture_variants({"scored.t16": variant}, {"scored.t16": _program("ignition.score_prompt_rows.default")},
                              {}, torch.device("cpu"))
    assert report.captured == [] and "prompt scoring" in report.eager["scored.t16"]
    assert runs == [1] and not isinstance(variant.run, GraphReplay)
