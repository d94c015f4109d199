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

from benchmarks._common import compared_values, run_json


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
        values = compared_values(plain, got)["generated"]
        largest = max(abs(x - y) for x, y in values)
        print(f"--speculative {value}: {len(got['tokens'])} tokens, the same ids in the same order; "
              f"max |d| {largest:.3g}")


if __name__ == "__main__":
    main()
