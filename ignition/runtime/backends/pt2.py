"""The ``pt2`` backend: each variant's torch.export program, read once through the safe reader and Ignition's own
program reader (``validate/program_reader.py``: the graph without torch.export.load's FakeTensor and sympy
metadata), checked and moved to the device; on the CPU, its linears run on packed weights (``packed_linear.py``), its
BF16 and FP16 batched products on FP32 copies where that is faster (``batched_products.py``), its FP32 and BF16
decode attention on the KV pool in place (``paged_attention.py``), its cache writes (``cell_writes.py``) and its
FP32 and BF16 RMSNorm (``rms_norm.py``) in one call each, and its other ATen calls through torch's Python bindings
(``direct_calls.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import BufferDecl
from ignition.runtime.backends import batched_products, cell_writes, direct_calls, paged_attention, rms_norm
from ignition.runtime.backends.packed_linear import LinearPacks
from ignition.runtime.backends.protocol import Runner, graph_files
from ignition.runtime.device import CAPTURE_DEVICE, move_program
from ignition.runtime.verified import CoreLoadError
from ignition.validate.files import safe_path
from ignition.validate.geometry import check_graph_vocabulary
from ignition.validate.graphs import read_graph
from ignition.validate.program_reader import StaticProgram
from ignition.validate.parallel import check_program


class Pt2Backend:
    name = "pt2"
    capturable = True
    needs_reduction = True
    supports_ranks = True
    packs_linears = True
    aten_softmax = True
    windowed = True

    def __init__(self, root: Path, manifest: dict, catalog: dict, rank: int, device: torch.device,
                 packs: LinearPacks | None = None, *, spec: Manifest, native_kernels: bool = False):
        self.root, self.manifest, self.spec, self.device = root, manifest, spec, device
        self.packs = packs  # CPU: linear weights packed for oneDNN (LoadOptions.pack_linears)
        self.native_kernels = native_kernels  # CPU: LoadOptions.native_kernels
        self.graphs = graph_files(catalog, manifest, rank)
        self.sharded = spec.sharded
        self.programs: dict[str, StaticProgram] = {}  # variant name -> its program (what CUDA capture traces)

    @staticmethod
    def files(catalog: dict, manifest: dict, rank: int) -> set[str]:
        return set(graph_files(catalog, manifest, rank).values())

    def prepare(self, entry: dict, arguments: list[BufferDecl]) -> None:
        program = self.program(entry)
        if self.packs is not None:  # by the declarations: every packed weight is known before the weights arrive
            self.packs.rewrite(program, arguments)
            batched_products.rewrite(program.graph, self.packs.gemm)  # BF16 attention products, as timed here
        if self.device == CAPTURE_DEVICE:  # its Python code generated now, while the weights are still being read
            if self.native_kernels:
                paged_attention.rewrite(program.graph)  # decode attention reads the KV pool in place
                cell_writes.rewrite(program.graph)  # each layer's cache write one copy
                rms_norm.rewrite(program.graph)  # each FP32 or BF16 RMSNorm one call
            direct_calls.rewrite(program.graph)  # replayed op by op in Python: the cheaper calls
            program.graph_module  # noqa: B018 (built once; another device's is built as the program moves there)

    def program(self, entry: dict):
        """The variant's graph file (this rank's, for a sharded core): sha256 and the safe reader on the bytes that
        the program reader then reads, and the graph rules; a sharded core's graph also has its collectives checked.
        Read once: a prepared variant's program is the one kept."""
        if (known := self.programs.get(entry["name"])) is not None:
            return known
        rel = self.graphs[entry["name"]]
        graph_path, problems = safe_path(self.root, rel, f"variant {entry['name']}")
        if graph_path is None:  # validate_core already refused such a path; kept for a core changed since
            raise CoreLoadError(f"{self.root} is not a valid core:\n" + "\n".join(f"  {v}" for v in problems))
        found, program = read_graph(graph_path, entry, sha256=self.spec.files.get(rel))
        if not found and program is not None:
            found = check_graph_vocabulary(program, self.manifest, rel)
            if self.sharded:
                found += check_program(program, self.manifest, rel)
        if found or program is None:
            raise CoreLoadError(f"{self.root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
        self.programs[entry["name"]] = program
        return program

    def runner(self, entry: dict, arguments: list[BufferDecl], buffers: dict[str, torch.Tensor]) -> Runner:
        program = self.program(entry)
        try:
            program = move_program(program, self.device)
        except ValueError as exc:
            raise CoreLoadError(f"variant {entry['name']}: {exc}") from None
        return program.module()  # no per-call input checks: the loader checked the signature against the catalog
