"""The runtime's one backend seam: how a core's variants become runnable callables.

Three backends sit behind one small protocol (``protocol.Backend``): ``pt2`` (the torch.export
programs, the default), ``aoti`` (AOTInductor packages, CPU, trusted cores only; a variant without
a package runs its ``.pt2``), and ``onnx`` (onnxruntime over the ``--onnx`` graphs). ``load_core``
chooses once (``select_backend`` in ignition/runtime/backends/select.py); nothing else in the runtime asks
which backend it has.
"""

from __future__ import annotations

from ignition.runtime.backends.aoti import AotiBackend
from ignition.runtime.backends.onnx import OnnxBackend
from ignition.runtime.backends.protocol import RUNTIMES, Backend, Runner, graph_files
from ignition.runtime.backends.pt2 import Pt2Backend

FAMILIES = {"torch": Pt2Backend, "onnxruntime": OnnxBackend}
"""``--runtime`` -> its backend class (``torch`` may be refined to AotiBackend at load)."""
assert tuple(FAMILIES) == RUNTIMES


def backend_family(runtime: str) -> type:
    """The backend class a ``--runtime`` names (KeyError for a name outside RUNTIMES)."""
    return FAMILIES[runtime]


__all__ = ["Backend", "Runner", "RUNTIMES", "FAMILIES", "backend_family", "graph_files", "Pt2Backend",
           "AotiBackend", "OnnxBackend"]
