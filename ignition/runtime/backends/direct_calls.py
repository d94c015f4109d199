"""CPU replay: a graph's ATen calls made through torch's Python bindings (``torch.mul``, ``Tensor.view``) instead of
``torch.ops`` overloads (``torch.ops.aten.mul.Tensor``).

A decode step of a small model is thousands of calls on a few kilobytes each, so the Python cost of a call is much
of the step outside the matrix products. An overload's ``__call__`` boxes its arguments and parses them against its
schema on every call; the binding of the same name parses them with torch's generated argument parser and reaches
the same kernel. On an AMD EPYC (Zen 2) host a ``[1, 1024]`` product costs 5.5 us through the overload and 3.5 us
through ``torch.mul``, a view 7.3 and 4.7 us, an ``index_select`` 10.1 and 6.6 us (``python -m benchmarks.direct_calls
--threads 2``).

``rewrite`` retargets a graph's nodes whose overload ``BINDINGS`` lists, before its graph module's code is
generated. A binding takes the node's arguments as the overload does (positions in schema order, keywords by the
schema's names) and resolves, for the argument kinds the recipes pass, to the same overload: the same kernel, so the
same bits. ``tests/_direct_calls_oracle.py`` checks this on every variant of the toy, Qwen3 (FP32 and BF16, linears
packed), Qwen3-MoE, DeepSeek-V3, Gemma 3, GPT-OSS, Qwen3.5 and DeepSeek V4 cores: the rewritten graph makes the same
ATen calls, in the same order, as the graph that calls the overloads, and leaves the same bits.
An overload with no binding of the same meaning (``slice.Tensor``, ``index.Tensor``) keeps its call. A node keeps
the overload it called in ``node.meta["overload"]`` (``overload``), for the tools that read a graph by operator.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten

OVERLOAD = "overload"
"""The ``node.meta`` key under which a rewritten node keeps the overload it called."""

BINDINGS: dict[torch._ops.OpOverload, object] = {
    aten.add.Tensor: torch.add,
    aten.addcdiv.default: torch.addcdiv,
    aten.amax.default: torch.amax,
    aten.amin.default: torch.amin,
    aten.any.dim: torch.any,
    aten.argmax.default: torch.argmax,
    aten.bitwise_not.default: torch.bitwise_not,
    aten.cat.default: torch.cat,
    aten.clamp.default: torch.clamp,
    aten.cos.default: torch.cos,
    aten.cumsum.default: torch.cumsum,
    aten.div.Tensor: torch.div,
    aten.embedding.default: torch.embedding,
    aten.eq.Scalar: torch.eq,
    aten.eq.Tensor: torch.eq,
    aten.expand.default: torch.Tensor.expand,
    aten.flatten.using_ints: torch.flatten,
    aten.floor_divide.default: torch.floor_divide,
    aten.gather.default: torch.gather,
    aten.ge.Scalar: torch.ge,
    aten.ge.Tensor: torch.ge,
    aten.gt.Scalar: torch.gt,
    aten.gt.Tensor: torch.gt,
    aten.index_copy_.default: torch.Tensor.index_copy_,
    aten.index_select.default: torch.index_select,
    aten.le.Scalar: torch.le,
    aten.le.Tensor: torch.le,
    aten.lt.Scalar: torch.lt,
    aten.lt.Tensor: torch.lt,
    aten.masked_fill.Scalar: torch.masked_fill,
    aten.minimum.default: torch.minimum,
    aten.mul.Tensor: torch.mul,
    aten.ne.Scalar: torch.ne,
    aten.ne.Tensor: torch.ne,
    aten.neg.default: torch.neg,
    aten.permute.default: torch.permute,
    aten.reciprocal.default: torch.reciprocal,
    aten.remainder.Scalar: torch.remainder,
    aten.repeat.default: torch.Tensor.repeat,
    aten.reshape.default: torch.reshape,
    aten.roll.default: torch.roll,
    aten.rsqrt.default: torch.rsqrt,
    aten.scaled_dot_product_attention.default: torch.nn.functional.scaled_dot_product_attention,
    aten.select.int: torch.select,
    aten.silu.default: torch._C._nn.silu,
    aten.sin.default: torch.sin,
    aten.squeeze.dim: torch.squeeze,
    aten.stack.default: torch.stack,
    aten.sub.Tensor: torch.sub,
    aten.sum.dim_IntList: torch.sum,
    aten.transpose.int: torch.transpose,
    aten.unsqueeze.default: torch.unsqueeze,
    aten.view.default: torch.Tensor.view,
    aten.where.self: torch.where,
    aten.__and__.Scalar: torch.Tensor.__and__,
    aten.__and__.Tensor: torch.Tensor.__and__,
    aten.__lshift__.Scalar: torch.Tensor.__lshift__,
    aten.__or__.Tensor: torch.Tensor.__or__,
    aten.__rshift__.Scalar: torch.Tensor.__rshift__,
    aten.__xor__.Tensor: torch.Tensor.__xor__,
}
"""Each overload the rewrite retargets, and the binding it calls instead: only overloads whose binding resolves to
them for the arguments the recipes' graphs pass (``tests/test_direct_calls.py``), none taking a keyword-only argument
that the binding lacks (``expand``'s ``implicit`` is refused by ``rewrite``: the binding has no such keyword)."""

_REFUSED_KEYWORDS = {aten.expand.default: {"implicit"}}


def overload(node: Node):
    """The operator ``node`` calls as the graph says it: its overload where ``rewrite`` retargeted it, its target
    otherwise."""
    return node.meta.get(OVERLOAD, node.target)


def rewrite(graph: Graph) -> int:
    """Point every ``call_function`` node of ``graph`` whose overload ``BINDINGS`` lists at its binding, keeping the
    overload in ``node.meta["overload"]``; returns how many. Before the graph module's code is generated (the code
    is generated from the targets)."""
    count = 0
    for node in graph.nodes:
        if node.op != "call_function" or OVERLOAD in node.meta:
            continue
        binding = BINDINGS.get(node.target)
        if binding is None or _REFUSED_KEYWORDS.get(node.target, set()) & node.kwargs.keys():
            continue
        node.meta[OVERLOAD] = node.target
        node.target = binding
        count += 1
    return count


__all__ = ["BINDINGS", "OVERLOAD", "overload", "rewrite"]
