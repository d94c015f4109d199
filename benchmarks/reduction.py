"""Logprob reduction: our CPU path against the baseline most engines run, in the same process.

Baseline (vLLM-style): ``logprobs = logits.float().log_softmax(-1)`` over the full vocabulary,
then ``topk`` for K alternatives, ``gather`` for the chosen and selected ids, and the chosen
token's rank by counting ``logprobs > chosen``. Ours: ``ignition.components.logprobs.reduce_logprobs``
(the reference op, chunked so no [rows, vocab] FP32 copy exists) writing the packed output.

Time: best of repeated calls after a warm-up (the least disturbed run; the machines this runs on
are shared), the two paths' calls interleaved so both see the same load.
Peak extra memory: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocation
and free made by torch with its size; the running sum of those sizes in time order, maximised,
is the peak memory the call needed beyond its inputs and the preallocated output.

The "GPU logits B/pos" columns count the bytes of logits each position reads in the four
Triton launches, from the launch plan: tiles x tile width x element size in launch 1, the same
again in launch 3 for rows with natural alternatives, plus one gathered element for the chosen
token and each reported alternative or selected id in launch 4 (launch 2 reads only stats).

Run ``python -m benchmarks.reduction`` (``--quick`` for the headline shape only). Numbers are
from whatever machine runs it; on a shared machine expect noise of tens of percent.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, packed_width
from ignition.components.logprobs import reduce_logprobs

ROWS = (1, 8, 64)
VOCABS = (32000, 129280, 151936)
MODES = ("k0", "k1", "k20", "ids128")


def make_inputs(rows, vocab, mode, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    explicit = mode == "ids128"
    k = NATURAL_K if explicit else int(mode[1:])
    token_ids = torch.randint(0, vocab, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32) if explicit else None
    counts = torch.full((rows,), MAX_SELECTED_IDS, dtype=torch.int32) if explicit else None
    out = torch.empty(rows, packed_width(k, explicit), dtype=torch.int32)
    return logits, chosen, torch.ones(rows, dtype=torch.int32), out, token_ids, counts, k


def ours(logits, chosen, requested, out, token_ids, counts, k):
    reduce_logprobs(logits, chosen, requested, out, vocab_size=logits.shape[1], k=k, token_ids=token_ids,
                    token_id_counts=counts)


def baseline(logits, chosen, requested, out, token_ids, counts, k):
    logprobs = logits.float().log_softmax(dim=-1)  # [rows, vocab] FP32
    chosen_lp = logprobs.gather(1, chosen[:, None])
    rank = (logprobs > chosen_lp).sum(dim=1) + 1
    top = logprobs.topk(k, dim=1) if k and token_ids is None else None
    selected = logprobs.gather(1, token_ids.long()) if token_ids is not None else None
    return chosen_lp, rank, top, selected


def best_ms(functions, args, repeats):
    """Best-of-``repeats`` wall time of each function, calls interleaved so both see the same load."""
    best = [float("inf")] * len(functions)
    for fn in functions:
        fn(*args)  # warm-up
    for _ in range(repeats):
        for i, fn in enumerate(functions):
            start = time.perf_counter()
            fn(*args)
            best[i] = min(best[i], time.perf_counter() - start)
    return [1e3 * t for t in best]


def peak_extra_bytes(fn, args):
    """Peak of the running sum of CPU allocation sizes torch reports while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
        del result
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def gpu_logits_bytes_per_position(rows, vocab, mode, dtype):
    from ignition.components.triton_logprobs import launch_plan

    explicit = mode == "ids128"
    k = NATURAL_K if explicit else int(mode[1:])
    plan = launch_plan(rows, vocab, vocab, k, explicit, dtype)
    tile, tiles = plan[0].constexprs["TILE"], plan[0].grid[1]
    element = torch.tensor([], dtype=dtype).element_size()
    natural_tiles = 0 if explicit or k == 0 else tiles  # launch 3 returns early for rows with selected ids
    gathers = 1 + (MAX_SELECTED_IDS if explicit else k)
    return (tiles + natural_tiles) * tile * element + gathers * element


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only 64 x 151936 at K=20 and 128 ids")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per path (default: by size)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    dtype = getattr(torch, options.dtype)
    shapes = [(64, 151936, m) for m in ("k20", "ids128")] if options.quick else [
        (r, v, m) for r in ROWS for v in VOCABS for m in MODES]
    print(f"logits {options.dtype}, torch threads {torch.get_num_threads()}; times are best-of-N, memory is peak extra")
    header = (f"{'rows':>4} {'vocab':>7} {'mode':>6} | {'ours ms':>8} {'base ms':>8} {'speedup':>7} | "
              f"{'ours MB':>8} {'base MB':>8} {'mem x':>7} | {'GPU logits B/pos':>16}")
    print(header)
    print("-" * len(header))
    for rows, vocab, mode in shapes:
        args = make_inputs(rows, vocab, mode, dtype)
        repeats = options.repeats or max(5, min(30, int(4e7 // (rows * vocab))))
        ours_ms, base_ms = best_ms((ours, baseline), args, repeats)
        ours_mb, base_mb = peak_extra_bytes(ours, args) / 2**20, peak_extra_bytes(baseline, args) / 2**20
        print(f"{rows:>4} {vocab:>7} {mode:>6} | {ours_ms:8.2f} {base_ms:8.2f} {base_ms / ours_ms:6.2f}x | "
              f"{ours_mb:8.3f} {base_mb:8.2f} {base_mb / max(ours_mb, 1e-9):6.1f}x | "
              f"{gpu_logits_bytes_per_position(rows, vocab, mode, dtype):16,d}")


if __name__ == "__main__":
    main()
