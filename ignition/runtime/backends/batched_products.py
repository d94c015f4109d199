"""CPU replay: a BF16 or FP16 graph's batched products (attention's ``bmm``: the scores ``q @ k^T`` and the mix
``p @ v``) taken on FP32 copies of their operands where that measured faster on the machine.

``torch.bmm`` in BF16 multiplies exactly, sums in FP32 and rounds each output once; so does ``widened_bmm``, on
FP32 copies, with FP32's product (MKL). They differ only in the order of an output's FP32 sum (BF16 promises no bits
across kernels, docs/recipes.md). Where the CPU has no BF16 dot product (AVX2, or AVX-512 without AVX512-BF16), ATen's
BF16 ``bmm`` is a loop of small products, and widening is the faster form: on an AMD EPYC (Zen 2) host a decode
step's ``[8, 2, 128] @ [8, 128, 300]`` took 242 us in BF16 and 109 us widened, ``[8, 2, 300] @ [8, 300, 128]`` 594
and 108 us. Which form a shape takes is ``GemmPlan.batched_path``'s choice, timed at load and cached per CPU, like a
linear's path; ``rewrite`` retargets the graph's ``bmm`` nodes that it widens.
"""

from __future__ import annotations

import torch
from torch.fx import Graph

from ignition.validate.graph_json import FACTS

WIDENED = "fp32"
"""The path of a batched product on FP32 copies of its operands, rounded once (``widened_bmm``); the other is
``aten``, ``torch.bmm`` in the operands' dtype."""
BATCHED_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes whose batched products may be widened."""
BMM = torch.ops.aten.bmm.default


def widened_bmm(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(first, second)`` summed in FP32 on FP32 copies and rounded once to their dtype."""
    return torch.bmm(first.float(), second.float()).to(first.dtype)


def rewrite(graph: Graph, plan) -> int:
    """Point each ``bmm`` node of ``graph`` whose operands are one dtype of ``BATCHED_DTYPES`` and whose shapes
    ``plan.batched_path`` (a ``GemmPlan``) widens at ``widened_bmm``; returns how many. Before the graph module's code
    is generated."""
    count = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not BMM:
            continue
        facts = [getattr(argument, "meta", {}).get(FACTS) for argument in node.args[:2]]
        if any(fact is None for fact in facts) or facts[0].dtype != facts[1].dtype or \
                facts[0].dtype not in BATCHED_DTYPES:
            continue
        if plan.batched_path(facts[0].shape, facts[1].shape, facts[0].dtype) == WIDENED:
            node.target = widened_bmm
            count += 1
    return count


__all__ = ["BATCHED_DTYPES", "BMM", "WIDENED", "rewrite", "widened_bmm"]
