"""Engine decode steps on an exported core, in interleaved fresh processes: an A/B of load options or logprobs.

``python -m benchmarks.decode_steps --core DIR --threads 2 --batch 8 --logprobs 5 --pairs 3`` loads the core in a
fresh process per run, admits ``--batch`` requests (4-token prompts, greedy), prefills them, runs 3 warm-up steps
and times ``--steps`` engine steps; the two sides of ``--compare`` alternate ``--pairs`` times, and each run prints
its median and minimum step. ``--compare retain`` (default): ``LoadOptions.retain_host_memory`` on against off
(``runtime/host_memory.py``); ``--compare logprobs``: logprobs ``--logprobs`` against off; ``--compare pack``:
``LoadOptions.pack_linears`` on against off (``runtime/backends/packed_linear.py``); ``--compare huge-pages``:
torch's CPU allocator on transparent huge pages (``ignition.HUGE_PAGES_VARIABLE`` 1 in the child's environment)
against not (0). ``--compare logprobs --rounds R`` runs the two sides in one process instead, R rounds, and times the
logprob reduction inside the graph (``in_process``); ``--compare logprobs --alternate R`` steps two engines in turn, one
with logprobs and one without, for R rounds of ``--steps`` step pairs, and prints the median and quartiles of the pairs'
ratios (``benchmarks._steps.alternating_costs``, the issue command's logprobs cost). ``--profile TOP`` profiles one
step instead and prints its TOP operators by self time and input shape, and the matrix products' share; with ``--hf
CHECKPOINT`` (the core's source checkpoint) it then profiles transformers' own decode step of the same prompts
(``benchmarks._steps.hf_step_profile``, eager attention) and prints the same for it. ``--csv FILE`` adds each side's
steps over its ``--pairs`` runs to a CSV of data rows (``benchmarks._steps.write_rows``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._steps import (alternating_costs, decode_requests, hf_step_profile, lane_prompts, operator_split,
                               profiled_step, spread, step_row, timed_steps, warmed_engine, write_rows)


def decoding_engine(loaded, batch: int, logprobs: int | None, steps: int):
    """An engine over ``loaded`` with ``batch`` greedy requests (``lane_prompts``) admitted, prefilled and 3 decode
    rounds in (``warmed_engine``), each with room for ``steps`` more."""
    return warmed_engine(loaded, decode_requests(lane_prompts(batch), logprobs, steps))


def measure(core: Path, batch: int, logprobs: int | None, steps: int, retain: bool, threads: int,
            pack: bool = True) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ignition.runtime.core import load_core

    loaded = load_core(core, retain_host_memory=retain, pack_linears=pack)
    times = timed_steps(decoding_engine(loaded, batch, logprobs, steps), steps)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "steps": times}


def in_process(core: Path, batch: int, logprobs: int, steps: int, rounds: int, threads: int) -> None:
    """Logprobs ``logprobs`` against off in one process: the core loaded once, then ``rounds`` rounds of one run each
    (``warmed_engine``, then ``steps`` timed engine steps), the side that goes first alternating. Prints each run's
    median step and the reduction's median time inside the graph (the CPU op's body, ``reduce_logprobs_reference``,
    timed through a wrapper), then each side's median run and the median of the rounds' ratios (a round's two runs
    are seconds apart, so the host's slower drift leaves their ratio alone)."""
    import torch

    torch.set_num_threads(threads)
    import ignition.components.logprobs as reduction
    from ignition.runtime.core import load_core

    reductions: list[float] = []
    body = reduction.reduce_logprobs_reference

    def timed_body(*args, **kwargs):
        started = time.perf_counter()
        body(*args, **kwargs)
        reductions.append(time.perf_counter() - started)

    reduction.reduce_logprobs_reference = timed_body  # the op's CPU kernel calls it by this module's name
    try:
        loaded = load_core(core)
        sides = {logprobs: f"logprobs {logprobs}", None: "logprobs off"}
        runs: dict[int | None, list[float]] = {k: [] for k in sides}
        print(f"{core}: batch {batch}, {steps} steps a run, {rounds} rounds in one process, threads {threads}")
        for round_ in range(1, rounds + 1):
            for setting in (logprobs, None) if round_ % 2 else (None, logprobs):
                engine = decoding_engine(loaded, batch, setting, steps)
                reductions.clear()
                runs[setting].append(statistics.median(timed_steps(engine, steps)))
                print(f"round {round_}  {sides[setting]:14s} median {runs[setting][-1] * 1e3:7.1f} ms  reduction "
                      f"{statistics.median(reductions) * 1e3:5.2f} ms ({len(reductions)} calls)")
    finally:
        reduction.reduce_logprobs_reference = body
    ratios = [mine / theirs for mine, theirs in zip(runs[logprobs], runs[None])]
    print(f"median run: {sides[logprobs]} {statistics.median(runs[logprobs]) * 1e3:.1f} ms, logprobs off "
          f"{statistics.median(runs[None]) * 1e3:.1f} ms; the rounds' ratios {', '.join(f'{r:.3f}' for r in ratios)}, "
          f"median {statistics.median(ratios):.3f}")


def alternating(core: Path, batch: int, logprobs: int, steps: int, rounds: int, threads: int) -> None:
    """``alternating_costs`` on ``core``: ``batch`` 4-token prompts, ``rounds`` rounds of ``steps`` step pairs;
    prints the median and quartiles of the pairs' ratios (logprobs ``logprobs`` over off)."""
    import torch

    torch.set_num_threads(threads)
    from ignition.runtime.core import load_core

    ratios = alternating_costs(load_core(core), lane_prompts(batch), logprobs, rounds, steps)
    median, low, high = spread(ratios)
    print(f"{core}: batch {batch}, logprobs {logprobs} over off, {len(ratios)} alternating step pairs: median "
          f"{median:.3f}, quartiles {low:.3f}-{high:.3f}, threads {threads}")


def _print_profile(events, wall: float, top: int) -> None:
    """The ``top`` operators of one profiled step by self time and input shape, then its totals."""
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{event.key:48s} {event.self_cpu_time_total / 1e3:8.2f} ms  n={event.count:<5d} "
              f"{str(event.input_shapes)[:90]}")
    products, other = operator_split(events)
    print(f"step {wall * 1e3:.1f} ms wall under the profiler; operator self time {products + other:.1f} ms, matrix "
          f"products {products:.1f} ms ({100 * products / (products + other):.1f}%), other operators {other:.1f} ms, "
          f"{sum(e.count for e in events)} operator calls")


def profile_shapes(core: Path, batch: int, logprobs: int | None, threads: int, top: int,
                   hf_checkpoint: Path | None = None) -> None:
    """One warmed decode step under torch.profiler with input shapes: the ``top`` operators by self time, by shape,
    and the matrix products' share of the step's operator time (``benchmarks._steps.MATRIX_PRODUCTS``); with
    ``hf_checkpoint``, the same for transformers' own step (eager attention) of the same prompts."""
    import torch

    torch.set_num_threads(threads)
    from ignition.runtime.core import load_core

    prompts = lane_prompts(batch)
    loaded = load_core(core)
    engine = warmed_engine(loaded, decode_requests(prompts, logprobs, 8))
    events, wall, _ = profiled_step(engine, record_shapes=True)
    print(f"Ignition, {core}:")
    _print_profile(events, wall, top)
    if hf_checkpoint is None:
        return
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, loaded.manifest["model"]["dtype"])  # torch_dtype: every transformers pyproject allows
    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint, torch_dtype=dtype, attn_implementation="eager").eval()
    steps: list = []
    _, walls, _, _ = hf_step_profile(model, prompts, logprobs or 5, steps=1, record_shapes=True, events=steps)
    print(f"\ntransformers (eager attention), {hf_checkpoint}:")
    _print_profile(steps[-1], walls[-1] / 1e3, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--logprobs", type=int, default=5, help="0 means off")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--compare", choices=("retain", "logprobs", "pack", "huge-pages"), default="retain")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="instead: profile one step and print the TOP operators by self time and input shape")
    parser.add_argument("--hf", type=Path, default=None, metavar="CHECKPOINT",
                        help="with --profile: also profile transformers' own step on this checkpoint")
    parser.add_argument("--rounds", type=int, default=0, help="with --compare logprobs: instead of fresh processes, "
                        "this many rounds of the two sides in one process, and the reduction timed inside the graph")
    parser.add_argument("--alternate", type=int, default=0, metavar="R", help="with --compare logprobs: instead, R "
                        "rounds of --steps step pairs of two engines stepping in turn in one process")
    parser.add_argument("--csv", type=Path, default=None, help="also add each side's steps to this CSV of data rows")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child run: JSON of its settings
    args = parser.parse_args()
    if args.hf is not None and not args.profile:
        parser.error("--hf needs --profile TOP")
    if args.alternate:
        if args.compare != "logprobs" or not args.logprobs or args.profile or args.rounds:
            parser.error("--alternate needs --compare logprobs, --logprobs K above 0, and neither --profile nor --rounds")
        alternating(args.core, args.batch, args.logprobs, args.steps, args.alternate, args.threads)
        return
    if args.rounds:
        if args.compare != "logprobs" or not args.logprobs or args.profile:
            parser.error("--rounds needs --compare logprobs, --logprobs K above 0 and no --profile (load options need "
                         "a fresh process each)")
        in_process(args.core, args.batch, args.logprobs, args.steps, args.rounds, args.threads)
        return
    if args.profile:
        profile_shapes(args.core, args.batch, args.logprobs or None, args.threads, args.profile, args.hf)
        return
    if args.one is not None:
        settings = json.loads(args.one)
        print(json.dumps(measure(args.core, args.batch, settings["logprobs"], args.steps, settings["retain"],
                                 args.threads, settings.get("pack", True))))
        return
    logprobs = args.logprobs or None
    from ignition import HUGE_PAGES_VARIABLE

    sides = {"retain": [("retained", {"retain": True, "logprobs": logprobs}),
                        ("not retained", {"retain": False, "logprobs": logprobs})],
             "logprobs": [(f"logprobs {args.logprobs}", {"retain": True, "logprobs": logprobs}),
                          ("logprobs off", {"retain": True, "logprobs": None})],
             "pack": [("packed", {"retain": True, "logprobs": logprobs, "pack": True}),
                      ("aten.linear", {"retain": True, "logprobs": logprobs, "pack": False})],
             "huge-pages": [(name, {"retain": True, "logprobs": logprobs, "env": {HUGE_PAGES_VARIABLE: flag}})
                            for name, flag in (("huge pages", "1"), ("4 KiB pages", "0"))]
             }[args.compare]
    print(f"{args.core}: batch {args.batch}, {args.steps} steps a run, threads {args.threads}")
    steps: dict[str, list[float]] = {name: [] for name, _ in sides}
    for pair in range(1, args.pairs + 1):
        for name, settings in sides:
            command = [sys.executable, "-m", "benchmarks.decode_steps", "--core", str(args.core), "--threads",
                       str(args.threads), "--batch", str(args.batch), "--steps", str(args.steps), "--one",
                       json.dumps(settings)]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ | settings.get("env", {}))
            if done.returncode != 0:
                sys.exit(f"{name}: failed:\n{done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            steps[name] += result["steps"]
            print(f"pair {pair}  {name:14s} median {result['median_ms']:7.1f} ms  min {result['min_ms']:7.1f} ms")
    if args.csv is not None:
        config = {"compare": args.compare, "logprobs": args.logprobs, "core": str(args.core), "threads": args.threads,
                  "steps": args.steps, "pairs": args.pairs}
        write_rows(args.csv, [step_row("decode_steps", name, "batch", args.batch, steps[name], config)
                              for name, _ in sides])
        print(f"{len(sides)} rows written to {args.csv}")


if __name__ == "__main__":
    main()
