"""CPU replay: a linear on a weight packed in blocks of 16 output features (``blocked_linear.c``), FP32 or BF16,
compiled for this CPU at load.

NOTE: oneDNN reorders a weight for one row count (``gemm_calibration.PACK_LAYOUTS``), and no layout of its wins at
every decode capacity: on one AMD EPYC host the eight-row layout read the Qwen3-0.6B projections 1.2-1.3x slower at
one row than the one-row layout, which in turn lost as much at eight rows. This product streams one layout
(``[ceil(N / 16), K, 16]``) at one row as eight sequential reads a thread and at more rows eight at a time against
two blocks, and every output is one FP32 FMA chain over ``k`` in order: the same bits at every row count (a row's
result does not depend on its batch). A BF16 weight is widened exactly (or, where the CPU has AVX512-BF16, multiplied
two k at a time by VDPBF16PS, ``bf16_pairs``) and the FP32 sum plus the bias rounded to BF16 once, as
``aten.linear`` accumulates, in another order (BF16 promises no bits against transformers across CPUs,
docs/recipes.md; its deviation from the FP32 product is tested against ``aten.linear``'s). It is one more path
``GemmPlan`` times at load (``BLOCKED``), taken only where it measured faster on the machine.

``blocked_leaves`` runs a row-parallel projection's reduction leaves (``recipes/layers.py`` ``row_linear``, FP32):
leaf ``l`` one FMA chain over its slice of ``K`` from zero, so a rank of a tensor-parallel core that holds some of
the leaves computes them with the same bits (``packed_linear.LinearPacks`` puts every such product on it wherever the
blocked product runs, whatever the shape, so that the ranks and the single rank agree).

The source is compiled once per CPU, compiler and source (``native_build``: ``-O3 -march=native -fopenmp``, so the
product runs on the process's OpenMP threads, torch's) into the machine's cache directory; a machine without a C
compiler, or where the build fails, does not offer the path (``unavailable`` says why), and ``gemm="blocked"`` is
refused at load with that reason.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from ignition.runtime.backends import native_build
from ignition.runtime.backends.native_build import NativeUnavailable, build

SOURCE = Path(__file__).with_name("blocked_linear.c")
FLAGS = native_build.FLAGS
LANES = 16
"""Output features a block (the C source's ``LANES``: one AVX-512 vector, two AVX2 ones)."""
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class BlockedUnavailable(NativeUnavailable):
    """This machine cannot build or load the blocked product; the message says why."""


@cache
def library() -> ctypes.CDLL:
    """The compiled product (``native_build.build`` of ``SOURCE`` with ``FLAGS``), built on first use and loaded;
    BlockedUnavailable with the reason where it cannot be."""
    try:
        loaded, digest = build(SOURCE, FLAGS)
    except NativeUnavailable as exc:
        raise BlockedUnavailable(str(exc)) from exc
    loaded.build_id = digest
    loaded.blocked_bf16_pairs.argtypes, loaded.blocked_bf16_pairs.restype = [], ctypes.c_int
    for suffix in _SUFFIX.values():
        pack_function, linear = getattr(loaded, f"blocked_pack_{suffix}"), getattr(loaded, f"blocked_linear_{suffix}")
        pack_function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
        pack_function.restype = None
        linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                           ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int]
        linear.restype = ctypes.c_int
    return loaded


def build_id() -> str:
    """Which build of the product this process runs (its source, flags, compiler and CPU, hashed: the name it
    is cached under), or ``unavailable``: a GEMM calibration is valid only for the build it timed
    (``gemm_calibration.machine_key``)."""
    return library().build_id if unavailable() is None else "unavailable"


@cache
def unavailable() -> str | None:
    """None where the blocked product builds and loads here; else why not."""
    try:
        library()
    except BlockedUnavailable as exc:
        return str(exc)
    return None


def blocks_dtype(dtype: torch.dtype) -> bool:
    """Whether a weight of ``dtype`` may take the blocked product on this machine."""
    return dtype in DTYPES and unavailable() is None


@cache
def bf16_pairs() -> bool:
    """Whether this machine's build multiplies BF16 in k pairs (AVX512-BF16's VDPBF16PS), on weights packed as
    ``[ceil(N / 16), K / 2, 16, 2]`` (K even)."""
    return bool(library().blocked_bf16_pairs())


def blocks(shape, dtype: torch.dtype) -> bool:
    """Whether a ``[N, K]`` weight of ``dtype`` may take the blocked product on this machine (``blocks_dtype``; in
    BF16 pairs, K even)."""
    return blocks_dtype(dtype) and (dtype != torch.bfloat16 or not bf16_pairs() or shape[-1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (FP32 or BF16) as ``[ceil(N / 16), K, 16]``: block b holds features 16b .. 16b+15, k-major;
    the features past N are zero."""
    if weight.dtype not in DTYPES or weight.dim() != 2:
        raise ValueError(f"the blocked product packs a 2-D float32 or bfloat16 weight, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    if not blocks(weight.shape, weight.dtype) and unavailable() is None:
        raise ValueError(f"this machine multiplies BF16 in k pairs (AVX512-BF16), so a blocked BF16 weight needs an "
                         f"even K, got {tuple(weight.shape)}")
    packed = torch.empty(-(-out_features // LANES), in_features, LANES, dtype=weight.dtype)
    getattr(library(), f"blocked_pack_{_SUFFIX[weight.dtype]}")(weight.data_ptr(), packed.data_ptr(), out_features,
                                                               in_features)
    return packed


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The exact ``[N, K]`` weight a ``pack`` came from."""
    blocks_count, in_features = packed.shape[:2]
    if packed.dtype == torch.bfloat16 and bf16_pairs():  # [.., K / 2, 16, 2]
        return packed.view(blocks_count, in_features // 2, LANES, 2).permute(0, 2, 1, 3) \
            .reshape(-1, in_features)[:out_features].contiguous()
    return packed.permute(0, 2, 1).reshape(-1, in_features)[:out_features].contiguous()


_functions: dict[torch.dtype, ctypes._CFuncPtr] = {}  # dtype -> the library's product, looked up once


MAX_TREE_LEAVES = 16
"""The most leaves ``blocked_row_linear`` sums (the C source's ``MAX_TREE_LEAVES``; ``row_linear`` splits into at most
``catalog.parallel.ROW_REDUCTION_BLOCKS``)."""


def _run(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, out_features: int,
         leaves: int, tree: bool = False) -> None:
    if rows.dtype not in DTYPES or packed.dtype != rows.dtype or (bias is not None and bias.dtype != rows.dtype):
        raise ValueError(f"the blocked product multiplies {rows.dtype} rows by a {packed.dtype} weight"
                         f"{'' if bias is None else f' and a {bias.dtype} bias'}; expected one dtype of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    function = _functions.get(rows.dtype)
    if function is None:
        function = _functions[rows.dtype] = getattr(library(), f"blocked_linear_{_SUFFIX[rows.dtype]}")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if rows.shape[0] and function(rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                  y.data_ptr(), rows.shape[0], out_features, packed.shape[1], leaves, tree,
                                  torch.get_num_threads()):
        if rows.dtype == torch.bfloat16 and bf16_pairs() and packed.shape[1] // leaves % 2:
            raise ValueError(f"this machine multiplies BF16 in k pairs (AVX512-BF16): {leaves} leaves of "
                             f"{packed.shape[1]} inputs leave an odd number a leaf")
        raise MemoryError(f"the blocked product could not allocate scratch for {rows.shape[0]} x {packed.shape[1]} "
                          "rows")


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x [..., K]`` as contiguous ``[rows, K]``: a decode step's rows as they are (no view, no copy: each is a
    profiler event)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    rows = _rows(x, packed.shape[1])
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    _run(rows, packed, bias, y, out_features, 1)
    return y if rows is x else y.view(*x.shape[:-1], out_features)


def _leaves(x: torch.Tensor, packed: torch.Tensor, out_features: int, leaves: int) -> torch.Tensor:
    in_features = packed.shape[1]
    if leaves < 1 or in_features % leaves:
        raise ValueError(f"{leaves} reduction leaves do not divide the weight's {in_features} inputs")
    rows = _rows(x, in_features)
    y = torch.empty(leaves, rows.shape[0], out_features, dtype=x.dtype)
    _run(rows, packed, None, y, out_features, leaves)
    return y


def _row_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                leaves: int) -> torch.Tensor:
    in_features = packed.shape[1]
    if leaves < 1 or in_features % leaves or leaves > MAX_TREE_LEAVES or leaves & (leaves - 1):
        raise ValueError(f"{leaves} reduction leaves of the weight's {in_features} inputs: expected a power of two "
                         f"up to {MAX_TREE_LEAVES} that divides them")
    rows = _rows(x, in_features)
    y = torch.empty(1, rows.shape[0], out_features, dtype=x.dtype)
    _run(rows, packed, bias, y, out_features, leaves, tree=True)
    return y


_profiling = torch._C._autograd._profiler_enabled


def graph_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """What a linear rewritten onto the blocked product calls: ``blocked_linear`` without the dispatcher (a Python
    custom op's call costs about 15 us on one AMD EPYC host, a decode step makes about 200 of them; the library's own
    call about 2), shown as ``ignition::blocked_linear`` while a profiler runs."""
    if _profiling():
        with torch.profiler.record_function("ignition::blocked_linear"):
            return _linear(x, packed, bias, out_features)
    return _linear(x, packed, bias, out_features)


def graph_leaves(x: torch.Tensor, packed: torch.Tensor, out_features: int, leaves: int) -> torch.Tensor:
    """What a row-parallel projection's leaves rewritten onto the blocked product call: ``blocked_leaves`` without
    the dispatcher (``graph_linear``), shown as ``ignition::blocked_leaves`` while a profiler runs."""
    if _profiling():
        with torch.profiler.record_function("ignition::blocked_leaves"):
            return _leaves(x, packed, out_features, leaves)
    return _leaves(x, packed, out_features, leaves)


def graph_row_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                     leaves: int) -> torch.Tensor:
    """What a row-parallel projection (its leaves and their pairwise sum) rewritten onto the blocked product calls:
    ``blocked_row_linear`` without the dispatcher (``graph_linear``)."""
    if _profiling():
        with torch.profiler.record_function("ignition::blocked_row_linear"):
            return _row_linear(x, packed, bias, out_features, leaves)
    return _row_linear(x, packed, bias, out_features, leaves)


GRAPH_CALLS = {graph_linear: "ignition::blocked_linear", graph_leaves: "ignition::blocked_leaves",
               graph_row_linear: "ignition::blocked_row_linear"}
"""The functions rewritten graphs call, by the name a profiler shows them under."""


@torch.library.custom_op("ignition::blocked_linear", mutates_args=())
def blocked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear(x, unpack(packed, out_features), bias)`` on the blocked product: ``x [..., K]`` float32 or bfloat16,
    the weight's dtype."""
    return _linear(x, packed, bias, out_features)


@blocked_linear.register_fake
def _blocked_linear_fake(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("ignition::blocked_leaves", mutates_args=())
def blocked_leaves(x: torch.Tensor, packed: torch.Tensor, out_features: int, leaves: int) -> torch.Tensor:
    """The reduction leaves of ``row_linear``: ``[leaves, rows, N]``, leaf ``l`` the product of ``x``'s slice
    ``l * K / leaves ..`` with the weight's same columns (``x [..., K]`` flattened to rows, K a multiple of
    ``leaves``): what ``torch.bmm`` of those slices returns, each leaf one FMA chain from zero."""
    return _leaves(x, packed, out_features, leaves)


@torch.library.custom_op("ignition::blocked_row_linear", mutates_args=())
def blocked_row_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                       leaves: int) -> torch.Tensor:
    """``row_linear`` whole: the leaves of ``blocked_leaves``, the bias added to leaf 0, summed as a balanced pairwise
    tree of neighbours (each level leaf 2i + leaf 2i+1), ``[1, rows, N]``; ``leaves`` a power of two up to
    ``MAX_TREE_LEAVES``."""
    return _row_linear(x, packed, bias, out_features, leaves)


@blocked_row_linear.register_fake
def _blocked_row_linear_fake(x, packed, bias, out_features, leaves):
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    return x.new_empty(1, rows, out_features)


@blocked_leaves.register_fake
def _blocked_leaves_fake(x, packed, out_features, leaves):
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    return x.new_empty(leaves, rows, out_features)


TARGET = torch.ops.ignition.blocked_linear.default
"""The blocked product as an operator (``ignition::blocked_linear``; graphs call ``graph_linear``)."""
LEAVES_TARGET = torch.ops.ignition.blocked_leaves.default
"""The blocked leaves as an operator (``ignition::blocked_leaves``; graphs call ``graph_leaves``)."""
ROW_LINEAR_TARGET = torch.ops.ignition.blocked_row_linear.default
"""The blocked leaves summed, as an operator (``ignition::blocked_row_linear``; graphs call ``graph_row_linear``)."""

__all__ = ["BlockedUnavailable", "DTYPES", "GRAPH_CALLS", "LANES", "LEAVES_TARGET", "MAX_TREE_LEAVES",
           "ROW_LINEAR_TARGET", "TARGET", "bf16_pairs", "build_id", "blocked_leaves", "blocked_linear", "blocked_row_linear",
           "blocks", "blocks_dtype",
           "graph_leaves", "graph_linear", "graph_row_linear", "library", "pack", "unavailable", "unpack"]
