"""A layer's cache write in one native call (``runtime/backends/cell_writes.py``): the recipes' ``index_copy_`` of
``where(valid, new rows, old values)`` bit for bit, the rows not valid left as they are, bad input refused by name.
A core's graphs taking it, one call a cache and layer, is checked with the paged attention
(``tests/test_paged_attention.py``)."""

from __future__ import annotations

import pytest
import torch

from ignition.runtime.backends import cell_writes, paged_attention

pytestmark = pytest.mark.skipif(paged_attention.unavailable() is not None,
                                reason=f"no native kernels here: {paged_attention.unavailable()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_write_is_the_graphs_index_copy_of_where_valid_bit_for_bit(dtype):
    """``write_cells`` against the recipes' write: ``index_copy_(pool, 0, cells, where(valid, source[order], old))``;
    the rows not valid keep their bytes (NaN payloads included), and the source may be a strided slice of heads."""
    generator = torch.Generator().manual_seed(5)
    pool = torch.randn(40, 8, 16, generator=generator).to(dtype)
    pool[3, 0, 0] = float("nan")
    heads = torch.randn(6, 24, 16, generator=generator).to(dtype)
    source = heads[:, 16:]  # the key heads of a [rows, q + k heads, D] tensor: rows 24 x 16 apart
    cells, order = torch.tensor([7, 3, 30, 12]), torch.tensor([2, 0, 5, 1])
    valid = torch.tensor([True, False, True, True]).view(-1, 1, 1)
    expected = pool.clone()
    expected.index_copy_(0, cells, torch.where(valid, source.index_select(0, order), pool.index_select(0, cells)))
    assert cell_writes.write_cells(pool, cells, source, order, valid) is pool
    assert torch.equal(pool.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    with pytest.raises(IndexError, match=r"a valid row's cell outside the pool's 40 rows"):
        cell_writes.write_cells(pool, torch.tensor([7, 3, 40, 12]), source, order, valid)
    cell_writes.write_cells(pool, torch.tensor([7, 99, 30, 12]), source, order, valid)  # row 1 is not written
    with pytest.raises(IndexError, match=r"its source row outside the source's 6"):
        cell_writes.write_cells(pool, cells, source, torch.tensor([2, 0, 6, 1]), valid)
    with pytest.raises(ValueError, match=r"of its dtype and row layout.* source \(6, 8, 16\) torch.float16"):
        cell_writes.write_cells(pool, cells, source.half(), order, valid)
    with pytest.raises(ValueError, match=r"valid \(3, 1, 1\) torch.bool"):
        cell_writes.write_cells(pool, cells, source, order, valid[:3])
