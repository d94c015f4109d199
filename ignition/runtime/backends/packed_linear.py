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
from ignition.runtime.backends import blocked_linear
from ignition.runtime.backends import gemm_calibration
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
_BMM, _EXPAND = torch.ops.aten.bmm.default, torch.ops.aten.expand.default
_TRANSPOSE, _PERMUTE = torch.ops.aten.transpose.int, torch.ops.aten.permute.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
_SLICE, _ADD, _CAT = torch.ops.aten.slice.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.cat.default


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


_FULL = (None, 2**63 - 1)  # a slice's end that keeps the rest


def _slice_of(node, dim: int, start: int, step: int, end=_FULL) -> bool:
    """Whether ``node`` is ``aten.slice.Tensor(input, dim, start, end, step)`` with those values (the end any of
    ``end``)."""
    if not isinstance(node, Node) or node.target is not _SLICE:
        return False
    args = (*node.args[1:], *[None] * 4)[:4]
    got = (0 if args[0] is None else args[0], 0 if args[1] is None else args[1], args[2], 1 if args[3] is None else
           args[3])
    return got[0] == dim and got[1] == start and got[3] == step and got[2] in (end if isinstance(end, tuple)
                                                                               else (end,))


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _leaf_tree(leaves_node: Node, leaves: int) -> tuple[Node, Node | None, list[Node]] | None:
    """``row_linear``'s sum of the leaves ``leaves_node`` (``[L, rows, N]``) as the graph has it: optionally
    ``cat((parts[:1] + bias, parts[1:]))``, then ``parts[0::2] + parts[1::2]`` until one leaf is left. (the last
    node, the bias node or None, every node of the sum in program order), or None where the graph sums otherwise."""
    if leaves < 2 or leaves & (leaves - 1) or leaves > blocked_linear.MAX_TREE_LEAVES:
        return None
    summed: list[Node] = []
    current, bias = leaves_node, None
    users = list(current.users)
    if len(users) == 2 and any(_slice_of(u, 0, 0, 1, 1) for u in users):  # the bias in the first leaf
        first = next((u for u in users if _slice_of(u, 0, 0, 1, 1)), None)
        rest = next((u for u in users if _slice_of(u, 0, 1, 1)), None)
        added = _only_user(first) if first is not None else None
        if rest is None or added is None or added.target is not _ADD or added.args[0] is not first:
            return None
        joined = _only_user(added)
        if joined is None or joined.target is not _CAT or _only_user(rest) is not joined or \
                list(joined.args[0]) != [added, rest] or (len(joined.args) > 1 and joined.args[1] != 0):
            return None
        bias, current = added.args[1], joined
        summed += [first, rest, added, joined]
    for _ in range(leaves.bit_length() - 1):
        users = list(current.users)
        even = next((u for u in users if _slice_of(u, 0, 0, 2)), None)
        odd = next((u for u in users if _slice_of(u, 0, 1, 2)), None)
        if len(users) != 2 or even is None or odd is None:
            return None
        added = _only_user(even)
        if added is None or _only_user(odd) is not added or added.target is not _ADD or \
                tuple(added.args) != (even, odd):
            return None
        summed += [even, odd, added]
        current = added
    return current, bias, summed


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
            if node.target is _BMM:
                rewritten += self._rewrite_leaves(graph, node, weight_of, decls, packed_weight)
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

    def _rewrite_leaves(self, graph, node: Node, weight_of: dict[Node, str], decls: dict[str, BufferDecl],
                        packed_weight) -> int:
        """A row-parallel projection's leaves (``recipes/layers.py`` ``row_linear``: ``bmm`` of ``x.reshape(-1, L,
        K / L).transpose(0, 1)`` and ``w.view(N, L, K / L).permute(1, 2, 0)``, or a one-leaf shard's two copies of
        them) onto ``blocked_linear.blocked_leaves``, whose leaves are each one FMA chain, and where the graph sums
        them as ``row_linear`` does (``_leaf_tree``), the leaves and their sum onto ``blocked_row_linear`` (the same
        additions, in the product's registers): 1 where rewritten.

        Every such product goes on the blocked product wherever it runs FP32 here and the mode allows it (not
        timed per shape): a tensor-parallel rank computes some of the same leaves on its shard's shape, and they
        must be the single rank's bits."""
        expanded = False
        leaves_view, slices = node.args
        if not isinstance(leaves_view, Node) or not isinstance(slices, Node):
            return 0
        if leaves_view.target is _EXPAND and slices.target is _EXPAND:  # a rank's one leaf as a batch of two
            if list(leaves_view.args[1])[0] != 2 or list(slices.args[1])[0] != 2:
                return 0
            expanded, leaves_view, slices = True, leaves_view.args[0], slices.args[0]
        if leaves_view.target is not _TRANSPOSE or tuple(leaves_view.args[1:]) != (0, 1) or \
                slices.target is not _PERMUTE or list(slices.args[1]) != [1, 2, 0]:
            return 0
        flat, view = leaves_view.args[0], slices.args[0]
        if flat.target not in _RESHAPES or view.target not in _RESHAPES or view.args[0] not in weight_of:
            return 0
        name = weight_of[view.args[0]]
        decl = decls[name]
        out_features, in_features = decl.shape
        leaves = list(view.args[1])[1]
        if list(view.args[1]) != [out_features, leaves, in_features // leaves] or \
                list(flat.args[1])[1:] != [leaves, in_features // leaves] or in_features % leaves or \
                not self._leaves_blocked(decl.torch_dtype) or self.paths.setdefault(name, BLOCKED) != BLOCKED:
            return 0
        tree = None if expanded else _leaf_tree(node, leaves)
        if tree is not None:  # the leaves and their sum, one call
            end, bias, summed = tree
            with graph.inserting_before(end):
                call = graph.call_function(blocked_linear.graph_row_linear,
                                           (flat.args[0], packed_weight(name), bias, out_features, leaves))
            call.meta = dict(end.meta)
            end.replace_all_uses_with(call)
            for unused in reversed(summed):  # each one's users before it
                graph.erase_node(unused)
        else:
            with graph.inserting_before(node):
                call = graph.call_function(blocked_linear.graph_leaves,
                                           (flat.args[0], packed_weight(name), out_features, leaves))
                result = graph.call_function(_EXPAND, (call, [2, -1, -1])) if expanded else call
            result.meta = dict(node.meta)
            if expanded and "val" in node.meta:
                call.meta = {**node.meta, "val": node.meta["val"][:1]}
            node.replace_all_uses_with(result)
        copies = node.args if expanded else ()
        graph.erase_node(node)
        for unused in (*copies, leaves_view, slices, flat, view):  # in order: each one's users erased before it
            if not unused.users:
                graph.erase_node(unused)
        return 1

    def _leaves_blocked(self, dtype: torch.dtype) -> bool:
        """Whether row-parallel leaves of ``dtype`` run on the blocked product: FP32 (the only dtype ``row_linear``
        splits), the product built here, and the mode ``calibrate`` or ``blocked``."""
        return dtype == torch.float32 and blocked_linear.blocks_dtype(dtype) and \
            self.gemm.mode in (CALIBRATE, BLOCKED) and self.gemm.allowed(dtype)

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
