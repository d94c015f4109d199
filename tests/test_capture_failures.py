"""CUDA-graph capture failures stop the load (runtime/graphs.py), checked on CPU with a fake ``torch.cuda``.

torch can leave capture state behind after a failed capture, so falling back to eager replay would
break later captures and ``empty_cache``: a failed capture raises ``CaptureError`` suggesting
``--eager``, and a program that fails its first eager run names the variant and the cause.
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


class FakeCuda:
    """The slice of ``torch.cuda`` that ``capture_variants`` calls; ``capture`` runs the body or raises."""

    def __init__(self, capture_raises: bool):
        self.capture_raises, self.graphs = capture_raises, []

    def graph_pool_handle(self):
        return object()

    def synchronize(self, device=None):
        pass

    def memory_reserved(self, device=None):
        return 0

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        return SimpleNamespace(wait_stream=lambda other: None)

    def current_stream(self, device=None):
        return SimpleNamespace(wait_stream=lambda other: None)

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    def CUDAGraph(self):  # noqa: N802
        graph = SimpleNamespace(replay=lambda: None)
        self.graphs.append(graph)
        return graph

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        if self.capture_raises:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield


def _variant(run):
    arguments = [BufferDecl("x", "float32", [2], Role.INPUT)]
    return LoadedVariant("decode.c2", Operation.DECODE, 2, arguments, {}, {}, run, {"x": torch.ones(2)})


def _program():
    return SimpleNamespace(graph=SimpleNamespace(nodes=[]))


def test_a_failed_capture_stops_the_load_and_suggests_eager(monkeypatch):
    monkeypatch.setattr(graphs.torch, "cuda", FakeCuda(capture_raises=True))
    variant = _variant(lambda buffers: (buffers["x"] * 2,))
    with pytest.raises(CaptureError, match=r"decode\.c2: CUDA-graph capture failed .*stream is capturing.*--eager"):
        capture_variants({"decode.c2": variant}, {"decode.c2": _program()}, {}, torch.device("cpu"))
    assert not isinstance(variant.run, GraphReplay)  # never swapped for a half-made replay


def test_a_program_that_fails_its_first_eager_run_is_named(monkeypatch):
    monkeypatch.setattr(graphs.torch, "cuda", FakeCuda(capture_raises=False))

    def broken(buffers):
        raise RuntimeError("Expected all tensors to be on the same device, but found cpu and cuda:0\nmore")
    with pytest.raises(CaptureError, match=r"decode\.c2 fails its first eager run on cpu: RuntimeError: Expected all "
                                           r"tensors to be on the same device, but found cpu and cuda:0$"):
        capture_variants({"decode.c2": _variant(broken)}, {"decode.c2": _program()}, {}, torch.device("cpu"))


def test_warm_up_zeroes_inputs_and_a_good_capture_replays(monkeypatch):
    fake = FakeCuda(capture_raises=False)
    monkeypatch.setattr(graphs.torch, "cuda", fake)
    seen = []
    variant = _variant(lambda buffers: seen.append(buffers["x"].clone()))
    state = {"k_cache": torch.ones(3)}
    report = capture_variants({"decode.c2": variant}, {"decode.c2": _program()}, state, torch.device("cpu"))
    assert report.captured == ["decode.c2"] and isinstance(variant.run, GraphReplay)
    assert len(seen) == graphs.WARMUP_RUNS + 1 and all(torch.equal(x, torch.zeros(2)) for x in seen)
    assert torch.equal(state["k_cache"], torch.zeros(3))  # warm-up writes are wiped
