"""One engine decode step's operator time by graph node: where a step's time goes outside the GEMMs.

``python -m benchmarks.step_nodes --core DIR --threads 2 --batch 8 --steps 3`` loads the core, admits ``--batch``
requests (4-token prompts, logprobs 5), prefills them and runs 3 warm-up rounds, then profiles ``--steps`` decode
steps. Each top-level operator call of the step is matched to the decode graph's node that made it, in program
order, and the table sums, per node kind (its operator; RMSNorm and similar nodes split by their normalized shape),
the nodes, the operator calls they made (nested ones included) and their time (nested calls included), averaged over
the steps. ``benchmarks.realsize`` (through ``benchmarks._steps.step_profile``) reports the same steps' matrix-product share from the flat profile; this shows
which nodes the rest comes from (about 4 us an operator call between the GEMMs at Qwen3-0.6B's width, where a tight
loop of the same call costs 0.7 us).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def _calls(event) -> int:
    return 1 + sum(_calls(child) for child in event.cpu_children)


def node_table(core, batch: int, steps: int) -> tuple[list[tuple[str, int, int, float]], float, float]:
    """(rows of (node kind, nodes, operator calls, ms) by time, the steps' mean operator ms, the mean ms outside the
    graph's calls), each a mean over ``steps`` profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks._steps import decode_requests, lane_prompts, warmed_engine
    from ignition.catalog.enums import Operation

    engine = warmed_engine(core, decode_requests(lane_prompts(batch), 5, steps))
    variant = next(v for v in core.variants.values() if v.operation is Operation.DECODE and v.capacity == batch)
    from ignition.runtime.backends import blocked_linear, cell_writes, paged_attention, rms_norm
    from ignition.runtime.backends.direct_calls import overload

    GRAPH_CALLS = blocked_linear.GRAPH_CALLS | paged_attention.GRAPH_CALLS | cell_writes.GRAPH_CALLS | \
        rms_norm.GRAPH_CALLS

    def operator(node) -> str:  # namespace.name: the native kernels' graph calls by their profiler names
        return GRAPH_CALLS[node.target].replace("::", ".") if node.target in GRAPH_CALLS else str(overload(node))

    nodes = [n for n in variant.runner.graph_module.graph.nodes if n.op == "call_function" and
             (isinstance(overload(n), torch._ops.OpOverload) or n.target in GRAPH_CALLS)]
    kinds = [operator(n).split(".")[1] + (f" {n.args[1]}" if operator(n).startswith("aten.rms_norm") else "")
             for n in nodes]
    count, calls, times = collections.Counter(), collections.Counter(), collections.Counter()
    total = outside = 0.0
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            engine.step()
        top = sorted((e for e in trace.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
        total += sum(e.cpu_time_total for e in top)
        start = next(i for i, e in enumerate(top) if e.name == "aten::embedding")
        position = start - next(i for i, n in enumerate(nodes) if operator(n).startswith("aten.embedding"))
        matched = set()
        for node, kind in zip(nodes, kinds):
            if position >= len(top):
                break
            event = top[position]
            if event.name.split("::")[-1] != operator(node).split(".")[1]:
                continue  # a node that calls no operator here (a shape read)
            count[kind] += 1
            calls[kind] += _calls(event)
            times[kind] += event.cpu_time_total
            matched.add(position)
            position += 1
        outside += sum(e.cpu_time_total for i, e in enumerate(top) if i not in matched)
    rows = [(kind, count[kind] // steps, calls[kind] // steps, times[kind] / steps / 1e3)
            for kind in sorted(times, key=times.get, reverse=True)]
    return rows, total / steps / 1e3, outside / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="a decode capacity of the core")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be at least 1")

    import torch

    torch.set_num_threads(args.threads)
    from ignition.catalog.enums import Operation
    from ignition.runtime.core import load_core

    core = load_core(args.core)
    if not any(v.operation is Operation.DECODE and v.capacity == args.batch for v in core.variants.values()):
        parser.error(f"{args.core} has no decode variant of capacity {args.batch}")
    rows, total, outside = node_table(core, args.batch, args.steps)
    print(f"one decode step at batch {args.batch}, mean of {args.steps}: {total:.1f} ms of operator time, "
          f"{outside:.1f} ms of it outside the graph's nodes")
    print(f"{'node kind':40s} {'nodes':>6s} {'calls':>7s} {'ms':>8s}")
    for kind, nodes, calls, ms in rows[:args.top]:
        print(f"{kind:40s} {nodes:6d} {calls:7d} {ms:8.2f}")


if __name__ == "__main__":
    main()
