"""oneDNN's linear at decode's row counts on the packed (blocked) weight layout and on the plain (raw) one.

``python -m benchmarks.row_layouts --threads 2`` times ``mkldnn._linear_pointwise`` at 1, 8 and 32 rows over the
weights of a 28-layer Qwen3-0.6B-shaped model, by shape (each shape's weights together, so no product runs from
cache): once on each weight reordered for each row count of ``gemm_calibration.PACK_LAYOUTS`` (the layouts
``runtime/backends/packed_linear.py`` chooses among at load), once on the raw row-major weight, and through
``aten.linear`` (what transformers calls: MKL's ``sgemm`` for FP32, oneDNN for BF16). The best of ``--repeats``
passes, in milliseconds per pass. ``--dtype bfloat16`` times the BF16 weights. It is the measurement behind ``packed_linear.PACKED_DTYPES`` and ``BIT_EXACT_DTYPES``.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {"q_proj": ((2048, 1024), 28), "k_proj, v_proj": ((1024, 1024), 56), "gate_proj, up_proj": ((3072, 1024), 56),
          "lm_head (tied embedding)": ((151936, 1024), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    import torch

    from ignition.runtime.backends.gemm_calibration import PACK_LAYOUTS

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)

    def best(weights, count: int, call=None) -> float:
        x = torch.randn(count, weights[0].shape[1]).to(dtype)
        call = call or (lambda x, weight: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            for weight in weights:
                call(x, weight)
            times.append(time.perf_counter() - started)
        return min(times) * 1e3

    print(f"torch {torch.__version__}, {args.dtype}, threads {args.threads}, ms per pass over the shape's weights")
    def packed_heads(r: int) -> str:
        return " | ".join(f"{r} rows packed@{layout}" for layout in PACK_LAYOUTS)

    heads = " | ".join(f"{packed_heads(r)} | {r} rows plain | {r} rows aten.linear" for r in rows)
    print(f"| weights | {heads} |")
    print("|---|" + "---|" * ((len(PACK_LAYOUTS) + 2) * len(rows)))
    for label, (shape, count) in SHAPES.items():
        raw = [torch.randn(*shape).to(dtype) for _ in range(count)]
        packed = {layout: [torch.ops.mkldnn._reorder_linear_weight(weight, layout) for weight in raw]
                  for layout in PACK_LAYOUTS}
        cells = [" | ".join(f"{best(packed[layout], r):.1f}" for layout in PACK_LAYOUTS)
                 + f" | {best(raw, r):.1f} | {best(raw, r, torch.nn.functional.linear):.1f}" for r in rows]
        print(f"| {label} x{count} | " + " | ".join(cells) + " |")
        del raw, packed


if __name__ == "__main__":
    main()
