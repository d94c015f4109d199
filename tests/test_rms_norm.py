"""RMSNorm in one native call (``runtime/backends/rms_norm.py``): ATen's chain of six ops (FP32) or nine (BF16, as
transformers writes it) to the order of the sum of squares, each row's bits its own, the rotary embedding after it
ATen's bit for bit, bad input refused by name, and every norm of a core's graphs rewritten onto it, prompt chunks and
decode steps alike, with the logprobs kept."""

from __future__ import annotations

import pytest
import torch

from ignition.runtime.backends import rms_norm
from ignition.runtime.backends.rms_norm import graph_rms_norm, graph_rms_norm_rope, rms_norm as norm, rms_norm_rope

pytestmark = pytest.mark.skipif(rms_norm.unavailable() is not None,
                                reason=f"no RMSNorm kernel here: {rms_norm.unavailable()}")
EPS = float(torch.tensor(1e-6, dtype=torch.float32))


def atens(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The recipes' chain as the graphs run it (recipes/layers.py)."""
    total = torch.mul(x, x).sum(-1, keepdim=True)
    scale = torch.rsqrt(torch.addcdiv(torch.tensor(eps), total, torch.tensor(float(x.shape[-1]))))
    return weight * (x * scale)


def atens_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The BF16 chain as the graphs run it: transformers' (widened, normed in FP32, rounded, times the weight)."""
    return weight * atens(x.float(), torch.tensor(1.0), eps).to(torch.bfloat16)


@pytest.mark.parametrize("shape, weight_shape", [((3, 1024), (1024,)), ((2, 24, 128), (24, 128)),
                                                 ((5, 7, 20), (20,)), ((1, 13), (13,))])
def test_it_is_atens_chain_to_the_order_of_the_sum(shape, weight_shape):
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=generator) * 3, torch.randn(weight_shape, generator=generator)
    ours = norm(x, weight, EPS, float(shape[-1]))
    exact = atens(x.double(), weight.double(), EPS)
    assert ours.shape == x.shape and ours.dtype == torch.float32
    # one FP32 sum of n squares and four roundings: a few ulp of each output
    torch.testing.assert_close(ours, exact.float(), rtol=4 * shape[-1] ** 0.5 * 2.0 ** -24, atol=1e-30)
    assert (ours - atens(x, weight)).abs().max() <= (exact.float() - atens(x, weight)).abs().max() + \
        4 * 2.0 ** -24 * exact.abs().max()
    # the eps and the count are the ones given
    assert not torch.equal(norm(x, weight, 1e-2, float(shape[-1])), ours)
    assert not torch.equal(norm(x, weight, EPS, float(shape[-1]) + 1), ours)


@pytest.mark.parametrize("shape, weight_shape", [((3, 1024), (1024,)), ((2, 24, 128), (24, 128)),
                                                 ((5, 7, 20), (20,))])
def test_in_bf16_it_is_transformers_chain_to_one_bf16_ulp(shape, weight_shape):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=generator) * 3).bfloat16()
    weight = torch.randn(weight_shape, generator=generator).bfloat16()
    ours, theirs = norm(x, weight, EPS, float(shape[-1])), atens_bf16(x, weight)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    # only the FP32 sum's order differs: where that moves the norm across a BF16 rounding, by one BF16 ulp of it
    # and of the weight's product (2 ** -7 relative); it does so rarely
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2.0 ** -6, atol=0)
    assert (ours != theirs).float().mean() < 0.01
    # the weight's product is rounded to BF16, not taken on the FP32 norm
    unrounded = (weight.float() * atens(x.float(), torch.tensor(1.0))).bfloat16()
    assert not torch.equal(ours, unrounded)
    exact = torch.tensor([[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0, 1.5]]).bfloat16()  # an exact FP32 sum
    assert torch.equal(norm(exact, torch.linspace(-1, 1, 9).bfloat16(), EPS, 9.0),
                       atens_bf16(exact, torch.linspace(-1, 1, 9).bfloat16()))


def test_where_the_sum_is_exact_it_is_atens_bits():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0, 1.5]])  # squares and their sums exact in FP32
    weight = torch.linspace(-1, 1, 9)
    assert torch.equal(norm(x, weight, EPS, 9.0), atens(x, weight))


def test_a_rows_bits_are_its_own_whatever_the_rows_and_threads_beside_it():
    x, weight = torch.randn(300, 1024), torch.randn(1024)
    whole = norm(x, weight, EPS, 1024.0)  # parallel over rows
    assert all(torch.equal(norm(x[i:i + 1], weight, EPS, 1024.0), whole[i:i + 1]) for i in (0, 17, 299))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(norm(x, weight, EPS, 1024.0), whole)
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(1024, 300).t()
    strided.copy_(x)
    assert torch.equal(norm(strided, weight, EPS, 1024.0), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [64, 5, -3])
def test_the_rotary_embedding_after_it_is_atens_mul_roll_mul_add_bit_for_bit(shift, dtype):
    generator = torch.Generator().manual_seed(shift % 7)
    x, weight = torch.randn(3, 24, 128, generator=generator), torch.randn(24, 128, generator=generator)
    cos, sin = torch.randn(3, 1, 128, generator=generator), torch.randn(3, 1, 128, generator=generator)
    x, weight, cos, sin = (t.to(dtype) for t in (x, weight, cos, sin))
    normed = norm(x, weight, EPS, 128.0)
    rotated = rms_norm_rope(x, weight, EPS, 128.0, cos, sin, 24, shift)
    assert torch.equal(rotated, normed * cos + torch.roll(normed, [shift], [-1]) * sin)
    full = cos.expand(3, 24, 128).contiguous(), sin.expand(3, 24, 128).contiguous()  # a trig row for every row
    assert torch.equal(rms_norm_rope(x, weight, EPS, 128.0, *full, 1, shift), rotated)
    with pytest.raises(ValueError, match=r"one row of 128 per 24 rows of x \(3, 24, 128\); got cos \(2, 1, 128\)"):
        rms_norm_rope(x, weight, EPS, 128.0, cos[:2], sin, 24, shift)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match=rf"takes {dtype} cos and sin \(x's dtype\).*got sin \(3, 1, 128\) {other}"):
        rms_norm_rope(x, weight, EPS, 128.0, cos, sin.to(other), 24, shift)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"both float32 or both bfloat16; got x \(2, 8\) torch.bfloat16, weight "
                                         r"\(8,\) torch.float32"):
        norm(torch.randn(2, 8).bfloat16(), torch.randn(8), EPS, 8.0)
    with pytest.raises(ValueError, match=r"got x \(2, 8\) torch.float16"):
        norm(torch.randn(2, 8).half(), torch.randn(8).half(), EPS, 8.0)
    with pytest.raises(ValueError, match=r"trailing extents, both float32 or both bfloat16; got x \(2, 8\) "
                                         r"torch.float32, weight \(4,\)"):
        norm(torch.randn(2, 8), torch.randn(4), EPS, 8.0)


def test_the_rewrite_takes_the_chain_and_leaves_a_chain_read_elsewhere():
    graph = torch.fx.Graph()
    from ignition.validate.graph_json import FACTS, TensorFacts

    aten = torch.ops.aten
    x, weight, positions = graph.placeholder("x"), graph.placeholder("weight"), graph.placeholder("positions")
    x.meta[FACTS], weight.meta[FACTS] = TensorFacts(torch.float32, (2, 8)), TensorFacts(torch.float32, (8,))
    eps = graph.call_function(aten.new_full.default, (positions, [], 1e-6), {"dtype": torch.float32})
    count = graph.call_function(aten.new_full.default, (positions, [], 8), {"dtype": torch.float32})
    outputs = []
    for reread in (False, True):
        squares = graph.call_function(aten.mul.Tensor, (x, x))
        total = graph.call_function(aten.sum.dim_IntList, (squares, [-1], True))
        mean = graph.call_function(aten.addcdiv.default, (eps, total, count))
        root = graph.call_function(aten.rsqrt.default, (mean,))
        scaled = graph.call_function(aten.mul.Tensor, (x, root))
        normed = graph.call_function(aten.mul.Tensor, (weight, scaled))
        normed.meta[FACTS] = TensorFacts(torch.float32, (2, 8))
        outputs += [normed, root] if reread else [normed]  # the second chain's rsqrt is an output too
    graph.output(tuple(outputs))
    assert rms_norm.rewrite(graph) == 1
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls.count(graph_rms_norm) == 1 and calls.count(aten.rsqrt.default) == 1
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = torch.randn(2, 8), torch.randn(8), torch.zeros(2, dtype=torch.int64)
    first, second, _ = module(*inputs)
    torch.testing.assert_close(first, second, rtol=4e-7, atol=0)
    torch.testing.assert_close(first, atens(*inputs[:2]), rtol=4e-7, atol=0)


def test_the_rewrite_takes_transformers_bf16_chain_and_leaves_one_whose_fp32_copy_is_read_elsewhere():
    from ignition.validate.graph_json import FACTS, TensorFacts

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, weight, positions = graph.placeholder("x"), graph.placeholder("weight"), graph.placeholder("positions")
    x.meta[FACTS], weight.meta[FACTS] = TensorFacts(torch.bfloat16, (2, 8)), TensorFacts(torch.bfloat16, (8,))
    eps = graph.call_function(aten.new_full.default, (positions, [], 1e-6), {"dtype": torch.float32})
    count = graph.call_function(aten.new_full.default, (positions, [], 8), {"dtype": torch.float32})
    outputs = []
    for reread in (False, True):
        wide = graph.call_function(aten.to.dtype, (x, torch.float32))
        wide.meta[FACTS] = TensorFacts(torch.float32, (2, 8))
        squares = graph.call_function(aten.mul.Tensor, (wide, wide))
        total = graph.call_function(aten.sum.dim_IntList, (squares, [-1], True))
        mean = graph.call_function(aten.addcdiv.default, (eps, total, count))
        root = graph.call_function(aten.rsqrt.default, (mean,))
        rounded = graph.call_function(aten.to.dtype, (graph.call_function(aten.mul.Tensor, (wide, root)),
                                                      torch.bfloat16))
        normed = graph.call_function(aten.mul.Tensor, (weight, rounded))
        normed.meta[FACTS] = TensorFacts(torch.bfloat16, (2, 8))
        outputs += [normed, wide] if reread else [normed]  # the second chain's FP32 copy is an output too
    graph.output(tuple(outputs))
    assert rms_norm.rewrite(graph) == 1
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls.count(graph_rms_norm) == 1 and calls.count(aten.rsqrt.default) == 1
    assert calls.count(aten.to.dtype) == 2  # the left chain's two casts
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), torch.zeros(2, dtype=torch.int64)
    first, second, _ = module(*inputs)
    assert first.dtype == torch.bfloat16
    torch.testing.assert_close(first.float(), second.float(), rtol=2.0 ** -6, atol=0)
    torch.testing.assert_close(first.float(), atens_bf16(*inputs[:2]).float(), rtol=2.0 ** -6, atol=0)


@pytest.fixture(scope="module")
def qwen3_core(tmp_path_factory):
    from tests._decoder_cores import fp32_qwen3_core

    return fp32_qwen3_core(tmp_path_factory.mktemp("rms-qwen3"))


def test_every_norm_of_a_core_runs_native_and_keeps_the_logprobs(qwen3_core):
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    native, plain = load_core(qwen3_core), load_core(qwen3_core, native_kernels=False)
    layers = native.manifest["model"]["num_layers"]
    # a layer's two norms and its heads' one (its rotary embedding folded in), and the final norm
    for variant in native.variants.values():
        nodes = list(variant.runner.graph_module.graph.nodes)
        assert sum(node.target is graph_rms_norm for node in nodes) == 2 * layers + 1, variant.name
        assert sum(node.target is graph_rms_norm_rope for node in nodes) == layers, variant.name  # the heads' norm
        assert not any(getattr(node.target, "__name__", "") in ("rsqrt", "roll") for node in nodes), variant.name
    requests = [Request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=30, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True), Request([6, 7], max_tokens=20, logprobs=3, ignore_eos=True)]
    for ours, theirs in zip(Engine(native).generate(requests), Engine(plain).generate(requests), strict=True):
        assert [e.id for e in ours.entries] == [e.id for e in theirs.entries]
        torch.testing.assert_close(torch.tensor([e.logprob for e in ours.entries]),
                                   torch.tensor([e.logprob for e in theirs.entries]), rtol=0, atol=2e-5)
        ours_prompt = [e["logprob"] for e in ours.prompt_entries or [] if e is not None]
        theirs_prompt = [e["logprob"] for e in theirs.prompt_entries or [] if e is not None]
        assert len(ours_prompt) == len(theirs_prompt)
        torch.testing.assert_close(torch.tensor(ours_prompt), torch.tensor(theirs_prompt), rtol=0, atol=2e-5)
