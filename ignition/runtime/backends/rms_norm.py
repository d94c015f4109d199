"""CPU replay: a graph's RMSNorm, FP32 or BF16, in one native call (``rms_norm.c``) in place of the six to nine ATen
calls the recipes write it out in.

The recipes write RMSNorm as transformers' ops (``recipes/layers.py``): ``mul(x, x)``, ``sum(-1, keepdim)``,
``addcdiv(eps, sum, n)``, ``rsqrt``, ``mul(x, rsqrt)``, ``mul(weight, ·)``; in BF16, ``x`` is widened to FP32 first
and the norm rounded to BF16 before the weight's product. A decode step of Qwen3-0.6B runs 85 of them, each six to
nine calls on a few KiB, so most of their time is the calls. ``rewrite`` points each such chain (its intermediates
read by nothing else, the constants ``new_full`` scalars) at ``rms_norm``: the same arithmetic in the same roundings,
but for the order of the sum of squares (eight FP32 chains, the C source's note), which is fixed whatever the rows
beside a row or the threads, so a decode row, a verify row and a prompt chunk's row at the same values give the same
bits. Against ATen's ``sum`` the norm differs by FP32 rounding (in BF16, where that moves a rounding to BF16, by one
BF16 ulp).

Made at load on the CPU, for every variant of a core alike (``LoadOptions.native_kernels``), wherever the kernel builds
(``native_build``); where it does not (``unavailable``), the graphs keep ATen's calls."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch.fx import Graph, Node

from ignition.runtime.backends import native_build
from ignition.runtime.backends.native_build import build, failure
from ignition.validate.graph_json import FACTS

SOURCE = Path(__file__).with_name("rms_norm.c")
FLAGS = tuple("-ffp-contract=off" if flag.startswith("-ffp-contract") else flag for flag in native_build.FLAGS)
"""``native_build.FLAGS`` without FMA contraction: the rotary embedding's products and sum round as ATen's ops."""
_aten = torch.ops.aten


@cache
def library() -> ctypes.CDLL:
    """The compiled kernel (``native_build.build`` of ``SOURCE``); NativeUnavailable with the reason where it cannot
    be built or loaded."""
    loaded, _ = build(SOURCE, FLAGS)
    common = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
              ctypes.c_float, ctypes.c_float]
    for suffix in ("f32", "bf16"):
        plain, rotated = getattr(loaded, f"rms_norm_{suffix}"), getattr(loaded, f"rms_norm_rope_{suffix}")
        plain.argtypes, plain.restype = [*common, ctypes.c_int], None
        rotated.argtypes = [*common, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        rotated.restype = None
    return loaded


@cache
def unavailable() -> str | None:
    """None where the kernel builds and loads here; else why not."""
    return failure(library)


_profiling = torch._C._autograd._profiler_enabled


_F32, _BF16 = torch.float32, torch.bfloat16
DTYPES = (_F32, _BF16)
"""The dtypes the kernel norms: FP32, and BF16 as transformers writes it (widened to FP32, normed, rounded)."""


def _checked(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in DTYPES or weight.dtype != x.dtype or not x.dim() or not x.shape[-1] or \
            weight.dim() > x.dim() or weight.shape != x.shape[x.dim() - weight.dim():]:
        raise ValueError(f"rms_norm takes x [..., n] and a weight of x's trailing extents, both float32 or both "
                         f"bfloat16; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    return x.contiguous(), weight.contiguous()


def _trig_checked(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  per_trig_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    for name, trig in (("cos", cos), ("sin", sin)):
        if trig.dtype != x.dtype or trig.shape[-1] != x.shape[-1] or per_trig_row < 1 or rows % per_trig_row or \
                trig.numel() != rows // per_trig_row * x.shape[-1]:
            raise ValueError(f"rms_norm_rope takes {x.dtype} cos and sin (x's dtype) with one row of {x.shape[-1]} "
                             f"per {per_trig_row} rows of x {tuple(x.shape)}; got {name} {tuple(trig.shape)} "
                             f"{trig.dtype}")
    return cos.contiguous(), sin.contiguous()


def _run(x: torch.Tensor, weight: torch.Tensor, eps: float, count: float,
         rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """The kernel on checked, contiguous operands; ``rope``: ``(cos, sin, per_trig_row, shift)``."""
    width = x.shape[-1]
    y = torch.empty_like(x)
    rows = x.numel() // width
    if rows:
        kernels = library()
        common = (x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, width, weight.numel() // width, eps, count)
        if rope is None:
            kernel = kernels.rms_norm_f32 if x.dtype is _F32 else kernels.rms_norm_bf16
            kernel(*common, torch.get_num_threads())
        else:
            cos, sin, per_trig_row, shift = rope
            kernel = kernels.rms_norm_rope_f32 if x.dtype is _F32 else kernels.rms_norm_rope_bf16
            kernel(*common, cos.data_ptr(), sin.data_ptr(), per_trig_row, shift, torch.get_num_threads())
    return y


def _plain(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where ``x`` and ``weight`` need no check: one dtype of ``DTYPES``, contiguous (cheaper than
    ``_checked``)."""
    return (x.dtype is _F32 or x.dtype is _BF16) and weight.dtype is x.dtype and x.is_contiguous() and \
        weight.is_contiguous()


def graph_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, count: float) -> torch.Tensor:
    """What a rewritten graph calls: ``rms_norm`` without its shape checks (``rewrite`` checked the graph's extents
    once; a decode step makes 85 calls on a few KiB each, and reading a shape costs about as much as the norm), shown
    as ``ignition::rms_norm`` while a profiler runs."""
    if not _plain(x, weight):
        x, weight = _checked(x, weight)
    if _profiling():
        with torch.profiler.record_function("ignition::rms_norm"):
            return _run(x, weight, eps, count)
    return _run(x, weight, eps, count)


def graph_rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, count: float, cos: torch.Tensor,
                        sin: torch.Tensor, per_trig_row: int, shift: int) -> torch.Tensor:
    """What a rewritten graph calls for a norm its rotary embedding follows (``rms_norm_rope``, its shapes checked by
    ``rewrite``), shown as ``ignition::rms_norm_rope`` while a profiler runs."""
    if not _plain(x, weight):
        x, weight = _checked(x, weight)
    if cos.dtype is not x.dtype or sin.dtype is not x.dtype or not cos.is_contiguous() or not sin.is_contiguous():
        cos, sin = _trig_checked(x, cos, sin, per_trig_row)
    if _profiling():
        with torch.profiler.record_function("ignition::rms_norm_rope"):
            return _run(x, weight, eps, count, (cos, sin, per_trig_row, shift))
    return _run(x, weight, eps, count, (cos, sin, per_trig_row, shift))


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, count: float, cos: torch.Tensor,
                  sin: torch.Tensor, per_trig_row: int, shift: int) -> torch.Tensor:
    """``rms_norm(x, weight, eps, count)`` rotated as the recipes rotate half (``v * cos + roll(v, shift, -1) *
    sin``, ``sin`` signed), each product and the sum rounded as ATen's ``mul``, ``roll`` and ``add`` round them in
    x's dtype: row ``r`` of ``x`` (flattened to ``[rows, n]``) takes row ``r // per_trig_row`` of ``cos`` and ``sin``
    (``[R, 1, n]`` against ``x [R, heads, n]``: ``per_trig_row`` = heads)."""
    x, weight = _checked(x, weight)
    cos, sin = _trig_checked(x, cos, sin, per_trig_row)
    return _run(x, weight, eps, count, (cos, sin, per_trig_row, shift))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, count: float) -> torch.Tensor:
    """``weight * (x * rsqrt(eps + (x * x).sum(-1, keepdim=True) / count))`` for ``x [..., n]`` and a ``weight`` of
    x's trailing extents (``[n]``, or ``[heads, n]`` against ``[..., heads, n]``), the scalars in FP32. Both float32,
    or both bfloat16 as transformers norms BF16: ``x`` widened to FP32 and normed, the norm rounded to BF16 before
    the weight's product (rounded again)."""
    x, weight = _checked(x, weight)
    return _run(x, weight, eps, count)


GRAPH_CALLS = {graph_rms_norm: "ignition::rms_norm", graph_rms_norm_rope: "ignition::rms_norm_rope"}
"""The function rewritten graphs call, by the name a profiler shows it under."""


def _only_user(node: Node, user: Node) -> bool:
    return isinstance(node, Node) and list(node.users) == [user]


def _scalar(node) -> float | None:
    """The FP32 value of a ``new_full(_, [], value, dtype=float32)`` node, else None."""
    if not isinstance(node, Node) or node.target is not _aten.new_full.default or list(node.args[1]) != [] or \
            node.kwargs.get("dtype") is not torch.float32 or not isinstance(node.args[2], (int, float)):
        return None
    return float(torch.tensor(node.args[2], dtype=torch.float32))


def _dtype(node, dims: int = 0) -> torch.dtype | None:
    """The dtype the export recorded for ``node`` (None: none, or fewer than ``dims`` dims)."""
    facts = getattr(node, "meta", {}).get(FACTS)
    return facts.dtype if facts is not None and facts.dim() >= dims else None


def _cast(node, dtype: torch.dtype) -> Node | None:
    """``x`` where ``node`` is ``to.dtype(x, dtype)``, else None."""
    if isinstance(node, Node) and node.target is _aten.to.dtype and len(node.args) == 2 and node.args[1] == dtype \
            and not node.kwargs:
        return node.args[0]
    return None


def _match(node: Node) -> tuple[Node, Node, float, float, list[Node]] | None:
    """``(x, weight, eps, count, intermediates)`` where ``node`` is ``mul(weight, mul(x, rsqrt(addcdiv(eps,
    sum(mul(x, x), [-1], True), count))))`` (either operand order of the outer ``mul``), all FP32; or transformers'
    BF16 form, ``x`` BF16 and read as ``to(x, float32)``, the inner product rounded by ``to(·, bfloat16)`` before the
    BF16 weight's."""
    if node.op != "call_function" or node.target is not _aten.mul.Tensor or node.kwargs:
        return None
    for weight, outer in (node.args, node.args[::-1]):
        narrowed = _cast(outer, _BF16)
        scaled = outer if narrowed is None else narrowed
        if not isinstance(scaled, Node) or scaled.target is not _aten.mul.Tensor or \
                not _only_user(scaled, node if narrowed is None else outer):
            continue
        if narrowed is not None and not _only_user(outer, node):
            continue
        x, root = scaled.args
        if not isinstance(root, Node) or root.target is not _aten.rsqrt.default or not _only_user(root, scaled):
            continue
        mean = root.args[0]
        if not isinstance(mean, Node) or mean.target is not _aten.addcdiv.default or mean.kwargs.get("value", 1) != 1 \
                or len(mean.args) != 3 or not _only_user(mean, root):
            continue
        eps, total, count = _scalar(mean.args[0]), mean.args[1], _scalar(mean.args[2])
        if eps is None or count is None or not isinstance(total, Node) or \
                total.target is not _aten.sum.dim_IntList or list(total.args[1]) != [-1] or total.args[2:] != (True,) \
                or total.kwargs or not _only_user(total, mean):
            continue
        squares = total.args[0]
        if not isinstance(squares, Node) or squares.target is not _aten.mul.Tensor or squares.args != (x, x) or \
                not _only_user(squares, total):
            continue
        chain = [scaled, root, mean, total, squares]
        dtype = _F32
        if narrowed is not None:  # BF16: x is the FP32 copy of a BF16 input that only this chain reads
            source = _cast(x, _F32)
            if source is None or set(x.users) != {squares, scaled}:
                continue
            chain, x, dtype = [outer, *chain, x], source, _BF16
        elif _dtype(x) != _F32:
            continue
        if _dtype(x, 1) != dtype or _dtype(weight, 1) != dtype or _dtype(node) != dtype:
            continue
        weight_shape, x_shape = weight.meta[FACTS].shape, x.meta[FACTS].shape
        if len(weight_shape) > len(x_shape) or weight_shape != x_shape[len(x_shape) - len(weight_shape):]:
            continue
        return x, weight, eps, count, chain
    return None


def _rope(norm: Node) -> tuple[Node, Node, Node, int, int] | None:
    """``(add, cos, sin, per_trig_row, shift)`` where ``norm``'s only readers are ``add(mul(norm, cos), mul(roll(norm,
    [shift], [-1]), sin))`` (either operand order of each), ``cos`` and ``sin`` of norm's dtype and extents or with 1 at
    the heads' (dim -2)."""
    users = list(norm.users)
    if len(users) != 2:
        return None
    rolled = next((u for u in users if u.target is _aten.roll.default), None)
    scaled = next((u for u in users if u.target is _aten.mul.Tensor), None)
    if rolled is None or scaled is None or len(rolled.args) != 3 or list(rolled.args[2]) != [-1] or \
            len(rolled.args[1]) != 1 or not isinstance(rolled.args[1][0], int) or len(rolled.users) != 1 or \
            len(scaled.users) != 1:
        return None
    turned = next(iter(rolled.users))
    total = next(iter(scaled.users))
    if turned.target is not _aten.mul.Tensor or total.target is not _aten.add.Tensor or total.kwargs or \
            list(turned.users) != [total] or set(total.args) != {scaled, turned} or scaled.kwargs or turned.kwargs:
        return None
    cos = scaled.args[1] if scaled.args[0] is norm else scaled.args[0]
    sin = turned.args[1] if turned.args[0] is rolled else turned.args[0]
    shape = norm.meta[FACTS].shape
    trig = [getattr(t, "meta", {}).get(FACTS) for t in (cos, sin)]
    if any(f is None or f.dtype != norm.meta[FACTS].dtype or len(f.shape) != len(shape) or len(shape) < 2 or
           f.shape[-1] != shape[-1] or f.shape[:-2] != shape[:-2] or f.shape[-2] not in (1, shape[-2]) for f in trig) \
            or trig[0].shape != trig[1].shape or not isinstance(shape[-2], int):
        return None
    per_trig_row = shape[-2] if trig[0].shape[-2] == 1 else 1
    return total, cos, sin, per_trig_row, rolled.args[1][0]


def rewrite(graph: Graph) -> int:
    """Point each FP32 or BF16 RMSNorm chain of ``graph`` (``_match``) at ``rms_norm`` (``graph_rms_norm``), with the
    rotary embedding that follows it where one does (``_rope``: ``graph_rms_norm_rope``); returns how many norms.
    Before the graph module's code is generated."""
    count = 0
    for node in list(graph.nodes):
        found = _match(node)
        if found is None:
            continue
        x, weight, eps, width, chain = found
        with graph.inserting_before(node):
            call = graph.call_function(graph_rms_norm, (x, weight, eps, width))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for dead in chain:
            graph.erase_node(dead)
        count += 1
        rotated = _rope(call)
        if rotated is not None:  # its rotary embedding folded in, the call moved to where the sum was
            total, cos, sin, per_trig_row, shift = rotated
            products = list(total.args)
            (rolled,) = [a for p in products for a in p.args if getattr(a, "target", None) is _aten.roll.default]
            total.prepend(call)
            call.target = graph_rms_norm_rope
            call.args = (x, weight, eps, width, cos, sin, per_trig_row, shift)
            call.meta.update(total.meta)
            total.replace_all_uses_with(call)
            for dead in (total, *products, rolled):
                graph.erase_node(dead)
    return count


__all__ = ["DTYPES", "GRAPH_CALLS", "graph_rms_norm", "graph_rms_norm_rope", "library", "rewrite", "rms_norm",
           "rms_norm_rope", "unavailable"]
