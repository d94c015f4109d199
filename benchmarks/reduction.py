"""Logprob reduction: our op against the baseline most engines run, in the same process.

Baseline (vLLM-style): ``logprobs = logits.float().log_softmax(-1)`` over the full vocabulary,
then ``topk`` for K alternatives, ``gather`` for the chosen and selected ids, and the chosen
token's rank by counting ``logprobs > chosen``. Ours: ``ignition.components.logprobs.reduce_logprobs``
(the ``ignition::reduce_logprobs`` op: the chunked torch reference on CPU, the Triton launches on
CUDA) writing the packed output.

Time: each path is called ``repeats`` times after a warm-up, the two paths' calls interleaved so
both see the same load; the table shows medians and the speedup of the medians, and the speedup
of the best calls (the least disturbed; the machines this runs on are shared). On CUDA each call
is one CUDA-graph replay timed with CUDA events.
Peak extra memory: on CPU, ``torch.profiler`` with ``profile_memory=True`` records every allocation
and free made by torch with its size; the running sum of those sizes in time order, maximised,
is the peak memory the call needed beyond its inputs and the preallocated output. On CUDA, the
allocator's peak during one eager call minus what was allocated before it.
Floor: one read of the logits (rows x vocab x element size). On CUDA it is also shown as a time
at 4.8 TB/s (H200 HBM3e) with ours as a multiple of it.

Run ``python -m benchmarks.reduction [--device cpu|cuda] [--threads N] [--quick] [--rows 8] [--spread 30]``. Numbers are
from whatever machine runs it; on a shared machine expect noise of tens of percent.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, packed_width
from ignition.components.logprobs import reduce_logprobs

ROWS = {"cpu": (1, 8, 64), "cuda": (1, 8, 64, 256, 1024)}
VOCABS = (32000, 129280, 151936)
MODES = ("k0", "k1", "k20", "ids128")
HBM_BYTES_PER_S = 4.8e12  # H200


def make_inputs(rows, vocab, mode, dtype, device="cpu", spread=4.0):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * spread).to(dtype)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    explicit = mode == "ids128"
    k = NATURAL_K if explicit else int(mode[1:])
    token_ids = torch.randint(0, vocab, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32) if explicit else None
    counts = torch.full((rows,), MAX_SELECTED_IDS, dtype=torch.int32) if explicit else None
    out = torch.empty(rows, packed_width(k, explicit), dtype=torch.int32)
    tensors = [t.to(device) if t is not None else None
               for t in (logits, chosen, torch.ones(rows, dtype=torch.int32), out, token_ids, counts)]
    return (*tensors, k)


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


def cpu_times_ms(functions, args, repeats):
    """Wall time of every call of each function, calls interleaved so all see the same load."""
    for fn in functions:
        fn(*args)  # warm-up
    times = [[] for _ in functions]
    for _ in range(repeats):
        for fn, own in zip(functions, times):
            start = time.perf_counter()
            fn(*args)
            own.append(1e3 * (time.perf_counter() - start))
    return times


def cuda_times_ms(functions, args, repeats):
    """CUDA-event time of every replay of each function's CUDA graph, replays interleaved."""
    graphs = []
    for fn in functions:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: compiles kernels, fills the allocator
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        graphs.append(graph)
    times = [[] for _ in functions]
    for _ in range(repeats):
        for graph, own in zip(graphs, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            own.append(start.elapsed_time(end))
    return times


def cpu_peak_extra_bytes(fn, args):
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


def cuda_peak_extra_bytes(fn, args):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn(*args)
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def prepare_cuda_launches(shapes, dtype_names):
    """Prepare every shape's launches for this GPU's target ahead of time, as export-core does; returns the
    binding of the prepared-kernel launcher (a context manager): the timed path launches cubins, never
    JIT-compiled Triton."""
    import tempfile
    from pathlib import Path

    from ignition.components.device_reduction import bind_launcher
    from ignition.components.triton_logprobs import launch_plan
    from ignition.exporter.kernels import launch_key, prepare_kernels
    from ignition.runtime.launchers.reduction import PreparedReduction, ReductionShape, target_name

    device = torch.device("cuda", torch.cuda.current_device())
    target = target_name(torch.cuda.get_device_capability(device))
    specs, keyed = [], {}
    for dtype_name in dtype_names:
        for rows, vocab, mode in shapes:
            explicit = mode == "ids128"
            k = NATURAL_K if explicit else int(mode[1:])
            plan = launch_plan(rows, vocab, vocab, k, explicit, getattr(torch, dtype_name))
            keyed[ReductionShape(rows, vocab, vocab, k, explicit, dtype_name)] = [launch_key(spec) for spec in plan]
            specs += plan
    root = Path(tempfile.mkdtemp(prefix="ignition-bench-kernels-"))
    table = prepare_kernels(specs, [target], root)
    return bind_launcher(device, PreparedReduction.from_table(root, table, keyed, device, target))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="only 64 x 151936 at K=20 and 128 ids")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per path (default: by size)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op CPU threads (default: torch's)")
    parser.add_argument("--spread", type=float, default=4.0,
                        help="the logits' standard deviation: at 30 most lanes sit more than 87 below the row's "
                             "maximum, where the reference adds no mass (FLUSH_BELOW) and CPU exp would be slow")
    parser.add_argument("--rows", default="", help="comma-separated row counts (default: by device)")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False on this machine")
    if options.threads:
        torch.set_num_threads(options.threads)
    on_cuda = options.device == "cuda"
    rows_list = tuple(map(int, options.rows.split(","))) if options.rows else ROWS[options.device]
    shapes = [(64, 151936, m) for m in ("k20", "ids128")] if options.quick else [
        (r, v, m) for r in rows_list for v in VOCABS for m in MODES]
    device = torch.cuda.get_device_name() if on_cuda else f"CPU, torch threads {torch.get_num_threads()}"
    timing = "CUDA-graph replays" if on_cuda else "wall time"
    print(f"{device}; {timing}: median (best) of interleaved calls; memory: peak extra")
    floor_head = "floor ms  ours/floor" if on_cuda else "floor MB"
    header = (f"{'dtype':>8} {'rows':>4} {'vocab':>7} {'mode':>6} | {'ours ms':>8} {'base ms':>8} {'speedup':>7} "
              f"{'(best)':>7} | {'ours MB':>8} {'base MB':>8} | {floor_head}")
    print(header)
    print("-" * len(header))
    bindings = contextlib.ExitStack()  # the launcher stays bound to this thread while the rows are timed
    if on_cuda:
        bindings.enter_context(prepare_cuda_launches(shapes, options.dtype))
    times_ms = cuda_times_ms if on_cuda else cpu_times_ms
    peak_extra_bytes = cuda_peak_extra_bytes if on_cuda else cpu_peak_extra_bytes
    for dtype_name, (rows, vocab, mode) in [(d, s) for d in options.dtype for s in shapes]:
        dtype = getattr(torch, dtype_name)
        element = torch.tensor([], dtype=dtype).element_size()
        args = make_inputs(rows, vocab, mode, dtype, options.device, options.spread)
        repeats = options.repeats or (100 if on_cuda else max(11, min(30, int(4e7 // (rows * vocab)))))
        ours_times, base_times = times_ms((ours, baseline), args, repeats)
        ours_ms, base_ms = statistics.median(ours_times), statistics.median(base_times)
        best_ratio = min(base_times) / min(ours_times)
        ours_mb, base_mb = peak_extra_bytes(ours, args) / 2**20, peak_extra_bytes(baseline, args) / 2**20
        floor_bytes = rows * vocab * element
        floor = (f"{1e3 * floor_bytes / HBM_BYTES_PER_S:8.4f} {ours_ms / (1e3 * floor_bytes / HBM_BYTES_PER_S):10.1f}x"
                 if on_cuda else f"{floor_bytes / 2**20:8.2f}")
        print(f"{dtype_name:>8} {rows:>4} {vocab:>7} {mode:>6} | {ours_ms:8.2f} {base_ms:8.2f} "
              f"{base_ms / ours_ms:6.2f}x "
              f"{best_ratio:6.2f}x | {ours_mb:8.3f} {base_mb:8.2f} | {floor}")


if __name__ == "__main__":
    main()
