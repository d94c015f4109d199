"""The sampling step of one decode round at a real vocabulary's width, with and without the transform window.

``python -m benchmarks.sampling_rows --threads 2`` builds random FP32 logits ``[batch, 151936]`` (Qwen3's vocabulary),
a 32-slot penalty state and the structured-output inputs (all empty), and times what a decode graph runs between the
LM head and the commit (``recipes.graphs.penalty_history``, then ``components.sampling.sample`` with the constraints),
greedy, at batch 1, 8 and 32: once with the transform window at the whole row (what a round with a penalty or a
constraint passes, and every round before the window existed) and once at 64 columns (a round without any). Each
cell is the median of ``--repeats`` calls, alternated between the two sides; the tokens of both sides must match.
It also reports one call of each under ``torch.profiler``: the operator time the profile of a decode step sees.

``--argmax`` instead times the greedy token alone: torch's ``amax`` + ``argmax`` over the row against
``components.sampling.first_argmax`` (group maxima, then one group), alternated, after checking they agree on the
same random rows with planted ties.
"""

from __future__ import annotations

import argparse
import statistics
import time

VOCAB = 151_936
SLOTS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--argmax", action="store_true", help="time the greedy token's argmax alone")
    args = parser.parse_args()
    if args.argmax:
        return argmax_table(args)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from ignition.catalog.buffers import BIAS_IDS, BIAS_VALUES, TOKEN_BITMASK
    from ignition.catalog.contract import MAX_LOGIT_BIAS, bitmask_words
    from ignition.components.constraints import sampling_logits
    from ignition.components.sampling import SamplingTensors, sample
    from ignition.recipes.graphs import OUTPUT_PLANE, PROMPT_PLANE, penalty_history

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    penalty = torch.zeros(SLOTS, 2, VOCAB, dtype=torch.int32)
    print(f"torch {torch.__version__}, threads {args.threads}, vocabulary {VOCAB}, greedy lanes, no penalty or "
          f"constraint")
    print("| batch | transform window | median ms | profiled operator ms |")
    print("|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        logits = torch.randn(batch, VOCAB, generator=generator) * 3
        slots = torch.arange(batch)
        params = SamplingTensors.from_requests([{}] * batch)
        buffers = {TOKEN_BITMASK: torch.zeros(batch, bitmask_words(VOCAB), dtype=torch.int32),
                   BIAS_IDS: torch.full((batch, MAX_LOGIT_BIAS), -1, dtype=torch.int64),
                   BIAS_VALUES: torch.zeros(batch, MAX_LOGIT_BIAS)}
        sample_window = torch.zeros(64, dtype=torch.int64)  # greedy lanes: the loader's short sorted row

        def step(transform):
            history = penalty_history(penalty, slots, transform)
            return sample(logits, history[:, OUTPUT_PLANE], history[:, PROMPT_PLANE] > 0, params, VOCAB,
                          sample_window, transform, lambda part, columns: sampling_logits(buffers, part, columns))

        sides = {"whole row": torch.zeros(VOCAB, dtype=torch.int64), "64 columns": torch.zeros(64, dtype=torch.int64)}
        tokens = {name: step(window) for name, window in sides.items()}
        if not torch.equal(*tokens.values()):
            raise SystemExit(f"batch {batch}: the two sides sampled different tokens")
        times = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, window in sides.items():
                started = time.perf_counter()
                step(window)
                times[name].append(time.perf_counter() - started)
        for name, window in sides.items():
            with profile(activities=[ProfilerActivity.CPU]) as trace:
                step(window)
            profiled = sum(event.self_cpu_time_total for event in trace.key_averages()) / 1e3
            print(f"| {batch} | {name} | {statistics.median(times[name]) * 1e3:.2f} | {profiled:.2f} |")


def argmax_table(args) -> None:
    import torch

    from ignition.components.sampling import first_argmax

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, threads {args.threads}, vocabulary {VOCAB}")
    print("| batch | amax + argmax ms | first_argmax ms | ratio |")
    print("|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        logits = torch.randn(batch, VOCAB, generator=generator) * 3
        logits[:, [VOCAB - 1, 77_000, 5]] = logits.amax(dim=1, keepdim=True)  # ties: the first index wins
        sides = {"torch": lambda: (logits.amax(dim=-1), logits.argmax(dim=-1)), "ours": lambda: first_argmax(logits)}
        (row_max, index), (our_max, our_index) = (side() for side in sides.values())
        if not (torch.equal(row_max, our_max) and torch.equal(index, our_index)):
            raise SystemExit(f"batch {batch}: first_argmax disagrees with torch's amax/argmax")
        times = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, side in sides.items():
                started = time.perf_counter()
                side()
                times[name].append(time.perf_counter() - started)
        ours, theirs = statistics.median(times["ours"]) * 1e3, statistics.median(times["torch"]) * 1e3
        print(f"| {batch} | {theirs:.3f} | {ours:.3f} | {theirs / ours:.1f}x |")


if __name__ == "__main__":
    main()
