"""The row-parallel layers' reduction blocks at Qwen3-0.6B's width: one GEMM, B GEMMs, and the batched leaves.

``recipes.layers.row_linear`` sums o_proj (K 2048) and down_proj (K 3072) as B = 8 leaves added by a
pairwise tree, so tensor-parallel cores are bit-identical to TP=1. This times, per layer, over 28 distinct
weights (as a decode step reads them: none stays in cache), the plain ``F.linear``, the earlier form (B
``F.linear`` calls on contiguous copies of the input slices) and ``row_linear`` (one ``bmm`` over strided
views), at 1, 8 and 32 rows; and checks that the batched leaves equal the B separate GEMMs' leaves. It also times
the one GEMM on oneDNN's packed weight (``runtime/backends/packed_linear.py``, the layout a load packs for eight
rows), the path an unblocked layer's linear takes at load, and each form's weight read rate: the row blocks' price
in decode speed on this machine.

    python -m benchmarks.row_blocks --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ignition.catalog.parallel import ROW_REDUCTION_BLOCKS
from ignition.runtime.backends.gemm_calibration import FORCED_LAYOUT
from ignition.runtime.backends.packed_linear import packing_available
from ignition.recipes.layers import pairwise_sum, row_linear

LAYERS, D_MODEL = 28, 1024
WIDTHS = {"o_proj": 2048, "down_proj": 3072}


def separate(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """The earlier form: B GEMMs of contiguous copies of the input's slices, then the pairwise tree."""
    step = weight.shape[1] // blocks
    leaves = x.reshape(-1, blocks, step).transpose(0, 1).contiguous()
    return pairwise_sum([F.linear(leaves[b], weight[:, b * step:(b + 1) * step]) for b in range(blocks)])


def per_layer_ms(fn, weights, x, repeats: int) -> float:
    def sweep():
        for weight in weights:
            fn(x, weight)
    sweep()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        sweep()
        best = min(best, time.perf_counter() - started)
    return best / len(weights) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks = ROW_REDUCTION_BLOCKS
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {LAYERS} weights each, best of {args.repeats}")
    print("| layer | rows | one GEMM ms | B GEMMs ms | batched leaves ms | one packed GEMM ms | B GEMMs / one | "
          "batched / one | batched / packed | weight read, batched / packed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, width in WIDTHS.items():
        weights = [torch.randn(D_MODEL, width, generator=g) / width**0.5 for _ in range(LAYERS)]
        packs = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, FORCED_LAYOUT) for w in weights} \
            if packing_available() else {}
        gigabytes = D_MODEL * width * 4 / 1e9
        for rows in (1, 8, 32):
            x = torch.randn(rows, width, generator=g)
            one = per_layer_ms(lambda a, w: F.linear(a, w), weights, x, args.repeats)
            old = per_layer_ms(lambda a, w: separate(a, w, blocks), weights, x, args.repeats)
            new = per_layer_ms(lambda a, w: row_linear(a, w, None, blocks), weights, x, args.repeats)
            packed = per_layer_ms(lambda a, w: torch.ops.mkldnn._linear_pointwise(a, packs[id(w)], None, "none", [],
                                                                                    ""), weights, x, args.repeats) \
                if packs else float("nan")
            same = torch.equal(row_linear(x, weights[0], None, blocks), separate(x, weights[0], blocks))
            print(f"| {name} (K {width}) | {rows} | {one:.3f} | {old:.3f} | {new:.3f} | {packed:.3f} | "
                  f"{old / one:.2f}x | {new / one:.2f}x{'' if same else ' (leaves round differently)'} | "
                  f"{new / packed:.2f}x | {gigabytes / new * 1e3:.1f} / {gigabytes / packed * 1e3:.1f} GB/s |")


if __name__ == "__main__":
    main()
