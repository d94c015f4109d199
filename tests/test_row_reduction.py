"""The row-parallel layers' fixed reduction order (catalog.parallel.ROW_REDUCTION_BLOCKS).

A rank of an N-way core holds a run of the single-rank reduction blocks of o_proj and down_proj
and ``TensorParallel.reduce`` adds the ranks' subtotals by the same pairwise tree, so the sharded
sum is the single-rank sum bit for bit whenever N divides the blocks. The oracle is the plain
``F.linear`` (FP64), which the blocked sum must match to FP32 accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.recipes.layers import pairwise_sum, reduction_blocks, row_linear


def rank_sum(x: torch.Tensor, weight: torch.Tensor, bias, ranks: int) -> torch.Tensor:
    """What an N-way core computes: each rank's blocks over its K columns (bias on rank 0), then the rank tree."""
    blocks = max(1, ROW_REDUCTION_BLOCKS // ranks)
    parts = [row_linear(xs.contiguous(), ws.contiguous(), bias if rank == 0 else None, blocks, shard=True)
             for rank, (xs, ws) in enumerate(zip(x.chunk(ranks, dim=-1), weight.chunk(ranks, dim=1), strict=True))]
    return pairwise_sum(parts)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (5, 128, 48), (16, 1024, 96), (3, 96, 16), (7, 40, 8), (2, 3072, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sharded_sum_is_the_single_rank_sum_bit_for_bit(rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, weight = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g) if with_bias else None
    single = row_linear(x, weight, bias, ROW_REDUCTION_BLOCKS)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert torch.allclose(single.double(), exact, rtol=0, atol=1e-5)  # the oracle: still the same product
    shared_blocks = reduction_blocks(k, ROW_REDUCTION_BLOCKS)
    for ranks in (2, 4, 8):
        if k % ranks or shared_blocks % ranks:
            continue  # the model check refuses K % N; N must divide the blocks for the claim
        assert torch.equal(rank_sum(x, weight, bias, ranks), single), (ranks, k)


@pytest.mark.parametrize("rows,k", [(1, 2048), (8, 3072), (5, 128)])
def test_the_batched_leaves_are_added_as_the_pairwise_tree(rows, k):
    """row_linear's leaves (one batched product) added in pairwise_sum's order, bit for bit."""
    g = torch.Generator().manual_seed(k)
    x, weight = torch.randn(rows, k, generator=g), torch.randn(96, k, generator=g) * torch.logspace(0, 6, k)
    step = k // ROW_REDUCTION_BLOCKS
    leaves = torch.bmm(x.reshape(-1, ROW_REDUCTION_BLOCKS, step).transpose(0, 1),
                       weight.view(96, ROW_REDUCTION_BLOCKS, step).permute(1, 2, 0))
    assert torch.equal(row_linear(x, weight, None, ROW_REDUCTION_BLOCKS), pairwise_sum(list(leaves.unbind(0))))


def test_single_block_is_plain_linear_and_the_tree_is_pairwise():
    x, weight = torch.randn(4, 6), torch.randn(3, 6)
    assert torch.equal(row_linear(x, weight, None, 1), F.linear(x, weight))
    a, b, c, d, e = (torch.tensor([v]) for v in (1e8, 5.0, -1e8, 5.0, 0.5))  # FP32: 1e8 + 5 rounds to 1e8 + 8
    assert pairwise_sum([a, b, c, d, e]).item() == 16.5  # (a + b) + (c + d), then e; left to right: 13.5
    assert reduction_blocks(1024, 8) == 8 and reduction_blocks(64, 8) == 4 and reduction_blocks(40, 8) == 1


def test_low_precision_keeps_one_gemm():
    """BF16 leaves would each round to BF16: the single GEMM (FP32 accumulator) is kept."""
    x, weight = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(8, 256, dtype=torch.bfloat16)
    assert torch.equal(row_linear(x, weight, None, ROW_REDUCTION_BLOCKS), F.linear(x, weight))


@pytest.mark.parametrize("width", [8, 48, 96, 128, 1000, 1024, 7168])
def test_rms_norm_is_hfs(width):
    """recipes.layers.rms_norm is HF's ops' values bit for bit (the oracle below is transformers'
    Qwen3RMSNorm.forward, written out), at every row count a variant uses, with the forward's scalars as
    0-dim tensors (``Rows.scalar``) or as Python numbers; widths that are no power of two divide inexactly."""
    from ignition.recipes.layers import Rows, rms_norm

    g = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=g)
    rows = Rows.decode(torch.tensor([3]), torch.tensor([0]), torch.tensor([True]))
    for shape in ((1,), (3,), (8,), (5, 16), (64,), (2, 8, 4)):
        x = torch.randn(*shape, width, generator=g) * 3
        variance = x.pow(2).mean(-1, keepdim=True)
        hf = weight * (x * torch.rsqrt(variance + 1e-6))
        assert torch.equal(rms_norm(x, weight, 1e-6), hf), (width, shape)
        assert torch.equal(rms_norm(x, weight, 1e-6, rows), hf), (width, shape)
    for dtype in (torch.bfloat16, torch.float16):  # the FP32 normalisation, cast before the scale
        for shape in ((1,), (4,), (8,), (5, 16), (64,)):
            x = (torch.randn(*shape, width, generator=g) * 3).to(dtype)
            hf = weight.to(dtype) * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            assert torch.equal(rms_norm(x, weight.to(dtype), 1e-6), hf), (width, dtype, shape)
            assert torch.equal(rms_norm(x, weight.to(dtype), 1e-6, rows), hf), (width, dtype, shape)


def test_rms_norm_on_the_forwards_scalars_converts_no_scalar():
    """With the forward's scalars (0-dim FP32 tensors made once per Rows), an FP32 norm dispatches its six
    kernels (the width's division and eps's addition one ``addcdiv``) and no cast of a wrapped Python number
    (``aten::_to_copy``, four operator calls each on the CPU),
    and a second norm of the same width and epsilon makes no new scalar."""
    from torch.profiler import ProfilerActivity, profile

    from ignition.recipes.layers import Rows, rms_norm

    rows = Rows.decode(torch.tensor([3, 4]), torch.tensor([0, 1]), torch.tensor([True, True]))
    x, weight = torch.randn(2, 64), torch.randn(64)
    rms_norm(x, weight, 1e-6, rows)
    made = dict(rows.scalars)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        rms_norm(x, weight, 1e-6, rows)
    calls = {event.key: event.count for event in trace.key_averages()}
    assert "aten::_to_copy" not in calls and "aten::full" not in calls, calls
    assert calls.get("aten::addcdiv") == 1 and "aten::div" not in calls and "aten::add" not in calls, calls
    assert rows.scalars == made and set(made) == {64, 1e-6}
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        rms_norm(x, weight, 1e-6)
    assert "aten::_to_copy" in {event.key for event in trace.key_averages()}  # Python numbers: the cast this avoids


def test_a_copied_rows_plans_its_own_writes():
    """Rows.writes (write_rows' plan) is per object: dataclasses.replace does not carry a stale plan."""
    import dataclasses

    from ignition.recipes.layers import Rows, write_rows

    rows = Rows.decode(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([True, True]))
    cache = torch.zeros(1, 2, 4, 3)
    write_rows(cache, 0, rows, torch.ones(2, 3))
    idle = dataclasses.replace(rows, valid=torch.tensor([False, False]))
    assert idle.writes == {} and rows.writes
    before = cache.clone()
    write_rows(cache, 0, idle, torch.full((2, 3), 7.0))
    assert torch.equal(cache, before)  # no valid row: the cache is unchanged


def test_write_rows_writes_each_valid_rows_cell_of_its_layer_only():
    """One index_copy_ into the flattened cells: a valid row's (layer, slot, position) gets its values, an
    invalid row (here sharing a valid row's slot) and every other layer are left bit-identical."""
    from ignition.recipes.layers import Rows, write_rows

    cache = torch.randn(3, 4, 6, 2, 5)
    rows = Rows.decode(torch.tensor([2, 5, 4]), torch.tensor([3, 0, 3]), torch.tensor([True, True, False]))
    values = torch.randn(3, 2, 5)
    expected = cache.clone()
    expected[1, 3, 2], expected[1, 0, 5] = values[0], values[1]
    write_rows(cache, 1, rows, values)
    assert torch.equal(cache, expected)
    write_rows(cache, 2, rows, values)  # the plan is shared by the layers: only the layer's cells move
    expected[2, 3, 2], expected[2, 0, 5] = values[0], values[1]
    assert torch.equal(cache, expected)
