"""Packed projections one weight at a time against one packed weight per shared input: what fusing q/k/v and gate/up
into single oneDNN products would save on a decode step at Qwen3-0.6B's width, and whether it keeps the bits.

``python -m benchmarks.projection_fusion --threads 2`` packs (``mkldnn._reorder_linear_weight``, as
``runtime/backends/packed_linear.py`` does) 28 layers of random q (2048 x 1024), k and v (1024 x 1024), gate and up
(3072 x 1024) weights, each alone and as the two concatenations ``[q; k; v]`` and ``[gate; up]``, and times a pass
over all 28 layers (1.1 GiB of weights, so each pass reads them from memory, as a decode step does) at 1 and 8 rows:
five products a layer against two. The passes alternate ``--rounds`` times; each side reports its fastest. It also
says whether each fused product's columns equal the separate products' outputs bit for bit (oneDNN reduces each
output over the same K either way). Nothing in the runtime fuses projections yet; this measures what it would gain.
"""

from __future__ import annotations

import argparse
import time

import torch

LAYERS = 28
HIDDEN = 1024
SHAPES = {"q": 2048, "k": 1024, "v": 1024, "gate": 3072, "up": 3072}
GROUPS = (("q", "k", "v"), ("gate", "up"))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    from ignition.runtime.backends.gemm_calibration import FORCED_LAYOUT

    return torch.ops.mkldnn._reorder_linear_weight(weight, FORCED_LAYOUT)


def _product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def measure(rows_list: tuple[int, ...], rounds: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    raw = [{name: torch.randn(out, HIDDEN, generator=generator) * 0.02 for name, out in SHAPES.items()}
           for _ in range(LAYERS)]
    separate = [{name: _pack(w) for name, w in layer.items()} for layer in raw]
    fused = [[_pack(torch.cat([layer[name] for name in group])) for group in GROUPS] for layer in raw]
    del raw
    results = []
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, generator=generator)

        def one_at_a_time():
            for layer in separate:
                for packed in layer.values():
                    _product(x, packed)

        def fused_pass():
            for layer in fused:
                for packed in layer:
                    _product(x, packed)

        seconds = {"separate": [], "fused": []}
        one_at_a_time(), fused_pass()
        for _ in range(rounds):
            for name, run in (("separate", one_at_a_time), ("fused", fused_pass)):
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
        same = all(torch.equal(torch.cat([_product(x, separate[0][name]) for name in group], dim=1),
                               _product(x, fused[0][index])) for index, group in enumerate(GROUPS))
        results.append({"rows": rows, "separate_ms": min(seconds["separate"]) * 1e3,
                        "fused_ms": min(seconds["fused"]) * 1e3, "bits_equal": same})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from ignition.runtime.backends.packed_linear import packing_available

    if not packing_available():
        raise SystemExit("this torch build has no oneDNN packed linear (mkldnn._linear_pointwise)")
    print(f"{LAYERS} layers of q/k/v and gate/up at hidden {HIDDEN}, FP32, threads {args.threads}, "
          f"the fastest of {args.rounds} alternated passes")
    print("| rows | 5 products a layer | 2 fused products a layer | saved | fused columns equal bit for bit |")
    print("|---|---|---|---|---|")
    for r in measure(tuple(int(x) for x in args.rows.split(",")), args.rounds):
        print(f"| {r['rows']} | {r['separate_ms']:.1f} ms | {r['fused_ms']:.1f} ms | "
              f"{r['separate_ms'] - r['fused_ms']:.1f} ms | {'yes' if r['bits_equal'] else 'no'} |")


if __name__ == "__main__":
    main()
