"""The Triton logprob launches against the reference and the contract's oracle.

The kernels run under TRITON_INTERPRET=1 in one subprocess (tests/_triton_interp_check.py):
the interpreter must be enabled before Triton is imported and breaks torch.export in the same
process. Each case reports its own failures; the tolerance argument lives in that script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _interpreted import case_names, interpreted_cases

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, packed_width

HELPER = Path(__file__).with_name("_triton_interp_check.py")
CASE_NAMES = case_names(HELPER)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, list[str]]:
    return interpreted_cases(HELPER)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_interpreted_kernels_match_reference(interpreted_results, case):
    assert case in interpreted_results, f"case {case} did not run"
    assert interpreted_results[case] == [], "\n".join(interpreted_results[case])


def test_importing_ignition_registers_cuda_kernel_without_triton():
    """The CUDA implementation (prepared launches) is registered by ``import ignition`` alone."""
    import ignition  # noqa: F401

    assert torch._C._dispatch_has_kernel_for_dispatch_key("ignition::reduce_logprobs", "CUDA")


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 1823), (64, 151936), (1, 151936), (8, 2_000_000)])
def test_launch_plan_geometry(rows, vocab):
    from ignition.components.triton_logprobs import TILE_KEYS, launch_plan

    plan = launch_plan(rows, vocab + 3, vocab, NATURAL_K, True, torch.bfloat16)
    assert [spec.name for spec in plan] == ["logprobs.tile_stats", "logprobs.row_normalization",
                                            "logprobs.tile_candidates", "logprobs.merge"]
    tile = plan[0].constexprs["TILE"]
    tiles = plan[0].grid[1]
    assert tile & (tile - 1) == 0 and (tiles - 1) * tile < vocab <= tiles * tile and tiles <= 256
    assert plan[2].grid == (rows, tiles) and plan[1].grid == plan[3].grid == (rows,)
    assert plan[3].constexprs["OUT_WIDTH"] == packed_width(NATURAL_K, True)
    assert plan[3].constexprs["MAX_IDS"] == MAX_SELECTED_IDS
    assert plan[3].constexprs["CANDIDATES_BLOCK"] >= tiles * TILE_KEYS
    for spec in plan:  # every parameter typed; constexprs exactly the "constexpr" parameters
        assert list(spec.signature) == spec.kernel.arg_names
        assert {n for n, t in spec.signature.items() if t == "constexpr"} == set(spec.constexprs)
    sub = plan[0].constexprs["SUB"]
    assert plan[1].constexprs["MAXIMA_BLOCK"] >= tiles * sub and tile % sub == 0
    workspace_bytes = rows * tiles * (2 * 4 + sub * 4 + TILE_KEYS * 8) + rows * 8  # stats, maxima, keys, lse, cutoff
    if vocab >= 4096:
        assert workspace_bytes * 4 < rows * vocab * 4, "workspace should be far below a [rows, vocab] FP32 copy"
    assert launch_plan(rows, vocab + 3, vocab, NATURAL_K, True, torch.bfloat16) == plan  # no hidden state


@pytest.mark.parametrize("rows,vocab,tile", [(3, 3000, 1024), (2, 4100, 1024), (4, 3000, 1024), (3, 31, 32),
                                              (2, 16, 16)])
def test_interpreter_cases_take_the_intended_tiles(rows, vocab, tile):
    """The adversarial interpreter cases rely on these tiles (ties across 1024-lane tiles, K=20 near a tiny tile)."""
    from ignition.components.triton_logprobs import launch_plan

    assert launch_plan(rows, vocab, vocab, NATURAL_K, False, torch.float32)[0].constexprs["TILE"] == tile


def test_launch_plan_rejects_bad_arguments():
    from ignition.components.triton_logprobs import launch_plan

    for args in [(0, 10, 10, 5, False, torch.float32), (2, 10, 11, 5, False, torch.float32),
                 (2, 10, 10, NATURAL_K + 1, False, torch.float32), (2, 10, 10, 5, False, torch.float64)]:
        with pytest.raises(ValueError, match="launch_plan"):
            launch_plan(*args)


def test_launcher_rejects_bad_layout_before_launching():
    from ignition.components.triton_logprobs import reduce_logprobs_triton

    logits = torch.zeros(3, 40).t()  # vocabulary stride 3
    out = torch.zeros(40, packed_width(5, False), dtype=torch.int32)
    args = (torch.zeros(40, dtype=torch.int64), torch.ones(40, dtype=torch.int32), out, torch.arange(40), None, None)
    with pytest.raises(ValueError, match="unit vocabulary stride"):
        reduce_logprobs_triton(logits, *args, 3, 5)
    with pytest.raises(ValueError, match="k must be"):
        reduce_logprobs_triton(logits.contiguous(), *args, 3, NATURAL_K + 1)
