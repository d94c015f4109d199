"""CPU replay: each large weight a graph multiplies by (``aten.linear``) packed once for oneDNN.

NOTE: torch's CPU ``aten.linear`` calls MKL's ``sgemm`` for FP32, which runs far below the memory bound at decode's
few rows: ``[8, 1024] x [1024, 151936]`` (the Qwen3-0.6B LM head) read its weight at 5-6 GB/s on both AMD EPYC
machines this project has run on. oneDNN's matmul on a weight reordered once into its blocked layout
(``mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) is 1.3-6x faster at 1 to 32 rows
(``benchmarks.row_layouts``). It accumulates in FP32, as ``aten.linear`` does, so only the summation order changes
(logprobs within 3e-6 of the unpacked core's on that checkpoint). BF16's ``aten.linear`` already calls oneDNN, on the
plain layout; on the Zen 5 machine the blocked one is 1.1-2.4x faster (the LM head at one row: 8.7 ms against 21)
and returns the same bits, so BF16 weights are packed for oneDNN only where a probe finds those bits (``keeps_bits``,
per layout): how oneDNN accumulates a BF16 product it picked is not specified, while the blocked product's BF16 (an
FP32 sum rounded once) is, and is tested no further from the exact product than ``aten.linear``'s.

``LinearPacks.rewrite`` turns every ``aten.linear(x, w[, b])`` of a graph whose ``w`` is a weight argument of a
packed dtype with at least ``PACK_MIN_ELEMENTS`` elements into ``mkldnn._linear_pointwise(x, packed(w), b)``, the
packed copy a constant of the graph module. Each weight is packed once per load and shared by every variant. A
weight that, after every variant is rewritten, no graph reads in its raw form (every layer projection; not a tied
embedding, which the lookup still reads) has no raw copy after the load: the core's dict holds the packed tensor, so
the weights stay in memory once. The weights the first graph reads only packed are packed as the weights file is read,
from a reused scratch buffer (``runtime/weights.py``: their raw bytes never get memory of their own); any other
packed weight is packed from its raw copy once every graph is read, and that copy released (``finish``).
``LoadOptions.pack_linears`` makes the choice, at load, and ``LoadOptions.gemm`` which weights: each weight shape's
faster path on this machine, ``aten.linear``, the packed product in the layout oneDNN reorders for one or for eight
rows, or (FP32) the blocked product on a weight packed in blocks of 16 features (``blocked_linear``: a linear
rewritten onto it calls ``blocked_linear.graph_linear``, ``ignition::blocked_linear`` in a profile) (``gemm_calibration.GemmPlan``: timed once per CPU model and
cached), or one forced.
The same pass folds what a graph computes from weights alone
(views of them, the q/k norm scales' concatenation) into constants computed once (``weight_constants.py``).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import torch
from torch.fx import Node

from ignition.catalog.model import BufferDecl, Role
from ignition.runtime.backends import blocked_linear, gemm_calibration, row_leaves
from ignition.runtime.backends.gemm_calibration import ATEN, BLOCKED, CALIBRATE, FORCED_LAYOUT, PACK_LAYOUTS, GemmPlan
from ignition.runtime.backends.weight_constants import WeightConstants
from ignition.runtime.host_memory import release_pages
from ignition.runtime.weights import TensorEntry
from ignition.validate.program_reader import StaticProgram

PACK_MIN_ELEMENTS = 1 << 16
"""Smaller weights keep ``aten.linear`` untimed: a product over fewer than 64 Ki elements (256 KiB in FP32, inside
every L2) takes microseconds, near the timer's noise and oneDNN's extra call cost. From this size up the
choice is the machine's (``GemmPlan`` times each shape): where oneDNN's call overhead is won back depends on the CPU
(on one AMD EPYC, 512 x 256 at 8 rows took 26 us packed against 30 us, 256 x 256 21 against 15, the tiny example's
300 x 32 27 against 10)."""
PACKED_DTYPES = (torch.float32,)
"""Packed wherever oneDNN is: the summation order is the only change (FP32 tolerances)."""
BIT_EXACT_DTYPES = (torch.bfloat16,)
"""Packed for oneDNN only where its packed product returns ``aten.linear``'s bits (``keeps_bits``): its BF16
accumulation is not specified (the blocked product's is, ``blocked_linear``)."""
PACK_WORKERS = 2
"""Threads that pack at once (the reorders release the GIL; most of their time is faulting in the packed copies' fresh
pages, which two threads do side by side)."""
STREAM_MAX_BYTES = 256 << 20
"""A weight this large or smaller may be packed from scratch as the file is read (``LinearPacks.streams``); a larger
one is read into memory of its own, packed from there and released (the scratch buffers are this large at most)."""
PACKED_TARGET = "mkldnn._linear_pointwise.default"
"""What a rewritten linear calls (its profiler name is ``mkldnn::_linear_pointwise``)."""
_LINEAR = torch.ops.aten.linear.default
_POINTWISE = torch.ops.mkldnn._linear_pointwise.default


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PROBE_SHAPES = ((1, 1024, False), (8, 3072, False), (32, 2048, True))
"""(rows, in_features, with a bias) of ``keeps_bits``'s products, each against 512 outputs: decode's and prefill's
row counts, the projections' reduction lengths of a Qwen3-0.6B-sized layer, and a biased projection (Qwen2's q/k/v)."""


@cache
def keeps_bits(dtype: torch.dtype, layout: int = FORCED_LAYOUT) -> bool:
    """Whether oneDNN's product on a ``dtype`` weight packed for ``layout`` rows returns ``aten.linear``'s bits on
    this machine.

    Probed once a process on seeded normal values (``PROBE_SHAPES``): a kernel that sums in another order rounds
    some of the 20,992 outputs differently (FP32 products in three other orders, rounded to BF16, differed from
    ``aten.linear``'s BF16 in 10-15 of them), so a pass means the same summation order, and a fail keeps
    ``aten.linear``. A CPU whose oneDNN cannot pack ``dtype`` (no BF16 instructions) fails too."""
    generator = torch.Generator().manual_seed(0)
    try:
        for rows, width, biased in PROBE_SHAPES:
            weight = torch.randn(512, width, generator=generator).to(dtype)
            x = torch.randn(rows, width, generator=generator).to(dtype)
            bias = torch.randn(512, generator=generator).to(dtype) if biased else None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, layout)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
                               torch.nn.functional.linear(x, weight, bias)):
                return False
    except RuntimeError:  # "... path needs the cpu support ..."
        return False
    return True


def pack_layouts(dtype: torch.dtype) -> tuple[int, ...]:
    """The layouts (``gemm_calibration.PACK_LAYOUTS``) a ``dtype`` weight may be packed in on this machine: every one
    for ``PACKED_DTYPES``, those that ``keeps_bits`` for ``BIT_EXACT_DTYPES``, none for any other dtype."""
    if dtype in PACKED_DTYPES:
        return PACK_LAYOUTS
    if dtype in BIT_EXACT_DTYPES:
        return tuple(layout for layout in PACK_LAYOUTS if keeps_bits(dtype, layout))
    return ()


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are packed on this machine, in some layout (``pack_layouts``)."""
    return bool(pack_layouts(dtype))


class LinearPacks:
    """The packed copy of every weight the load's graphs use as a linear weight, shared across variants.

    NOTE: packing the 28-layer Qwen3-0.6B-shaped core's weights takes 1-2 s of CPU. ``rewrite`` runs on each graph
    as it is read, while the weights file is read on another thread (the catalog declares each argument's dtype and
    shape). The first rewritten graph says which weights it multiplies by and which it also reads raw; as the file's
    reader (``runtime/weights.read_tensors``) reaches each weight of a packed dtype and shape, it waits for that first
    graph if it has to: a weight it reads only packed is read into scratch and packed from there (``streams``, ``pack``:
    its raw bytes never get memory of their own); one it also reads raw (the tied embedding), or too large for
    scratch, is read into its own memory and packed from it at once (``read``). Once every graph is read, ``start``
    packs from its raw copy any weight that only a later graph multiplies by, and gives back the exact raw tensor
    (oneDNN's reorder undone: ``to_dense``) of a streamed weight that a later graph also reads raw; ``finish`` puts the
    packed tensors in the graphs' empty stand-ins and drops the raw copies no graph reads."""

    def __init__(self, min_elements: int | None = None, gemm: GemmPlan | None = None):
        self.gemm = GemmPlan() if gemm is None else gemm  # which weight shapes run packed on this machine
        self.min_elements = PACK_MIN_ELEMENTS if min_elements is None else min_elements
        self.attributes: dict[str, str] = {}  # weight name -> the graph attribute of its packed copy
        self.paths: dict[str, str] = {}  # weight name -> the path its graphs multiply by it on (``GemmPlan.path``)
        self.reorders: dict[str, Future] = {}  # weight name -> its reorder (as the file is read, or ``start``)
        self.streamed: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # packed from scratch: shape, dtype
        self.packed: dict[str, torch.Tensor] = {}  # filled by ``finish``
        self.raw_readers: set[str] = set()  # weights some rewritten graph still reads unpacked
        self.programs: list[tuple[StaticProgram, dict[str, str]]] = []  # each rewritten program: attribute -> weight
        self.constants = WeightConstants()  # the graphs' weight-only nodes, computed once
        self._first: tuple[frozenset[str], frozenset[str]] = frozenset(), frozenset()  # the first graph's (packed, raw)
        self._planned = threading.Event()  # set by the first ``rewrite`` or by ``decline``
        self._started = False
        self._worker = ThreadPoolExecutor(max_workers=PACK_WORKERS, thread_name_prefix="ignition-pack")

    def _packs(self, shape, dtype: torch.dtype) -> bool:
        """Whether a weight of this shape and dtype is packed where a graph multiplies by it (``GemmPlan.path``:
        decided once per shape, the first time a graph or the weights' reader asks)."""
        return self._path(shape, dtype) != ATEN

    def _path(self, shape, dtype: torch.dtype) -> str:
        """The path of a weight of this shape and dtype (``GemmPlan.path``): ``aten`` where it is not packed,
        ``packed@R`` (oneDNN's layout for R rows) or ``blocked`` (``blocked_linear``)."""
        if not self._may_pack(shape, dtype):
            return ATEN
        return self.gemm.path(shape, dtype, pack_layouts(dtype), blocked_linear.blocks(shape, dtype))

    def _may_pack(self, shape, dtype: torch.dtype) -> bool:
        """Whether a weight of this shape and dtype could be packed at all (nothing timed)."""
        return len(shape) == 2 and math.prod(shape) >= self.min_elements and self.gemm.mode != ATEN and \
            (packs_dtype(dtype) or blocked_linear.blocks(shape, dtype)) and self.gemm.allowed(dtype)

    def rewrite(self, program: StaticProgram, arguments: list[BufferDecl]) -> int:
        """Rewrite the linears of ``program``'s graph whose weight is a large weight argument of a packed dtype (by its
        declaration), before its graph module is built (one code generation) and before ``start``; returns how
        many. Records which weights it still reads unpacked."""
        if program.module_built:
            raise ValueError("packed linears rewrite a program's graph before its graph module is built")
        if self._started:
            raise ValueError("packed linears rewrite every graph before the packing starts")
        decls = {a.name: a for a in arguments if a.role is Role.WEIGHT}
        graph, root, names = program.graph, program.root, program.argument_names
        weight_of = {node: name for node, name in zip((n for n in graph.nodes if n.op == "placeholder"), names)
                     if name in decls}
        attributes: dict[str, str] = {}
        rewritten = 0
        def packed_weight(name: str) -> Node:  # ``finish`` sets the packed tensor
            attribute = self.attributes.setdefault(name, f"_packed_{len(self.attributes)}")
            if attribute not in attributes:
                root.register_buffer(attribute, torch.empty(0), persistent=False)
                attributes[attribute] = name
            return graph.get_attr(attribute)

        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is row_leaves.BMM:
                rewritten += row_leaves.rewrite_leaves(graph, node, weight_of, decls, self._claim_leaves,
                                                       packed_weight)
                continue
            if node.target is not _LINEAR or node.args[1] not in weight_of:
                continue
            name = weight_of[node.args[1]]
            path = self._path(decls[name].shape, decls[name].torch_dtype)
            if path == ATEN or self.paths.setdefault(name, path) != path:  # one pack a weight
                continue
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with graph.inserting_before(node):
                weight = packed_weight(name)
                if path == BLOCKED:
                    out_features = decls[name].shape[0]
                    call = graph.call_function(blocked_linear.graph_linear, (node.args[0], weight, bias, out_features))
                else:
                    call = graph.call_function(_POINTWISE, (node.args[0], weight, bias, "none", [], ""))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            rewritten += 1
        raw_here = {name for node, name in weight_of.items() if node.users}  # folded nodes read them raw too
        self.raw_readers |= raw_here
        if not self._planned.is_set():  # the first graph: what the reader packs as it reads (``streams``, ``read``)
            self._first = frozenset(attributes.values()), frozenset(raw_here)
            self._planned.set()
        if attributes:
            self.programs.append((program, attributes))
        self.constants.rewrite(program, weight_of, decls)
        return rewritten

    def _claim_leaves(self, name: str, dtype: torch.dtype) -> bool:
        """Whether weight ``name``'s row-parallel leaves run on the blocked product (``row_leaves``): FP32 (the only
        dtype ``row_linear`` splits), the product built here, the mode ``calibrate`` or ``blocked``, and no other path
        taken by the weight; recorded as its path."""
        return dtype == torch.float32 and blocked_linear.blocks_dtype(dtype) and \
            self.gemm.mode in (CALIBRATE, BLOCKED) and self.gemm.allowed(dtype) and \
            self.paths.setdefault(name, BLOCKED) == BLOCKED

    def decline(self) -> None:
        """No graph will say which weights to pack (the backend packs nothing, or the graphs stopped): a weight the
        reader waits for, and every later one, is read raw. Nothing once the first graph has said it."""
        self._planned.set()

    def _first_packs(self, entry: TensorEntry) -> tuple[bool, bool] | None:
        """(whether the first graph packs ``entry``, whether it reads it raw) once it is rewritten; None, without
        waiting, for a weight of a dtype or shape that is never packed."""
        if not self._may_pack(entry.shape, entry.dtype):  # the first graph's rewrite timed what it packs
            return None
        self._planned.wait()
        packed, raw = self._first
        return entry.name in packed, entry.name in raw

    def streams(self, entry: TensorEntry) -> bool:
        """Whether the weights' reader packs ``entry`` from scratch: at most ``STREAM_MAX_BYTES``, and the first graph
        reads it only packed (waits for that graph)."""
        if entry.nbytes > STREAM_MAX_BYTES:
            return False
        return self._first_packs(entry) == (True, False)

    def pack(self, entry: TensorEntry, tensor: torch.Tensor) -> Future:
        """Pack ``tensor``, scratch read until the future is done, on the worker threads."""
        self.streamed[entry.name] = tuple(entry.shape), entry.dtype
        future = self.reorders[entry.name] = self._worker.submit(self._pack, entry.name, tensor, False)
        return future

    def read(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        """A weight read into memory of its own: packed from there at once if the first graph packs it."""
        first = self._first_packs(entry)
        if first is not None and first[0]:
            self.reorders[entry.name] = self._worker.submit(self._pack, entry.name, tensor, False)

    def streamed_weights(self) -> dict[str, torch.Tensor]:
        """The packed tensor of every streamed weight, once each is packed: what the core's weights dict holds."""
        return {name: self.reorders[name].result() for name in self.streamed}

    def streamed_as_read(self) -> dict[str, torch.Tensor]:
        """Each streamed weight as the file held it, shape and dtype only (meta tensors): what the load checks
        against the catalog's declarations (a blocked pack is ``[ceil(N / 16), K, 16]``)."""
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in self.streamed.items()}

    def start(self, weights: dict[str, torch.Tensor]) -> None:
        """After every graph is rewritten: a streamed weight that a graph read after the first reads raw gets its
        exact raw tensor back in ``weights`` (the reorder undone); each weight some graph multiplies by and the reader
        did not pack is packed on the worker threads, its raw copy released as soon as its pack exists if no graph
        reads it."""
        self._started = True
        for name in self.streamed.keys() & self.raw_readers:
            weights[name] = self._unpack(name)
        for name in self.attributes:
            if name not in self.reorders:
                self.reorders[name] = self._worker.submit(self._pack, name, weights[name],
                                                          name not in self.raw_readers)

    def _unpack(self, name: str) -> torch.Tensor:
        """The exact raw tensor of streamed weight ``name`` from its packed one (oneDNN's reorder or the blocks
        undone)."""
        shape, dtype = self.streamed[name]
        packed = self.reorders[name].result()
        return blocked_linear.unpack(packed, shape[0]) if self.paths[name] == BLOCKED else packed.to_dense()

    def _pack(self, name: str, weight: torch.Tensor, release: bool) -> torch.Tensor:
        packed = gemm_calibration.pack(self.paths[name], weight)
        if release:  # nothing reads it until ``finish`` swaps the packed tensor in
            release_pages(weight)
        return packed

    def finish(self, weights: dict[str, torch.Tensor], variants) -> list[str]:
        """After ``start`` and every variant bound: wait for the packs and give each graph module its packed weights
        (the CPU backend generated each graph's code as it prepared it, while the weights were read); then each
        packed weight no graph reads raw is replaced, in ``weights`` and in every variant's buffers, by its packed
        tensor (an unused placeholder's argument), and its raw copy, if it had one, dropped. Returns their names."""
        self.packed = {name: self.reorders[name].result() for name in self.attributes}
        self._worker.shutdown()
        for program, attributes in self.programs:
            for attribute, name in attributes.items():
                setattr(program.graph_module, attribute, self.packed[name])
        self.constants.finish(weights)  # from the raw weights they read, before any raw weight is replaced
        released = [name for name in self.packed if name not in self.raw_readers]
        for name in released:
            weights[name] = self.packed[name]
            for variant in variants:
                if name in variant.buffers:
                    variant.buffers[name] = self.packed[name]
        return released


__all__ = ["BIT_EXACT_DTYPES", "LinearPacks", "PACK_MIN_ELEMENTS", "PACKED_DTYPES", "PACKED_TARGET", "STREAM_MAX_BYTES",
           "keeps_bits", "pack_layouts", "packing_available", "packs_dtype"]
