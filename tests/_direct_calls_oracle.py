"""The oracle of ``runtime/backends/direct_calls.py``: each variant of a loaded core run on its graph as the loader
rewrote it (bindings) and on the graph as it was read (overloads), on copies of the same buffers, must make the same
ATen calls in the same order and leave the same bits in its outputs and in every buffer it writes."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ignition.runtime.backends import direct_calls


class _Calls(TorchDispatchMode):
    """Records every operator that reaches the dispatcher's Python key, in order (a higher-order operator, ``cond``,
    as one call: its branches are graph modules of their own, which the rewrite leaves as they are)."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def restored(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes call the overloads ``direct_calls.rewrite`` replaced: the graph as it was
    read."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    for node in copy.nodes:
        if direct_calls.OVERLOAD in node.meta:
            node.target = node.meta.pop(direct_calls.OVERLOAD)
    return copy


def _run(graph_module, variant):
    buffers = {name: value.clone() if isinstance(value, torch.Tensor) else value
               for name, value in variant.buffers.items()}
    with torch.inference_mode(), _Calls() as recorder:
        result = graph_module(*[buffers[name] for name in variant.runner.names])
    return recorder.calls, pytree.tree_leaves(result), buffers


def assert_direct_calls_dispatch_as_overloads(core) -> int:
    """Every variant of ``core`` (loaded on the CPU with the pt2 backend, after some requests ran so that its
    buffers hold real inputs): the same calls and bits both ways. Returns how many nodes the variants rewrote."""
    rewritten = 0
    for name, variant in core.variants.items():
        module = variant.runner.graph_module
        nodes = [n for n in module.graph.nodes if direct_calls.OVERLOAD in n.meta]
        assert all(n.target is direct_calls.BINDINGS[n.meta[direct_calls.OVERLOAD]] for n in nodes), name
        rewritten += len(nodes)
        original = torch.fx.GraphModule(module, restored(module.graph))
        assert not any(direct_calls.OVERLOAD in n.meta for n in original.graph.nodes)
        calls, outputs, buffers = _run(module, variant)
        their_calls, their_outputs, their_buffers = _run(original, variant)
        assert calls == their_calls, f"variant {name}: the rewritten graph dispatches other operators"
        for mine, theirs in zip([*outputs, *buffers.values()], [*their_outputs, *their_buffers.values()], strict=True):
            if isinstance(mine, torch.Tensor):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
    return rewritten
