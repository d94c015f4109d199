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

from benchmarks._common import run_json


def ulps(a: float, b: float) -> float:
    return abs(a - b) / float(np.spacing(np.float32(max(abs(a), abs(b)))))


def pairs(want: dict, got: dict):
    """(single-rank, sharded) logprob values of one entry, after checking its ids and order agree."""
    assert want["id"] == got["id"], (want["id"], got["id"])
    assert [t["id"] for t in want["top_logprobs"]] == [t["id"] for t in got["top_logprobs"]], (want, got)
    yield want["logprob"], got["logprob"]
    yield from ((a["logprob"], b["logprob"]) for a, b in zip(want["top_logprobs"], got["top_logprobs"]))


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
    assert [t["id"] for t in want["tokens"]] == [t["id"] for t in got["tokens"]], "greedy tokens differ"
    found = {"generated": [v for a, b in zip(want["tokens"], got["tokens"], strict=True) for v in pairs(a, b)],
             "prompt": []}
    for a, b in zip(want.get("prompt_logprobs") or [], got.get("prompt_logprobs") or [], strict=True):
        assert (a is None) == (b is None) and (a is None or a["rank"] == b["rank"]), (a, b)
        found["prompt"] += [] if a is None else list(pairs(a, b))
    for name, values in found.items():
        if values:
            identical = sum(a == b for a, b in values)
            print(f"{name}: {len(values)} values, same ids and order, {identical} bit-identical; "
                  f"max |d| {max(abs(a - b) for a, b in values):.3g}, "
                  f"max {max(ulps(a, b) for a, b in values):.2f} FP32 ulp")


if __name__ == "__main__":
    main()
