"""The backend protocol (ignition/runtime/backends/__init__.py says what the seam is).

The runtime's one backend seam: how a core's variants become runnable callables.

Three backends sit behind one small protocol (``Backend``): ``pt2`` (the torch.export programs, the
default), ``aoti`` (AOTInductor packages, CPU, trusted cores only; a variant without a package
runs its ``.pt2``), and ``onnx`` (onnxruntime over the ``--onnx`` graphs). ``load_core`` chooses
once, with ``select_backend``; nothing else in the runtime asks which backend it has.

A backend answers: the files it reads (and so hashes) at load, a runner for each catalog entry,
whether its runners can be captured as CUDA graphs (and the programs a capture traces), whether its graphs
call the prepared vocabulary reduction on CUDA, whether it replays tensor-parallel rank shards, whether its
runners read CPU-packed linear weights, and whether they take inputs narrowed to a window's extent. Code
outside the backends asks these, never a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch

from ignition.catalog.model import BufferDecl

Runner = Callable[[dict[str, torch.Tensor]], object]
"""A variant's replay: called with its buffers (by name), updates outputs and state in place."""


class Backend(Protocol):
    name: ClassVar[str]
    capturable: ClassVar[bool]  # its runners may be captured as CUDA graphs
    needs_reduction: ClassVar[bool]  # its graphs call ignition::reduce_logprobs, which CUDA serves with prepared kernels
    supports_ranks: ClassVar[bool]  # it replays the rank shards of a tensor-parallel core
    packs_linears: ClassVar[bool]  # its runners read linear weights packed for the CPU (packed_linear.LinearPacks)
    aten_softmax: ClassVar[bool]  # on the CPU its graphs' softmax is ATen's (catalog/softmax_order.py)
    windowed: ClassVar[bool]  # its runners take windowed inputs narrowed to the submission's extent (bindings.Windowed)
    programs: dict[str, object]  # variant name -> the program a CUDA capture traces (empty where not capturable)

    @staticmethod
    def files(catalog: dict, manifest: dict, rank: int) -> set[str]:
        """The graph files this backend reads at load (their sha256 is checked as they are read)."""

    def prepare(self, entry: dict, arguments: list[BufferDecl]) -> None:
        """Read and check catalog entry ``entry``'s graph (``arguments``: its declared arguments) before the weights
        are in memory (``load_core`` runs this while a worker thread reads the weights); CoreLoadError when it is
        not valid. May do nothing."""

    def runner(self, entry: dict, arguments: list[BufferDecl], buffers: dict[str, torch.Tensor]) -> Runner:
        """The replay of catalog entry ``entry`` over ``buffers``; CoreLoadError when it cannot be made."""


RUNTIMES = ("torch", "onnxruntime")
"""``--runtime`` choices: the torch.export programs (or their AOTInductor packages), or the ONNX graphs."""


def graph_files(catalog: dict, manifest: dict, rank: int) -> dict[str, str]:
    """Variant name -> the ``.pt2`` file this rank loads (a sharded core's rank files replace the catalog's)."""
    from ignition.validate.parallel import rank_graph_files
    return {v["name"]: v["graph"] for v in catalog["variants"]} | rank_graph_files(manifest, rank)


__all__ = ["Backend", "Runner", "RUNTIMES", "graph_files"]
