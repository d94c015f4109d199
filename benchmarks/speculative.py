"""Speculative decoding with prompt lookup (``--speculative ngram:S``) on the tiny Qwen3 example.

``python -m benchmarks.speculative --threads 2`` prints, for a repetitive and a non-repetitive
prompt workload, with logprobs off and with 20 natural alternatives per token: decode tokens/s
without speculation and with ngram drafting, the acceptance rate (accepted / proposed draft
tokens), and whether the greedy tokens are identical (they must be).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks._common import best_of, example_checkpoint, export


def workloads(vocab: int) -> dict[str, list[list[int]]]:
    repetitive = [[(11 * i + 3) % vocab + 1 for i in range(6)] * 5 for _ in range(1)]  # a phrase said five times
    repetitive += [[(5 * i + 17) % vocab + 1 for i in range(4)] * 6]
    non_repetitive = [[(i * i * 37 + 13 * i + 5) % vocab + 1 for i in range(30)],
                      [(i * 7919 + 101) % vocab + 1 for i in range(24)]]
    return {"repetitive": repetitive, "non-repetitive": non_repetitive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ignition.runtime.core import load_core
    from ignition.runtime.drafters import NgramDrafter
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    with tempfile.TemporaryDirectory() as tmp:
        core = load_core(export(example_checkpoint(Path(tmp)), Path(tmp) / "core", capacities=(2,), max_seq_len=128,
                                chunk_limit=64, speculative_tokens=(args.draft_tokens,)))
        print(f"tiny Qwen3 example, torch threads {torch.get_num_threads()}, S={args.draft_tokens}, "
              f"{args.tokens} tokens per request, 2 concurrent requests")
        for name, prompts in workloads(core.vocab_size - 1).items():
            for logprobs in (None, 20):
                def requests():
                    return [Request(p, max_tokens=args.tokens, logprobs=logprobs, ignore_eos=True) for p in prompts]

                engines = {}

                def run(speculative: bool):
                    engine = Engine(core, drafter=NgramDrafter(), draft_tokens=args.draft_tokens) if speculative \
                        else Engine(core)
                    engines[speculative] = (engine, engine.generate(requests()))

                rate = {s: len(prompts) * args.tokens / best_of(lambda: run(s), args.repeats) for s in (False, True)}
                engine, results = engines[True]
                same = [r.token_ids for r in results] == [r.token_ids for r in engines[False][1]]
                stats = engine.stats
                acceptance = stats["accepted"] / stats["proposed"] if stats["proposed"] else 0.0
                print(f"{name:<15} logprobs={str(logprobs):<4}  {rate[False]:7.1f} tok/s plain, {rate[True]:7.1f} "
                      f"with ngram ({rate[True] / rate[False]:.2f}x); acceptance {acceptance:.2f} "
                      f"({stats['accepted']}/{stats['proposed']}), {stats['verify_rounds']} verify rounds; "
                      f"same tokens {same}")


if __name__ == "__main__":
    main()
