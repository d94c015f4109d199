"""Decode attention on the KV pool in place (``runtime/backends/paged_attention.py``): in FP32, ATen's attention over
the gathered windows within FP32 rounding; in BF16, transformers' eager attention as close to an FP32 reference as
ATen's own BF16 products; each row's bits its own (whatever the rows beside it, the masked keys past it or the
threads), bad input refused by name, and a core's decode graphs rewritten onto it with their logprobs kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ignition.catalog.enums import Operation
from ignition.recipes.attention import _eager_product, gather_pages
from ignition.runtime.backends import cell_writes, paged_attention
from ignition.runtime.backends.paged_attention import graph_paged_attention, paged_attention as attend

pytestmark = pytest.mark.skipif(paged_attention.unavailable() is not None,
                                reason=f"no paged attention kernel here: {paged_attention.unavailable()}")
MINIMUM = torch.finfo(torch.float32).min
LAYERS, BLOCK = 3, 16


def pools(blocks: int, kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, blocks, BLOCK, kv_heads, head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def window_cells(groups: int, window: int, blocks: int, seed: int = 1) -> torch.Tensor:
    """Each group's window through its own blocks, in a shuffled order of the pool (a block table's cells)."""
    per_group = -(-window // BLOCK)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))[:groups * per_group]
    cells = (order.view(groups, per_group, 1) * BLOCK + torch.arange(BLOCK)).view(groups, -1)[:, :window]
    return cells.reshape(-1).contiguous()


def causal(groups: int, rows: int, window: int, last: list[int]) -> torch.Tensor:
    """``[G, 1, rows, W]``: group g's row r sees keys up to ``last[g] - rows // 2 + r // 2`` (two heads a row pair)."""
    keys = torch.arange(window).view(1, 1, 1, -1)
    seen = torch.tensor(last).view(-1, 1, 1, 1) - (rows // 2 - 1) + torch.arange(rows).view(1, 1, -1, 1) // 2
    return torch.zeros(groups, 1, rows, window).masked_fill(keys > seen, MINIMUM)


def reference(query, key_cache, value_cache, layer, cells, mask, scale=None, dtype=torch.float32):
    groups = query.shape[0]
    keys, values = (gather_pages(c, layer, cells, groups).to(dtype) for c in (key_cache, value_cache))
    return F.scaled_dot_product_attention(query.to(dtype), keys, values, attn_mask=mask.to(dtype), scale=scale)


@pytest.mark.parametrize("groups, kv_heads, rows, window, head_dim", [
    (1, 8, 2, 96, 128),  # a decode lane at Qwen3-0.6B's width
    (4, 2, 2, 64, 64),  # four lanes
    (2, 4, 10, 160, 128),  # a verify round of five tokens
    (3, 2, 16, 33, 20),  # a head_dim that is no multiple of eight, a window off the granule
])
def test_it_attends_as_atens_kernel_within_fp32_rounding(groups, kv_heads, rows, window, head_dim):
    blocks = groups * (window // BLOCK + 1) + 2
    key_cache, value_cache = pools(blocks, kv_heads, head_dim)
    cells = window_cells(groups, window, blocks)
    query = torch.randn(groups, kv_heads, rows, head_dim, generator=torch.Generator().manual_seed(2))
    mask = causal(groups, rows, window, [window - 6 - 3 * g for g in range(groups)])
    for scale in (None, 0.3):
        ours = attend(query, key_cache, value_cache, 1, cells, mask, scale)
        exact = reference(query.double(), key_cache.double(), value_cache.double(), 1, cells, mask, scale,
                          torch.float64)
        atens = reference(query, key_cache, value_cache, 1, cells, mask, scale)
        assert ours.shape == atens.shape and ours.is_contiguous()
        ours_error, atens_error = (ours.double() - exact).abs().max(), (atens.double() - exact).abs().max()
        assert ours_error <= max(4 * atens_error, 1e-6), (ours_error, atens_error)
    # a wrong scale or a dropped mask is far outside that
    assert (attend(query, key_cache, value_cache, 1, cells, mask, 0.31) - ours).abs().max() > 1e-4
    assert (attend(query, key_cache, value_cache, 1, cells, torch.zeros_like(mask), 0.3) - ours).abs().max() > 1e-3


def test_a_rows_bits_are_its_own_whatever_the_rows_keys_and_threads_beside_it():
    kv_heads, head_dim, window = 8, 128, 64
    blocks = 2 * (window // BLOCK + 2) + 2
    key_cache, value_cache = pools(blocks, kv_heads, head_dim)
    cells = window_cells(2, window + 2 * BLOCK, blocks)
    query = torch.randn(2, kv_heads, 10, head_dim)
    mask = causal(2, 10, window + 2 * BLOCK, [40, 50])
    whole = attend(query, key_cache, value_cache, 2, cells, mask)
    # one group, then only its last two rows (a decode step at the verify round's last position)
    first = attend(query[:1], key_cache, value_cache, 2, cells[:window + 2 * BLOCK], mask[:1])
    assert torch.equal(first, whole[:1])
    last = attend(query[1:, :, 8:], key_cache, value_cache, 2, cells[window + 2 * BLOCK:], mask[1:, :, 8:])
    assert torch.equal(last, whole[1:, :, 8:])
    # the window cut to its first 64 keys: every key past each row's position was masked
    narrow = cells.view(2, -1)[:, :window].reshape(-1).contiguous()
    assert torch.equal(attend(query, key_cache, value_cache, 2, narrow, mask[..., :window].contiguous()), whole)
    # a broadcast mask row, a strided query and one thread
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        strided = torch.randn(2, 10, kv_heads, head_dim).transpose(1, 2)
        strided.copy_(query)
        assert torch.equal(attend(strided, key_cache, value_cache, 2, cells, mask), whole)
    finally:
        torch.set_num_threads(threads)
    shared = mask[:1, :, :1].expand(2, 1, 10, -1)
    assert torch.equal(attend(query, key_cache, value_cache, 2, cells, shared),
                       attend(query, key_cache, value_cache, 2, cells, shared.contiguous()))


def test_a_row_with_every_key_masked_or_a_nan_key_is_atens_result():
    key_cache, value_cache = pools(8, 2, 16)
    cells = window_cells(1, 32, 8)
    query = torch.randn(1, 2, 2, 16)
    hidden = torch.full((1, 1, 2, 32), MINIMUM)
    torch.testing.assert_close(attend(query, key_cache, value_cache, 0, cells, hidden),
                               reference(query, key_cache, value_cache, 0, cells, hidden), rtol=1e-5, atol=1e-6)
    poisoned = key_cache.clone()
    poisoned[0].view(-1, 2, 16)[cells[3], 1, 5] = float("nan")  # a visible key of KV head 1
    out = attend(query, poisoned, value_cache, 0, cells, causal(1, 2, 32, [10]))
    assert out[:, 1].isnan().all() and not out[:, 0].isnan().any()


def test_bad_input_is_refused_by_name():
    key_cache, value_cache = pools(4, 2, 16)
    cells = window_cells(1, 32, 4)
    query, mask = torch.randn(1, 2, 2, 16), torch.zeros(1, 1, 2, 32)
    with pytest.raises(IndexError, match="a cell outside the layer's pool of 64 cells"):
        attend(query, key_cache, value_cache, 0, torch.cat([cells[:-1], torch.tensor([64])]), mask)
    with pytest.raises(IndexError, match="layer 3 of a pool of 3 layers"):
        attend(query, key_cache, value_cache, 3, cells, mask)
    with pytest.raises(ValueError, match=r"both float32 .* or both bfloat16 .* got query \(1, 2, 2, 16\) "
                                         r"torch.bfloat16, pools \(3, 4, 16, 2, 16\) torch.float32"):
        attend(query.bfloat16(), key_cache, value_cache, 0, cells, mask)
    with pytest.raises(ValueError, match=r"a bool mask, True where hidden.* mask \(1, 1, 2, 32\) torch.float32"):
        attend(query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), 0, cells, mask)
    with pytest.raises(ValueError, match=r"a float32 additive mask.* mask \(1, 1, 2, 32\) torch.bool"):
        attend(query, key_cache, value_cache, 0, cells, mask.bool())
    with pytest.raises(ValueError, match=r"got query \(1, 3, 2, 16\)"):  # three KV heads against the pool's two
        attend(torch.randn(1, 3, 2, 16), key_cache, value_cache, 0, cells, mask)
    with pytest.raises(ValueError, match=r"a mask \(1, 1, 2, 31\) does not broadcast against 1 groups of 2 rows "
                                         r"over 32 keys"):
        attend(query, key_cache, value_cache, 0, cells, mask[..., :31])


def eager_bf16(query, key_cache, value_cache, layer, cells, hidden, scale=None, dtype=torch.bfloat16):
    """What a BF16 graph runs without the kernel (``recipes/attention.py`` ``_eager_product`` over ``gather_pages``),
    in ``dtype``: in float32 on the BF16 values, the reference."""
    groups = query.shape[0]
    keys, values = (gather_pages(c, layer, cells, groups).to(dtype) for c in (key_cache, value_cache))
    return _eager_product(query.to(dtype), keys, values, hidden, None, scale)


@pytest.mark.parametrize("groups, kv_heads, rows, window, head_dim", [
    (1, 8, 2, 96, 128), (4, 2, 2, 64, 64), (2, 4, 10, 160, 128), (3, 2, 16, 33, 20)])
def test_in_bf16_it_is_as_close_to_fp32_as_atens_bf16_eager_attention(groups, kv_heads, rows, window, head_dim):
    """Both round the scores, the probabilities and the output to BF16 at the same points and differ in the order of
    their FP32 sums, so their deviations from the FP32 reference match: at worst one BF16 ulp apart, 2% on the mean
    (``tests/test_attention.py`` ``_assert_bf16_fidelity``'s bounds). A wrong scale is far outside that."""
    blocks = groups * (window // BLOCK + 1) + 2
    key_cache, value_cache = (pool.bfloat16() for pool in pools(blocks, kv_heads, head_dim))
    cells = window_cells(groups, window, blocks)
    query = torch.randn(groups, kv_heads, rows, head_dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    hidden = causal(groups, rows, window, [window - 6 - 3 * g for g in range(groups)]) < 0
    ours_total = atens_total = 0.0
    for scale in (None, 0.3):
        ours = attend(query, key_cache, value_cache, 1, cells, hidden, scale)
        assert ours.dtype == torch.bfloat16 and ours.shape == (groups, kv_heads, rows, head_dim)
        reference = eager_bf16(query, key_cache, value_cache, 1, cells, hidden, scale, torch.float32)
        atens = eager_bf16(query, key_cache, value_cache, 1, cells, hidden, scale)
        ours_deviation, atens_deviation = ((out.float() - reference).abs() for out in (ours, atens))
        ulp = 2.0 ** (float(torch.floor(torch.log2(reference.abs().max()))) - 7)
        assert float(ours_deviation.max()) <= float(atens_deviation.max()) + ulp
        ours_total, atens_total = ours_total + float(ours_deviation.mean()), atens_total + float(atens_deviation.mean())
    assert ours_total <= 1.02 * atens_total, (ours_total, atens_total)
    wrong = attend(query, key_cache, value_cache, 1, cells, hidden, 0.35)
    assert float((wrong.float() - reference).abs().mean()) > 5 * float(atens_deviation.mean())


def test_in_bf16_a_rows_bits_are_its_own_and_a_row_with_every_key_hidden_is_atens():
    kv_heads, head_dim, window = 4, 64, 64
    blocks = 2 * (window // BLOCK + 2) + 2
    key_cache, value_cache = (pool.bfloat16() for pool in pools(blocks, kv_heads, head_dim))
    cells = window_cells(2, window + 2 * BLOCK, blocks)
    query = torch.randn(2, kv_heads, 10, head_dim).bfloat16()
    hidden = causal(2, 10, window + 2 * BLOCK, [40, 50]) < 0
    whole = attend(query, key_cache, value_cache, 0, cells, hidden)
    last = attend(query[1:, :, 8:], key_cache, value_cache, 0, cells[window + 2 * BLOCK:], hidden[1:, :, 8:])
    assert torch.equal(last, whole[1:, :, 8:])
    narrow = cells.view(2, -1)[:, :window].reshape(-1).contiguous()
    assert torch.equal(attend(query, key_cache, value_cache, 0, narrow, hidden[..., :window].contiguous()), whole)
    everything = torch.ones(1, 1, 10, window + 2 * BLOCK, dtype=torch.bool)  # every key hidden: a uniform mix
    torch.testing.assert_close(attend(query[:1], key_cache, value_cache, 0, cells[:window + 2 * BLOCK], everything),
                               eager_bf16(query[:1], key_cache, value_cache, 0, cells[:window + 2 * BLOCK],
                                          everything), rtol=2.0 ** -7, atol=2.0 ** -9)


@pytest.fixture(scope="module")
def qwen3_core(tmp_path_factory):
    from tests._decoder_cores import fp32_qwen3_core

    return fp32_qwen3_core(tmp_path_factory.mktemp("paged-qwen3"))


def test_a_cores_decode_graphs_attend_on_the_pool_and_keep_their_logprobs(qwen3_core):
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    paged, gathering = load_core(qwen3_core), load_core(qwen3_core, native_kernels=False)
    assert paged.options.native_kernels and not gathering.options.native_kernels

    def calls(core, operation):
        return [sum(node.target is graph_paged_attention for node in variant.runner.graph_module.graph.nodes)
                for variant in core.by_operation(operation)]

    decode = calls(paged, Operation.DECODE)
    assert len(decode) == 2 and decode == [paged.manifest["model"]["num_layers"]] * 2  # one call a layer
    layers = paged.manifest["model"]["num_layers"]

    def copies(variant) -> int:
        return sum(getattr(node.target, "__name__", "").startswith("index_copy")
                   for node in variant.runner.graph_module.graph.nodes)

    for variant in paged.variants.values():  # every variant's cache writes: one call a cache and layer
        targets = [node.target for node in variant.runner.graph_module.graph.nodes]
        assert targets.count(cell_writes.write_cells) == 2 * layers, variant.name
        assert copies(variant) == copies(gathering.variants[variant.name]) - 2 * layers, variant.name
    assert not any(calls(paged, Operation.PREFILL)) and not any(calls(gathering, Operation.DECODE))
    requests = [Request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=40, logprobs=3, ignore_eos=True),
                Request([6, 7], max_tokens=30, logprobs=3, ignore_eos=True)]
    for ours, theirs in zip(Engine(paged).generate(requests), Engine(gathering).generate(requests), strict=True):
        assert [e.id for e in ours.entries] == [e.id for e in theirs.entries]
        torch.testing.assert_close(torch.tensor([e.logprob for e in ours.entries]),
                                   torch.tensor([e.logprob for e in theirs.entries]), rtol=0, atol=2e-5)


def test_a_bf16_cores_kernels_stray_from_fp32_no_further_than_atens(tmp_path_factory):
    """A BF16 core's decode graphs attend on the pool and norm in one call a norm; its greedy tokens' logprobs,
    each side's scored by the same weights' FP32 core (teacher-forced on that side's tokens), deviate from the FP32
    ones no more than with ATen's ops (``native_kernels=False``): 5% on the mean, one BF16 ulp of the largest at
    worst. So do its prompt logprobs (the norms of a prompt chunk)."""
    from ignition.runtime.backends.rms_norm import graph_rms_norm, graph_rms_norm_rope
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request
    from tests._decoder_cores import bf16_cores_with_fp32_reference, prompt_scores

    bf16, fp32, prompts = bf16_cores_with_fp32_reference(tmp_path_factory.mktemp("paged-bf16"))
    native, plain, reference = load_core(bf16), load_core(bf16, native_kernels=False), load_core(fp32)
    layers = native.manifest["model"]["num_layers"]

    def softmaxes(variant) -> int:
        return sum(getattr(node.target, "__name__", "").startswith("softmax")
                   for node in variant.runner.graph_module.graph.nodes)

    for variant in native.variants.values():
        targets = [node.target for node in variant.runner.graph_module.graph.nodes]
        assert targets.count(graph_rms_norm) == 2 * layers + 1 and targets.count(graph_rms_norm_rope) == layers
        if variant.operation is Operation.DECODE:  # a layer's softmax and its short forwards' one gone
            assert targets.count(graph_paged_attention) == layers, variant.name
            assert softmaxes(variant) == softmaxes(plain.variants[variant.name]) - 2 * layers, variant.name
    steps = 12

    def deviations(core) -> torch.Tensor:
        results = Engine(core).generate([Request(p, max_tokens=steps, logprobs=0, ignore_eos=True) for p in prompts])
        ours = torch.tensor([e.logprob for r in results for e in r.entries], dtype=torch.float64)
        forced = [prompt + [e.id for e in r.entries] for prompt, r in zip(prompts, results, strict=True)]
        scored = prompt_scores(reference, forced).view(len(prompts), -1)[:, -steps:].reshape(-1)
        return (ours - scored).abs()

    ours, theirs = deviations(native), deviations(plain)
    assert float(ours.mean()) <= 1.05 * float(theirs.mean()), (float(ours.mean()), float(theirs.mean()))
    reference_prompts = prompt_scores(reference, prompts)
    assert float(ours.max()) <= float(theirs.max()) + float(reference_prompts.abs().max()) * 2.0 ** -7
    ours, theirs = ((prompt_scores(core, prompts) - reference_prompts).abs() for core in (native, plain))
    assert float(ours.mean()) <= 1.05 * float(theirs.mean()), (float(ours.mean()), float(theirs.mean()))
