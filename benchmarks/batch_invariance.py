"""The cost and the effect of ``--batch-invariant`` on the tiny Qwen3 example.

``python -m benchmarks.batch_invariance --threads 2`` prints, in one run:

1. without the flag: whether 64 concurrent requests get the same tokens as each alone, and
   the largest logprob difference (docs/serving.md, "Engine options": the last bits may differ);
2. with the flag: whether they are bit-identical;
3. decode tokens/s with and without the flag at 1 and 8 concurrent requests (the cost).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks._common import best_of, example_checkpoint, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    with tempfile.TemporaryDirectory() as tmp:
        core = load_core(export(example_checkpoint(Path(tmp)), Path(tmp) / "core", capacities=(1, 2, 4, 8),
                                max_seq_len=128, chunk_limit=64))

        def requests(n):
            return [Request([(7 * i + j) % 290 + 1 for j in range(5 + i % 7)], max_tokens=args.tokens, logprobs=5,
                            ignore_eos=True) for i in range(n)]

        print(f"tiny Qwen3 example, torch threads {torch.get_num_threads()}")
        for invariant in (False, True):
            together = Engine(core, batch_invariant=invariant).generate(requests(64))
            alone = [Engine(core, batch_invariant=invariant).generate([r])[0] for r in requests(64)]
            tokens = all(a.token_ids == b.token_ids for a, b in zip(together, alone))
            pairs = [(x, y) for a, b in zip(together, alone) for x, y in zip(a.entries, b.entries)]
            bits = all(x.logprob == y.logprob and x.top == y.top for x, y in pairs)
            bound = max(max([abs(x.logprob - y.logprob)] + [abs(p[1] - q[1]) for p, q in zip(x.top, y.top)])
                        for x, y in pairs)
            print(f"batch_invariant={invariant!s:<5}  64 concurrent vs alone: same tokens {tokens}, "
                  f"bit-identical logprobs {bits}, max |difference| {bound:.3g}")
        for n in (1, 8):
            rate = {}
            for invariant in (False, True):
                seconds = best_of(lambda: Engine(core, batch_invariant=invariant).generate(requests(n)), args.repeats)
                rate[invariant] = n * args.tokens / seconds
            print(f"{n} concurrent: {rate[False]:8.1f} tok/s without the flag, {rate[True]:8.1f} with "
                  f"(cost {rate[False] / rate[True]:.2f}x)")


if __name__ == "__main__":
    main()
