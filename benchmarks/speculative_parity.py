"""Issue 13's done-when check as a script: ``ignition run`` with and without ``--speculative``, compared.

``python -m benchmarks.speculative_parity CORE --prompt-ids 1,2,3 ngram:4 draft:DRAFT_CORE:4`` runs
``ignition run CORE --prompt-ids ... --max-tokens 16 --logprobs 5 --json`` without speculation and
once per ``--speculative`` value (the core must have been exported with ``--speculative-tokens``),
asserts the same tokens and the same logprob ids in the same order, and prints the largest
difference of the logprob values (a verify round's GEMM has S+1 rows per lane, so values may
differ by a few ulps, as with co-batching; see docs/api.md).
"""

from __future__ import annotations

import argparse

from benchmarks._common import run_json


def run(core: str, prompt_ids: str, tokens: int, extra: list[str]) -> dict:
    return run_json(core, ["--prompt-ids", prompt_ids, "--max-tokens", str(tokens), "--logprobs", "5", *extra])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("core")
    parser.add_argument("speculative", nargs="+", help="--speculative values, e.g. ngram:4 draft:CORE:4")
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    plain = run(args.core, args.prompt_ids, args.tokens, [])
    for value in args.speculative:
        got = run(args.core, args.prompt_ids, args.tokens, ["--speculative", value])
        assert [t["id"] for t in got["tokens"]] == [t["id"] for t in plain["tokens"]], value
        largest = 0.0
        for a, b in zip(plain["tokens"], got["tokens"], strict=True):
            assert [x["id"] for x in a["top_logprobs"]] == [x["id"] for x in b["top_logprobs"]], value
            pairs = [(a["logprob"], b["logprob"])] + [(x["logprob"], y["logprob"])
                                                      for x, y in zip(a["top_logprobs"], b["top_logprobs"])]
            largest = max([largest] + [abs(x - y) for x, y in pairs])
        print(f"--speculative {value}: {len(got['tokens'])} tokens, the same ids in the same order; "
              f"max |d| {largest:.3g}")


if __name__ == "__main__":
    main()
