"""Issue 12's done-when check as a script: ``ignition run`` on a single-rank core and on its sharded twin, compared.

``python -m benchmarks.tp_parity CORE_TP1 CORE_TPN --tensor-parallel N`` runs ``ignition run CORE
--prompt-ids IDS --max-tokens T --logprobs 20 --json --device cpu`` on both cores (the second with
``--tensor-parallel N``; add ``--prompt-logprobs K`` when both cores were exported with
``--prompt-logprobs``), asserts the same tokens, logprob ids and order, prompt ids and ranks, and
prints the largest value differences: absolute, and in FP32 ulps of the larger magnitude.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._common import compared_values, run_json


def ulps(a: float, b: float) -> float:
    return abs(a - b) / float(np.spacing(np.float32(max(abs(a), abs(b)))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("single", help="the core exported without --tensor-parallel")
    parser.add_argument("sharded", help="the core exported with --tensor-parallel N")
    parser.add_argument("--tensor-parallel", type=int, required=True)
    parser.add_argument("--prompt-ids", default="1,2,3,4")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-logprobs", type=int, default=0)
    args = parser.parse_args()
    common = ["--prompt-ids", args.prompt_ids, "--max-tokens", str(args.tokens), "--logprobs", "20",
              "--device", "cpu"] + (["--prompt-logprobs", str(args.prompt_logprobs)] if args.prompt_logprobs else [])
    want = run_json(args.single, common)
    got = run_json(args.sharded, common + ["--tensor-parallel", str(args.tensor_parallel)])
    found = compared_values(want, got)
    for name, values in found.items():
        if values:
            identical = sum(a == b for a, b in values)
            print(f"{name}: {len(values)} values, same ids and order, {identical} bit-identical; "
                  f"max |d| {max(abs(a - b) for a, b in values):.3g}, "
                  f"max {max(ulps(a, b) for a, b in values):.2f} FP32 ulp")


if __name__ == "__main__":
    main()
