"""The ``onnx`` backend: each variant's ``graphs/<variant>.onnx`` through onnxruntime (ignition.runtime.backends.onnx_sessions),
from bytes read once, hashed, and checked by every ONNX rule validate-core runs before onnxruntime parses them."""

from __future__ import annotations

from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import BufferDecl
from ignition.runtime.backends.protocol import Runner
from ignition.runtime.verified import CoreLoadError, read_verified
from ignition.validate.onnx_graphs import check_onnx_graph, check_pairing


class OnnxBackend:
    name = "onnx"
    capturable = False
    needs_reduction = False  # the ONNX graphs reduce in standard ops
    supports_ranks = False
    packs_linears = False
    aten_softmax = False
    windowed = False  # the ONNX graphs are re-traced static: full extents

    def __init__(self, root: Path, manifest: dict, catalog: dict, weights: dict[str, torch.Tensor],
                 offsets: dict[str, tuple[int, int]], device: torch.device, spec: Manifest):
        from ignition.runtime.backends.onnx_sessions import OnnxBackendError, OnnxRuntimeBackend

        if found := check_pairing(catalog["variants"]):
            raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
        self.root, self.manifest, self.spec, self.offsets = root, manifest, spec, offsets
        self.programs: dict = {}  # nothing to capture
        try:
            self.sessions = OnnxRuntimeBackend(root, weights, device)
        except OnnxBackendError as exc:
            raise CoreLoadError(f"{root}: {exc}") from None

    @staticmethod
    def files(catalog: dict, manifest: dict, rank: int) -> set[str]:
        return {v["packages"]["onnx"] for v in catalog["variants"] if "onnx" in v.get("packages", {})}

    def prepare(self, entry: dict, arguments: list[BufferDecl]) -> None:
        """Nothing ahead of the weights: each graph is checked against the weights' offsets as its runner is built."""

    def runner(self, entry: dict, arguments: list[BufferDecl], buffers: dict[str, torch.Tensor]) -> Runner:
        from ignition.runtime.backends.onnx_sessions import OnnxBackendError

        rel = entry.get("packages", {}).get("onnx")
        if rel is None:
            raise CoreLoadError(f"{self.root}: variant {entry['name']} has no ONNX graph: export the core with --onnx")
        data = bytes(read_verified(self.root, rel, self.spec.files))  # onnxruntime parses bytes (weights are external)
        found = check_onnx_graph(data, entry, self.spec.weights, self.offsets)
        if found:
            raise CoreLoadError(f"{self.root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
        try:
            return self.sessions.variant_run(entry, arguments, buffers, data)
        except OnnxBackendError as exc:
            raise CoreLoadError(f"{self.root}: {exc}") from None
