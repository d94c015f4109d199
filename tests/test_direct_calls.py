"""A CPU core's graphs call torch's Python bindings in place of the ATen overloads the table lists
(``runtime/backends/direct_calls.py``): the same operators in the same order, the same bits."""

from __future__ import annotations

import torch

from ignition.runtime.backends import direct_calls
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads, restored


def test_every_binding_is_a_builtin_that_reaches_its_overload():
    for overload, binding in direct_calls.BINDINGS.items():
        assert isinstance(overload, torch._ops.OpOverload)
        assert type(binding).__name__ in ("builtin_function_or_method", "method_descriptor", "wrapper_descriptor"), \
            f"{overload}: {binding} is Python code, no cheaper than the overload"


def test_the_toy_cores_graphs_dispatch_as_their_overloads(toy_core):
    core = load_core(toy_core)
    Engine(core).generate([Request([1, 2, 3, 4, 5], max_tokens=4, logprobs=3, ignore_eos=True),
                           Request([6, 7], max_tokens=3, ignore_eos=True)])
    assert assert_direct_calls_dispatch_as_overloads(core) > 0


def test_a_node_keeps_its_overload_and_a_refused_keyword_keeps_the_call():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    viewed = graph.call_function(torch.ops.aten.view.default, (x, [2, 2]))
    expanded = graph.call_function(torch.ops.aten.expand.default, (viewed, [2, 2]), {"implicit": True})
    sliced = graph.call_function(torch.ops.aten.slice.Tensor, (expanded, 0, 0, 1))
    graph.output(sliced)
    assert direct_calls.rewrite(graph) == 1 and direct_calls.rewrite(graph) == 0
    assert viewed.target is torch.Tensor.view and direct_calls.overload(viewed) is torch.ops.aten.view.default
    assert direct_calls.overload(expanded) is expanded.target is torch.ops.aten.expand.default
    assert sliced.target is torch.ops.aten.slice.Tensor
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert torch.equal(module(torch.arange(4.0)), torch.tensor([[0.0, 1.0]]))
    assert [n.target for n in restored(graph).nodes if n.op == "call_function"] == \
        [torch.ops.aten.view.default, torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor]


def test_the_moe_cores_graphs_dispatch_as_their_overloads(moe_cores):
    for recipe, (_, root) in moe_cores.items():
        core = load_core(root)
        Engine(core).generate([Request([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], max_tokens=3, logprobs=2, ignore_eos=True,
                                       prompt_logprobs=1)])
        assert assert_direct_calls_dispatch_as_overloads(core) > 0, recipe


def test_the_benchmark_times_both_ways_and_finds_the_same_bits():
    from benchmarks.direct_calls import CALLS, measure

    rows = measure(number=20, repeats=1)
    assert [row[0] for row in rows] == [what for what, _, _ in CALLS]
    assert all(overload > 0 and binding > 0 and same for _, overload, binding, same in rows)
