"""CPU replay: each large FP32 weight a graph multiplies by (``aten.linear``) packed once for oneDNN.

NOTE: torch's CPU ``aten.linear`` calls MKL's ``sgemm``, which on this project's AMD EPYC (Zen 4) machine runs
far below the memory bound at decode's few rows: ``[8, 1024] x [1024, 151936]`` (the Qwen3-0.6B LM head) takes
115 ms, a weight read at 5.4 GB/s. oneDNN's matmul on a weight reordered once into its blocked layout
(``mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) takes 26 ms for the same product, and
2-4x less for the layers' projections at 1 to 512 rows; a decode step at batch 8 of that checkpoint went from
385-498 ms to 210-242 ms (``benchmarks.decode_steps --compare pack``). It accumulates in FP32, as ``aten.linear``
does, so only the summation order changes (logprobs within 3e-6 of the unpacked core's on that checkpoint).

``LinearPacks.rewrite`` turns every ``aten.linear(x, w[, b])`` of a graph whose ``w`` is an FP32 weight argument
of at least ``PACK_MIN_ELEMENTS`` into ``mkldnn._linear_pointwise(x, packed(w), b)``, the packed copy a constant
of the graph module. Each weight is packed once per load and shared by every variant. A weight that, after
every variant is rewritten, no graph reads in its raw form (every layer projection; not a tied embedding, which
the lookup still reads) is released (``finish``): its pages go back to the OS (``host_memory.release_pages``) and the
core's dict holds the packed tensor, so the weights stay in memory once. A one-row linear on a weight its graph
also reads raw (``PLAIN_ROWS``: a tied LM head's one sampled row) calls oneDNN on the raw weight instead, which one
row reads faster than the packed layout; a weight only such linears read is not packed at all.
``LoadOptions.pack_linears`` makes the choice, at load.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ignition.catalog.model import BufferDecl, Role
from ignition.runtime.host_memory import release_pages
from ignition.validate.graph_json import FACTS
from ignition.validate.program_reader import StaticProgram

PACK_ROWS_HINT = 8
"""The row count oneDNN's packed layout is chosen for; measured as fast at 1 and 512 rows as a per-count pack."""
PACK_MIN_ELEMENTS = 1 << 18
"""Smaller weights keep ``aten.linear``: oneDNN's call costs 15-20 us more, which a weight under about 256 Ki
elements does not win back (measured on this machine: 512 x 256 at 8 rows 26 us packed against 30 us; 256 x 256
21 against 15; the tiny example's 300 x 32, 27 against 10)."""
PACKED_DTYPES = (torch.float32,)
"""FP32 only. BF16 ``aten.linear`` already runs oneDNN's matmul on a CPU with AVX512-BF16, and packing gained 0-5%
at Qwen3-0.6B's width (``benchmarks.decode_steps --compare pack``) while it changed the BF16 rounding of every
product from transformers' own, which flips greedy tokens of a random-weight checkpoint."""
PACK_WORKERS = 2
"""Threads that pack at once (the reorders release the GIL; most of their time is faulting in the packed copies' fresh
pages, which two threads do side by side)."""
PACKED_TARGET = "mkldnn._linear_pointwise.default"
"""What a rewritten linear calls (its profiler name is ``mkldnn::_linear_pointwise``)."""
PLAIN_ROWS = 1
"""A linear of this many rows whose weight its graph also reads raw (a tied embedding's lookup: the raw copy stays in
memory anyway) calls oneDNN on the raw weight instead of the packed copy: its plain layout is read near the memory's
bandwidth by one row and the blocked one is not. Measured on this project's 2-core machine (``[rows, 1024] x [1024,
151936]``, the Qwen3-0.6B LM head; ``benchmarks.row_layouts``): one row 37-33 ms plain against 46-56 ms packed, eight
rows 73-86 against 65-76 (two passes). A decode step of one lane projects one row (a prefill chunk's sampled row is
one row of an 8-row product: ``recipes.transformer.sampled_row_logits``)."""
_LINEAR = torch.ops.aten.linear.default
_POINTWISE = torch.ops.mkldnn._linear_pointwise.default


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class LinearPacks:
    """The packed copy of every weight the load's graphs use as a linear weight, shared across variants.

    NOTE: packing the 28-layer Qwen3-0.6B-shaped core's weights takes 1-2 s of CPU. ``rewrite`` runs on each graph
    as it is read, before the weights are in memory (the catalog declares each argument's dtype and shape), so that
    by the time they are, every packed weight is known and whether some graph still reads it raw. ``start`` then
    packs them on a worker thread (the reorder releases the GIL) while the loader binds the variants and generates
    their code, releasing each raw copy no graph reads as soon as its pack exists (the weights are never held twice
    at once), and ``finish`` puts the packed tensors in the graphs' empty stand-ins."""

    def __init__(self, rows_hint: int = PACK_ROWS_HINT, min_elements: int | None = None):
        self.rows_hint = rows_hint
        self.min_elements = PACK_MIN_ELEMENTS if min_elements is None else min_elements
        self.attributes: dict[str, str] = {}  # weight name -> the graph attribute of its packed copy
        self.pending: dict[str, Future] = {}  # weight name -> its reorder (``start``)
        self.packed: dict[str, torch.Tensor] = {}  # filled by ``finish``
        self.raw_readers: set[str] = set()  # weights some rewritten graph still reads unpacked
        self.programs: list[tuple[StaticProgram, dict[str, str]]] = []  # each rewritten program: attribute -> weight
        self._worker = ThreadPoolExecutor(max_workers=PACK_WORKERS, thread_name_prefix="ignition-pack")

    def _packs(self, decl: BufferDecl) -> bool:
        return len(decl.shape) == 2 and decl.torch_dtype in PACKED_DTYPES and decl.numel >= self.min_elements

    def rewrite(self, program: StaticProgram, arguments: list[BufferDecl]) -> int:
        """Rewrite the linears of ``program``'s graph whose weight is a large FP32 weight argument (by its
        declaration), before its graph module is built (one code generation) and before ``start``; returns how
        many. Records which weights it still reads unpacked."""
        if program.module_built:
            raise ValueError("packed linears rewrite a program's graph before its graph module is built")
        if self.pending:
            raise ValueError("packed linears rewrite every graph before the packing starts")
        decls = {a.name: a for a in arguments if a.role is Role.WEIGHT}
        graph, root, names = program.graph, program.root, program.argument_names
        weight_of = {node: name for node, name in zip((n for n in graph.nodes if n.op == "placeholder"), names)
                     if name in decls}
        attributes: dict[str, str] = {}
        rewritten = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not _LINEAR or node.args[1] not in weight_of:
                continue
            name = weight_of[node.args[1]]
            if not self._packs(decls[name]):
                continue
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with graph.inserting_before(node):
                if _rows(node.args[0]) == PLAIN_ROWS and _read_raw(node.args[1]):  # the raw copy is kept anyway
                    weight = node.args[1]
                else:
                    attribute = self.attributes.setdefault(name, f"_packed_{len(self.attributes)}")
                    if attribute not in attributes:  # ``finish`` sets the packed one
                        root.register_buffer(attribute, torch.empty(0), persistent=False)
                        attributes[attribute] = name
                    weight = graph.get_attr(attribute)
                call = graph.call_function(_POINTWISE, (node.args[0], weight, bias, "none", [], ""))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            rewritten += 1
        self.raw_readers |= {name for node, name in weight_of.items() if node.users}
        if attributes:
            self.programs.append((program, attributes))
        return rewritten

    def start(self, weights: dict[str, torch.Tensor]) -> None:
        """Pack every rewritten graph's weights on the worker thread, each raw copy that no graph reads released
        as soon as its pack exists."""
        for name in self.attributes:
            self.pending[name] = self._worker.submit(self._pack, weights[name], name not in self.raw_readers)

    def _pack(self, weight: torch.Tensor, release: bool) -> torch.Tensor:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows_hint)
        if release:  # nothing reads it until ``finish`` swaps the packed tensor in
            release_pages(weight)
        return packed

    def finish(self, weights: dict[str, torch.Tensor], variants) -> list[str]:
        """After ``start`` and every variant bound: wait for the packs and give each graph module its packed weights
        (the CPU backend generated each graph's code as it prepared it, while the weights were read); then each
        packed weight no graph reads raw (its raw pages already released) is replaced, in ``weights`` and in every
        variant's buffers, by its packed tensor (an unused placeholder's argument). Returns the released names."""
        self.packed = {name: reorder.result() for name, reorder in self.pending.items()}
        self._worker.shutdown()
        for program, attributes in self.programs:
            for attribute, name in attributes.items():
                setattr(program.graph_module, attribute, self.packed[name])
        released = [name for name in self.packed if name not in self.raw_readers]
        for name in released:
            weights[name] = self.packed[name]
            for variant in variants:
                if name in variant.buffers:
                    variant.buffers[name] = self.packed[name]
        return released


def _rows(x: torch.fx.Node) -> int | None:
    """A linear input's static row count from the program's facts (None: unknown or symbolic)."""
    facts = x.meta.get(FACTS)
    if facts is None or facts.dim() != 2 or not isinstance(facts.shape[0], int):
        return None
    return facts.shape[0]


def _read_raw(weight: torch.fx.Node) -> bool:
    """Whether the graph reads ``weight`` other than as a linear's weight (an embedding lookup)."""
    return any(not (user.op == "call_function" and user.target in (_LINEAR, _POINTWISE)
                    and user.args[1] is weight) for user in weight.users)


__all__ = ["LinearPacks", "PACK_MIN_ELEMENTS", "PACK_ROWS_HINT", "PACKED_DTYPES", "PACKED_TARGET", "PLAIN_ROWS",
           "packing_available"]
