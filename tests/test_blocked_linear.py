"""runtime/backends/blocked_linear.py: the FP32 and BF16 linear on weights packed in blocks of 16 features, compiled
for this CPU at load. Its products against a float64 reference (BF16: no further from it than ``aten.linear``), its
bits the same at every row count, its pack undone exactly, a row-parallel projection's leaves, a core loaded on it,
and the path refused with its reason where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from ignition.runtime.backends import blocked_linear, native_build
from ignition.runtime.backends.native_build import NativeUnavailable
from ignition.runtime.backends.gemm_calibration import BLOCKED
from ignition.runtime.options import LoadOptionError, LoadOptions

pytestmark = pytest.mark.skipif(blocked_linear.unavailable() is not None,
                                reason=f"the blocked product cannot be built here: {blocked_linear.unavailable()}")

SHAPES = [(37, 19, 1), (100, 64, 3), (16, 1, 2), (1000, 300, 33), (64, 1024, 300), (512, 256, 8)]
"""(out, in, rows): a partial last block, rows that are not a chunk's multiple, K of one, more rows than a tile."""


@pytest.mark.parametrize("out_features,in_features,rows", SHAPES)
def test_the_product_is_the_linear_to_fp32_rounding_and_a_rows_bits_ignore_its_batch(out_features, in_features,
                                                                                     rows):
    generator = torch.Generator().manual_seed(out_features * 7 + rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    packed = blocked_linear.pack(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    assert torch.equal(blocked_linear.unpack(packed, out_features), weight)
    for b in (None, bias):
        y = blocked_linear.blocked_linear(x, packed, b, out_features)
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        # one FP32 FMA chain over K terms of size ~1: within K * 2^-24 of the sum's magnitude, far under aten's 1e-3
        bound = 4 * in_features * 2.0 ** -24 * (x.abs().double() @ weight.abs().double().T + 1)
        assert ((y.double() - exact).abs() <= bound).all()
        alone = torch.cat([blocked_linear.blocked_linear(x[i:i + 1], packed, b, out_features) for i in range(rows)])
        assert torch.equal(alone, y)  # a row's bits do not depend on the rows beside it


def _rebuild(flags: tuple[str, ...]) -> None:
    """Build (or take from the cache) the product with ``flags`` and use it from here on."""
    blocked_linear.FLAGS = flags
    for cached in (blocked_linear.library, blocked_linear.unavailable, blocked_linear.bf16_pairs):
        cached.cache_clear()
    blocked_linear._functions.clear()


@pytest.fixture(params=["native", "widened"])
def bf16_build(request):
    """The BF16 product as this CPU builds it and, where that build multiplies in k pairs (AVX512-BF16), the build of
    a CPU without those instructions (``-mno-avx512bf16``: each BF16 value widened to FP32), the other family's
    path on this machine."""
    native = blocked_linear.FLAGS
    if request.param == "widened":
        if not blocked_linear.bf16_pairs():
            pytest.skip("this CPU's build already widens BF16 (no AVX512-BF16)")
        _rebuild((*native, "-mno-avx512bf16"))
        assert not blocked_linear.bf16_pairs()
    yield request.param
    if request.param == "widened":
        _rebuild(native)


@pytest.mark.parametrize("out_features,in_features,rows", SHAPES)
def test_the_bf16_product_rounds_the_fp32_sum_once_no_further_from_exact_than_aten(out_features, in_features, rows,
                                                                                   bf16_build):
    """A BF16 weight and input, multiplied exactly (widened, or two k at a time by VDPBF16PS), summed as FP32, plus
    the bias, rounded to nearest even once: every output within half a BF16 ulp of the exact sum (plus the FP32 sum's
    own error), and on the whole no further from it than ``aten.linear``'s BF16 product (which accumulates in FP32
    too, in another order); a row's bits the same at every row count. In k pairs an odd K is refused."""
    generator = torch.Generator().manual_seed(out_features * 5 + rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    if blocked_linear.bf16_pairs() and in_features % 2:
        assert not blocked_linear.blocks(weight.shape, weight.dtype)
        with pytest.raises(ValueError, match=rf"needs an even K, got \({out_features}, {in_features}\)"):
            blocked_linear.pack(weight)
        return
    packed = blocked_linear.pack(weight)
    assert packed.dtype == torch.bfloat16 and torch.equal(blocked_linear.unpack(packed, out_features), weight)
    ours_total = theirs_total = 0.0
    for b in (None, bias):
        y = blocked_linear.blocked_linear(x, packed, b, out_features)
        assert y.dtype == torch.bfloat16
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        fp32_bound = 4 * in_features * 2.0 ** -24 * (x.abs().double() @ weight.abs().double().T + 2)
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 2 * fp32_bound).all()
        ours_total += float((y.double() - exact).abs().sum())
        theirs_total += float((torch.nn.functional.linear(x, weight, b).double() - exact).abs().sum())
        alone = torch.cat([blocked_linear.blocked_linear(x[i:i + 1], packed, b, out_features) for i in range(rows)])
        assert torch.equal(alone, y)
    assert ours_total <= 1.02 * theirs_total + 1e-6, (ours_total, theirs_total)


def _products(dtype: torch.dtype) -> list[torch.Tensor]:
    """The blocked products of a few shapes, row counts and leaves in ``dtype`` on the current build (each weight
    packed by that build)."""
    found = []
    for out_features, in_features, rows in [(37, 20, 1), (100, 64, 3), (48, 64, 7), (1000, 300, 33), (64, 1024, 300)]:
        generator = torch.Generator().manual_seed(out_features + rows)
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        packed = blocked_linear.pack(weight)
        found += [blocked_linear.blocked_linear(x, packed, b, out_features) for b in (None, bias)]
        found.append(blocked_linear.blocked_leaves(x, packed, out_features, 2))
        found.append(blocked_linear.blocked_row_linear(x, packed, bias, out_features, 4))
    return found


def test_the_avx2_build_returns_the_avx512_builds_bits():
    """The register tiles follow the instruction set (AVX-512: 16-float sums in 8 x 2 tiles; AVX2: two 8-float
    halves in 4 x 1), never an output's order: on an AVX-512 CPU the AVX2 family's build (``-mno-avx512f``) returns the
    native build's FP32 bits, and its widened BF16 the bits of the native build without VDPBF16PS."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 here: this CPU's build is the AVX2 one")
    native = blocked_linear.FLAGS
    try:
        _rebuild((*native, "-mno-avx512bf16"))
        expected = {dtype: _products(dtype) for dtype in blocked_linear.DTYPES}
        _rebuild((*native, "-mno-avx512f"))
        assert not blocked_linear.bf16_pairs()
        for dtype in blocked_linear.DTYPES:
            for got, want in zip(_products(dtype), expected[dtype], strict=True):
                assert torch.equal(got, want), dtype
    finally:
        _rebuild(native)


@pytest.mark.parametrize("out_features,in_features,rows,leaves", [(40, 64, 3, 4), (1000, 256, 1, 8), (24, 32, 17, 2),
                                                                  (33, 48, 9, 1), (48, 64, 6, 4)])
def test_the_leaves_are_each_slices_product_one_chain_whatever_the_rows(out_features, in_features, rows, leaves):
    """``blocked_leaves``: what ``row_linear``'s batched product returns (to FP32 order), each leaf bit for bit the
    blocked product of its slice alone (a tensor-parallel rank's shard), and a row's leaves the same alone."""
    generator = torch.Generator().manual_seed(in_features + rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    step = in_features // leaves
    got = blocked_linear.blocked_leaves(x, blocked_linear.pack(weight), out_features, leaves)
    batched = torch.bmm(x.reshape(-1, leaves, step).transpose(0, 1), weight.view(out_features, leaves, step)
                        .permute(1, 2, 0))
    torch.testing.assert_close(got, batched, rtol=1e-5, atol=1e-5)
    for leaf in range(leaves):
        columns = slice(leaf * step, (leaf + 1) * step)
        shard = blocked_linear.pack(weight[:, columns].contiguous())
        assert torch.equal(got[leaf], blocked_linear.blocked_linear(x[:, columns].contiguous(), shard, None,
                                                                    out_features))
    alone = torch.cat([blocked_linear.blocked_leaves(x[i:i + 1], blocked_linear.pack(weight), out_features, leaves)
                       for i in range(rows)], dim=1)
    assert torch.equal(alone, got)
    with pytest.raises(ValueError, match=rf"5 reduction leaves do not divide the weight's {in_features} inputs"):
        blocked_linear.blocked_leaves(x, blocked_linear.pack(weight), out_features, 5)


@pytest.mark.parametrize("rows", [1, 3, 7, 9, 20])
@pytest.mark.parametrize("leaves", [2, 4, 8])
def test_the_row_linear_is_row_linears_tree_of_the_leaves_bit_for_bit(rows, leaves):
    """``blocked_row_linear``: the leaves of ``blocked_leaves``, the bias added to leaf 0, summed as
    ``recipes/layers.py`` ``row_linear`` sums them (``parts[0::2] + parts[1::2]`` until one is left), bit for bit."""
    generator = torch.Generator().manual_seed(rows * 10 + leaves)
    weight, x = torch.randn(70, 128, generator=generator), torch.randn(rows, 128, generator=generator)
    packed = blocked_linear.pack(weight)
    for bias in (None, torch.randn(70, generator=generator)):
        parts = blocked_linear.blocked_leaves(x, packed, 70, leaves)
        if bias is not None:
            parts = torch.cat((parts[:1] + bias, parts[1:]))
        while parts.shape[0] > 1:
            parts = parts[0::2] + parts[1::2]
        assert torch.equal(blocked_linear.ROW_LINEAR_TARGET(x, packed, bias, 70, leaves), parts)
    with pytest.raises(ValueError, match=r"3 reduction leaves of the weight's 128 inputs: expected a power of two up "
                                         r"to 16 that divides them"):
        blocked_linear.ROW_LINEAR_TARGET(x, packed, None, 70, 3)


def test_the_op_takes_leading_dimensions_and_strided_rows_and_shows_in_the_profiler():
    weight, x = torch.randn(40, 24), torch.randn(2, 3, 48)[..., ::2]  # non-contiguous [2, 3, 24]
    packed = blocked_linear.pack(weight)
    with torch.profiler.profile() as profile:
        y = blocked_linear.TARGET(x, packed, None, 40)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert "ignition::blocked_linear" in {event.key for event in profile.key_averages()}
    with torch.profiler.profile() as profile:  # what graphs call, without the dispatcher, under the same names
        assert torch.equal(blocked_linear.graph_linear(x, packed, None, 40), y)
        assert torch.equal(blocked_linear.graph_leaves(x, packed, 40, 2), blocked_linear.LEAVES_TARGET(x, packed, 40, 2))
    assert {"ignition::blocked_linear", "ignition::blocked_leaves"} <= {event.key for event in profile.key_averages()}
    assert set(blocked_linear.GRAPH_CALLS.values()) == {"ignition::blocked_linear", "ignition::blocked_leaves",
                                                        "ignition::blocked_row_linear"}
    from benchmarks._steps import MATRIX_PRODUCTS  # the benchmarks' matrix-product share counts every one

    assert set(blocked_linear.GRAPH_CALLS.values()) <= set(MATRIX_PRODUCTS)
    assert blocked_linear.TARGET(x[:, :0], packed, None, 40).shape == (2, 0, 40)
    with pytest.raises(ValueError, match=r"packs a 2-D float32 or bfloat16 weight, got \(40, 24\) torch.float16"):
        blocked_linear.pack(weight.half())
    with pytest.raises(ValueError, match=r"multiplies torch.float32 rows by a torch.bfloat16 weight; expected one"):
        blocked_linear.TARGET(x, blocked_linear.pack(weight.bfloat16()), None, 40)


def test_a_machine_without_a_compiler_is_told_why_and_the_forced_mode_refused(monkeypatch):
    from ignition.runtime import options

    options.native_kernels_unavailable()  # this process's builds, made (or found) before $CC is hidden
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(NativeUnavailable, match=r"\$CC=no-such-cc is not on PATH \(set \$CC"):
        native_build.compiler()
    monkeypatch.setattr(blocked_linear, "unavailable", lambda: "no C compiler: no cc or gcc on PATH (set $CC to one)")
    assert not blocked_linear.blocks_dtype(torch.float32)
    with pytest.raises(LoadOptionError, match=r"--gemm blocked needs the blocked product, which this machine cannot "
                                              r"build: no C compiler: .*; use --gemm calibrate, packed or aten"):
        LoadOptions.create("cpu", gemm=BLOCKED)
    assert LoadOptions.create("cpu").gemm == "calibrate"  # the calibration just does not offer the path
    monkeypatch.setattr(options, "native_kernels_unavailable", lambda: "no C compiler")
    assert not LoadOptions.create("cpu").native_kernels  # attention and norms stay on ATen's kernels


def test_a_core_loaded_on_the_blocked_product_keeps_its_logprobs(tmp_path_factory, monkeypatch):
    """Every projection and the tied LM head of an FP32 core run blocked (``--gemm blocked``, no size floor; o_proj and
    down_proj as their reduction leaves, summed): the
    greedy tokens and the logprobs are the plain core's to FP32 summation order, and the raw embedding the lookup
    reads is kept exact beside the LM head's blocked copy."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    from ignition.runtime.backends import packed_linear
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("blocked")
    save_checkpoint(TinyCase("qwen3", torch.float32, True, 300), root / "ckpt")  # tied: the LM head is the embedding
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=16,
                              max_seq_len=64), root / "core")
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    blocked, plain = load_core(root / "core", gemm=BLOCKED), load_core(root / "core", pack_linears=False)
    for name, variant in blocked.variants.items():
        targets = [n.target for n in variant.runner.graph_module.graph.nodes if n.op == "call_function"
                   and "linear" in getattr(n.target, "__name__", str(n.target))]
        assert targets and set(targets) == {blocked_linear.graph_linear, blocked_linear.graph_row_linear}, name
    embedding = next(name for name in blocked.weights if "embed" in name)
    assert torch.equal(blocked.weights[embedding], plain.weights[embedding])
    requests = [Request([i + 1, 7, 9, 11 + i], max_tokens=6, logprobs=5, ignore_eos=True) for i in range(5)]
    for ours, theirs in zip(Engine(blocked).generate(requests), Engine(plain).generate(requests), strict=True):
        assert [e.id for e in ours.entries] == [e.id for e in theirs.entries]
        torch.testing.assert_close(torch.tensor([e.logprob for e in ours.entries]),
                                   torch.tensor([e.logprob for e in theirs.entries]), rtol=0, atol=2e-5)


def test_an_unwritable_cache_directory_only_withholds_the_path(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("IGNITION_CACHE_DIR", str(tmp_path / "file"))  # its kernels/ cannot be made
    blocked_linear.library.cache_clear()
    blocked_linear.unavailable.cache_clear()
    try:
        assert blocked_linear.unavailable().startswith(f"building into {tmp_path / 'file' / 'kernels'} failed")
        assert not blocked_linear.blocks_dtype(torch.float32)
    finally:
        monkeypatch.undo()
        blocked_linear.library.cache_clear()
        blocked_linear.unavailable.cache_clear()
    assert blocked_linear.unavailable() is None


def test_a_bf16_core_on_the_blocked_product_strays_from_fp32_no_further_than_on_atens(tmp_path_factory, monkeypatch):
    """BF16 fidelity of a whole core: its prompt logprobs' deviation from the same weights' FP32 core, every
    projection and the LM head on the blocked product (``--gemm blocked``, no size floor), is no larger than with
    every one on ``aten.linear`` (2% on the mean, one BF16 ulp of the largest logprob at worst)."""
    from ignition.runtime.backends import packed_linear
    from ignition.runtime.backends.gemm_calibration import ATEN
    from ignition.runtime.core import load_core
    from tests._decoder_cores import bf16_cores_with_fp32_reference, prompt_scores

    bf16, fp32, prompts = bf16_cores_with_fp32_reference(tmp_path_factory.mktemp("blocked_bf16"))
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)

    def scores(core) -> torch.Tensor:
        return prompt_scores(core, prompts)

    reference = scores(load_core(fp32, pack_linears=False))
    blocked_core = load_core(bf16, gemm=BLOCKED)
    assert any(n.target is blocked_linear.graph_linear for v in blocked_core.variants.values()
               for n in v.runner.graph_module.graph.nodes)
    ours, theirs = (scores(blocked_core) - reference).abs(), (scores(load_core(bf16, gemm=ATEN))
                                                             - reference).abs()
    assert float(ours.mean()) <= 1.02 * float(theirs.mean()), (float(ours.mean()), float(theirs.mean()))
    assert float(ours.max()) <= float(theirs.max()) + float(reference.abs().max()) * 2.0 ** -7
