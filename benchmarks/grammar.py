"""Structured output at a Qwen-sized vocabulary: grammar compile time, per-step mask fill, and the graph's cost.

Tokenizer: a synthetic byte-level BPE with Qwen2's layout (151,643 regular tokens, 22 special tokens from id
151,643, the first of them EOS), built offline by ``tests/_grammar_cases.byte_level_bpe``; the rows are
``ceil(151,936 / 32) = 4,748`` int32 words, as for a Qwen checkpoint's ``vocab_padded``.

Measured, per JSON schema of ``tests/_grammar_cases.SCHEMAS`` (and a regex, a choice and a Lark grammar):

- ``compile``: ``GrammarCompiler._compile`` (llguidance builds the grammar and its lexer), cold, best of 3;
- ``first fill``: the first ``GrammarMatcher.fill`` of a fresh matcher (lazy lexer states are built here);
- ``fill``: median, 99th percentile and max of ``fill`` over one generated document (the closing picker of the
  tests: the shortest document) plus the steps of a seeded random walk; every step is a real ``fill`` then
  ``accept``;
- batched: ``GrammarMatcher.fill_many`` over 8 and 32 lanes (one per schema, cycled), per call;
- overlapped: the same walks with each row prefetched right after the accept (``GrammarMatcher.prefetch``, what the
  engine does) and ``--between-ms`` of GIL-holding Python work before the next ``fill``: what a fill still costs on
  the engine's critical path;
- graph: ``components.constraints.sampling_logits`` (unpack the bitmask, mask, bias) against
  ``components.sampling.sample`` on ``[rows, 151936]`` float32 logits, on this machine's CPU.

Run ``python -m benchmarks.grammar [--threads N] [--steps N] [--quick]``. Numbers are from whatever machine runs
it; on a shared machine expect noise of tens of percent.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import best_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

REGULAR, SPECIALS, VOCAB_PADDED = 151_643, 22, 151_936


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def specs(quick: bool):
    from _grammar_cases import SCHEMAS

    from ignition.runtime.grammar_spec import grammar_spec
    names = sorted(SCHEMAS)[:6] if quick else sorted(SCHEMAS)
    cases = [(name, grammar_spec(structured_outputs={"json": SCHEMAS[name]})) for name in names]
    cases += [("regex", grammar_spec(structured_outputs={"regex": r"[A-Z][a-z]{2,8}-[0-9]{3}"})),
              ("choice", grammar_spec(structured_outputs={"choice": ["positive", "negative", "neutral"]})),
              ("lark", grammar_spec(structured_outputs={"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/'}))]
    return cases


def walk(compiler, compiled, rank, steps: int, seed: int) -> tuple[list[float], float]:
    """Fill-then-accept until the document ends (closing picker), then a seeded random walk of ``steps`` steps on a
    fresh matcher; returns every fill's seconds and the first fill's."""
    times, first = [], None
    row = np.zeros(compiler.words, dtype=np.int32)
    rng = random.Random(seed)
    for mode in ("closing", "random"):
        matcher = compiler.matcher(compiled)
        for step in range(steps if mode == "random" else 4 * steps):
            if matcher.stopped:
                break
            started = time.perf_counter()
            matcher.fill(row)
            elapsed = time.perf_counter() - started
            if first is None:
                first = elapsed
            times.append(elapsed)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            token = int(min(allowed, key=rank) if mode == "closing" else rng.choice(allowed.tolist()))
            if token == compiler.eos_token_id:
                break
            matcher.accept(token)
    return times, first


def overlapped(compiler, compiled, rank, steps: int, seed: int, between: float) -> list[float]:
    """The walks of ``walk``, each step's row prefetched (``GrammarMatcher.prefetch``) right after the accept, then
    ``between`` seconds of Python work holding the GIL (the engine's bookkeeping before its next submission), then
    ``fill``: the seconds each ``fill`` still takes on the critical path (waiting for the prefetch, copying it)."""
    waits = []
    row = np.zeros(compiler.words, dtype=np.int32)
    rng = random.Random(seed)
    for mode in ("closing", "random"):
        matcher = compiler.matcher(compiled)
        matcher.prefetch()
        for step in range(steps if mode == "random" else 4 * steps):
            if matcher.stopped:
                break
            _busy(between)
            started = time.perf_counter()
            matcher.fill(row)
            waits.append(time.perf_counter() - started)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            token = int(min(allowed, key=rank) if mode == "closing" else rng.choice(allowed.tolist()))
            if token == compiler.eos_token_id:
                break
            matcher.accept(token)
            matcher.prefetch()
    return waits


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def batched(compiler, compiled: list, lanes: int, repeats: int) -> float:
    from ignition.runtime.grammar import GrammarMatcher
    matchers = [(compiler.matcher(compiled[i % len(compiled)]), i) for i in range(lanes)]
    bitmask = np.zeros((lanes, compiler.words), dtype=np.int32)
    GrammarMatcher.fill_many(matchers, bitmask)  # warm
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        GrammarMatcher.fill_many(matchers, bitmask)
        best = min(best, time.perf_counter() - started)
    return best


def graph_cost(rows: int, repeats: int) -> tuple[float, float]:
    """(sampling_logits seconds, sample seconds) on [rows, VOCAB_PADDED], best of ``repeats``."""
    from ignition.catalog.contract import MAX_LOGIT_BIAS, bitmask_words
    from ignition.components.constraints import sampling_logits
    from ignition.components.sampling import SamplingTensors, sample
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB_PADDED, generator=generator)
    buffers = {"token_bitmask": torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(VOCAB_PADDED)),
                                              dtype=torch.int32, generator=generator),
               "logit_bias_ids": torch.randint(0, VOCAB_PADDED, (rows, MAX_LOGIT_BIAS), generator=generator),
               "logit_bias_values": torch.randn(rows, MAX_LOGIT_BIAS, generator=generator)}
    counts = torch.zeros(rows, VOCAB_PADDED, dtype=torch.int32)
    seen = torch.zeros(rows, VOCAB_PADDED, dtype=torch.bool)
    params = SamplingTensors.from_requests([{"temperature": 1.0, "seed": i} for i in range(rows)])

    def best(fn) -> float:
        fn()  # warm-up
        return best_of(fn, repeats)
    return (best(lambda: sampling_logits(buffers, logits)),
            best(lambda: sample(logits, counts, seen, params, REGULAR + SPECIALS)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llguidance mask threads")
    parser.add_argument("--steps", type=int, default=64, help="random-walk steps per grammar")
    parser.add_argument("--quick", action="store_true", help="six schemas, fewer repeats")
    parser.add_argument("--between-ms", type=float, default=2.0,
                        help="engine work between a step's accept and the next fill, for the overlapped walk")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from _grammar_cases import byte_level_bpe, preference, token_pieces

    from ignition.runtime import grammar
    grammar.MASK_THREADS = args.threads
    started = time.perf_counter()
    text, eos = byte_level_bpe(REGULAR, SPECIALS)
    built = time.perf_counter() - started
    started = time.perf_counter()
    compiler = grammar.GrammarCompiler(text, VOCAB_PADDED, eos, workers=1)
    tokenizer_seconds = time.perf_counter() - started
    print(f"tokenizer: {REGULAR + SPECIALS} ids, vocab_padded {VOCAB_PADDED} ({compiler.words} words per row); "
          f"built in {built:.2f} s, llguidance tokenizer in {tokenizer_seconds:.2f} s; threads {args.threads}")
    rank = preference(token_pieces(text), eos)
    print("\n| grammar | compile ms | first fill ms | fill median ms | fill p99 ms | fill max ms | steps |")
    print("|---|---|---|---|---|---|---|")
    compiled, all_times = [], []
    for name, spec in specs(args.quick):
        compile_seconds = min(_timed(lambda: compiler._compile(spec)) for _ in range(1 if args.quick else 3))
        done = compiler.compile(spec)
        compiled.append(done)
        times, first = walk(compiler, done, rank, args.steps, seed=len(compiled))
        all_times += times
        print(f"| {name} | {_ms(compile_seconds)} | {_ms(first)} | {_ms(statistics.median(times))} | "
              f"{_ms(float(np.percentile(times, 99)))} | {_ms(max(times))} | {len(times)} |")
    print(f"\nall fills: {len(all_times)} steps, median {_ms(statistics.median(all_times))} ms, "
          f"p99 {_ms(float(np.percentile(all_times, 99)))} ms, max {_ms(max(all_times))} ms")
    print(f"\noverlapped (prefetch after each accept, then {args.between_ms} ms of engine work holding the GIL):")
    print("| fill on the critical path | median ms | p99 ms | max ms | steps |\n|---|---|---|---|---|")
    waits = [w for index, done in enumerate(compiled)
             for w in overlapped(compiler, done, rank, args.steps, index + 1, args.between_ms / 1e3)]
    for label, times in (("synchronous `fill`", all_times), ("prefetched `fill` (wait + copy)", waits)):
        print(f"| {label} | {_ms(statistics.median(times))} | {_ms(float(np.percentile(times, 99)))} | "
              f"{_ms(max(times))} | {len(times)} |")
    repeats = 5 if args.quick else 20
    for lanes in (8, 32):
        print(f"fill_many, {lanes} lanes: {_ms(batched(compiler, compiled, lanes, repeats))} ms per step (best of "
              f"{repeats})")
    print("\n| rows | sampling_logits ms | sample ms | ratio |\n|---|---|---|---|")
    for rows in (1, 8):
        masked, sampled = graph_cost(rows, 5 if args.quick else 20)
        print(f"| {rows} | {_ms(masked)} | {_ms(sampled)} | {masked / sampled:.2f} |")
    compiler.close()


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
