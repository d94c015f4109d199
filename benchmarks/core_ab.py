"""Two exported cores' decode steps, interleaved in one process: an A/B of two commits' graphs on the same host.

``python -m benchmarks.core_ab OLD NEW --threads 2 --batch 8 --steps 40`` loads both cores, admits ``--batch``
requests (4-token prompts, greedy) on an engine over each, prefills them and runs 3 warm-up rounds, then times
``--steps`` decode rounds, alternating a round of one core with a round of the other, and prints each core's median
and minimum round and the ratio of the medians. Alternating rounds in one process is what makes a small difference
measurable here: this machine's speed moves by up to 2x within an hour, so rows measured minutes apart compare
nothing. Export both cores with the same command at the two commits (``git worktree add``), and keep the host
otherwise idle. ``--new-logprobs K`` gives the NEW side's requests K logprobs instead of ``--logprobs``: with the same
core twice it measures what logprobs cost (``OLD`` = ``NEW``, ``--logprobs 0 --new-logprobs 20``). ``--profiled N``
then runs N more rounds of each, alternating, each under its own torch.profiler, and prints each core's median
matrix-product share of a round's operator time (``benchmarks._steps.profiled_step``) and its range. ``--csv FILE``
adds each core's rounds to a CSV of data rows (``benchmarks._steps.write_rows``). ``--old-gemm`` and ``--new-gemm``
load each side with that ``LoadOptions.gemm`` (``calibrate``, ``packed``, ``blocked``, ``aten``): with the same core
twice they compare two CPU GEMM paths, e.g. ``python -m benchmarks.core_ab CORE CORE --old-gemm packed --new-gemm
blocked --batch 1 --logprobs 0``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks._steps import lane_prompts, profiled_step, step_row, timed, warmed_engine, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logprobs", type=int, default=5, help="0 means off")
    parser.add_argument("--new-logprobs", type=int, default=None, help="the NEW side's logprobs (default: --logprobs)")
    parser.add_argument("--profiled", type=int, default=0, help="rounds of each core under torch.profiler, after the "
                        "timed ones: the matrix products' share of each")
    parser.add_argument("--csv", type=Path, default=None, help="also add each core's rounds to this CSV of data rows")
    parser.add_argument("--old-gemm", default="calibrate", help="the OLD side's LoadOptions.gemm")
    parser.add_argument("--new-gemm", default="calibrate", help="the NEW side's LoadOptions.gemm")
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1 or args.profiled < 0:
        parser.error("--batch and --steps must be at least 1, --profiled at least 0")

    import torch

    torch.set_num_threads(args.threads)
    from ignition.runtime.core import load_core
    from ignition.runtime.requests import Request

    settings = (args.logprobs, args.logprobs if args.new_logprobs is None else args.new_logprobs)
    engines = [warmed_engine(load_core(path, gemm=gemm), [Request(prompt, max_tokens=args.steps + args.profiled + 8,
                                                                  logprobs=logprobs or None, ignore_eos=True)
                                                          for prompt in lane_prompts(args.batch)])
               for path, logprobs, gemm in zip((args.old, args.new), settings, (args.old_gemm, args.new_gemm))]
    rounds: list[list[float]] = [[], []]
    for _ in range(args.steps):
        for side, engine in enumerate(engines):
            rounds[side].append(timed(engine.step)[0])
    for path, logprobs, gemm, times in zip((args.old, args.new), settings, (args.old_gemm, args.new_gemm), rounds):
        print(f"{path} (gemm {gemm}, logprobs {logprobs or 'off'}): median {statistics.median(times) * 1e3:.1f} ms, "
              f"min {min(times) * 1e3:.1f} ms a round")
    print(f"new / old (medians): {statistics.median(rounds[1]) / statistics.median(rounds[0]):.3f}")
    if args.csv is not None:
        write_rows(args.csv, [step_row("core_ab", f"{name} {path}", "batch", args.batch, times,
                                       {"logprobs": logprobs, "threads": args.threads, "steps": args.steps})
                              for name, path, logprobs, times in zip(("old", "new"), (args.old, args.new), settings,
                                                                     rounds)])
        print(f"2 rows written to {args.csv}")
    if args.profiled:
        shares: list[list[float]] = [[], []]
        for _ in range(args.profiled):
            for side, engine in enumerate(engines):
                shares[side].append(profiled_step(engine)[2])
        for path, side in zip((args.old, args.new), shares):
            print(f"{path}: matrix products {100 * statistics.median(side):.1f}% of a profiled round's operator time "
                  f"(median of {len(side)}; {100 * min(side):.1f}-{100 * max(side):.1f}%)")


if __name__ == "__main__":
    main()
