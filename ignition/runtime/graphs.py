"""CUDA graphs: every variant captured once after warm-up, with static buffers and one shared pool.

A variant's inputs, outputs and state are the loader's persistent buffers, which the engine
fills in place, so a replay reads and writes exactly what an eager call would. Warm-up and
capture run on zeroed inputs (slot 0, no requesting lane), and the state is zeroed again
afterwards. A variant whose graph calls a host-synchronizing op cannot be captured: it is
replayed eagerly and reported, never silently dropped.

Every other failure stops the load (``CaptureError``): a program that fails its first eager run on
the device (a tensor left on another device, a missing kernel) names the variant and the cause, and
a failed capture is never papered over by eager replay, since torch can leave capture state behind
that breaks later captures and ``empty_cache``; the message suggests ``--eager``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ignition.catalog.enums import Role

HOST_SYNCING_OPS = {
    "ignition.score_prompt_rows.default": "prompt scoring runs its torch reference (host-synchronizing) on CUDA",
    "cond": "routed experts branch on the host (torch.cond reads each expert's predicate, recipes/moe.py)",
}
WARMUP_RUNS = 2


class CaptureError(RuntimeError):
    """A variant failed its eager warm-up or its capture; the load stops, naming it and the cause."""


@dataclass(slots=True)
class CaptureReport:
    captured: list[str] = field(default_factory=list)
    eager: dict[str, str] = field(default_factory=dict)  # variant -> why it replays eagerly
    pool_bytes: int = 0  # device memory the capture pool reserved


class GraphReplay:
    """``run(buffers)`` for a captured variant: replays the graph on the current stream."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph

    def __call__(self, buffers):
        self.graph.replay()


def eager_reason(program) -> str | None:
    for node in program.graph.nodes:
        reason = HOST_SYNCING_OPS.get(str(node.target))
        if reason is not None:
            return reason
    return None


def capture_variants(variants: dict, programs: dict, state: dict[str, torch.Tensor],
                     device: torch.device) -> CaptureReport:
    """Capture every capturable variant into one pool; ``variant.run`` becomes its replay."""
    report = CaptureReport()
    pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize(device)
    reserved_before = torch.cuda.memory_reserved(device)
    for variant in sorted(variants.values(), key=lambda v: -sum(a.nbytes for a in v.arguments)):  # largest first
        reason = eager_reason(programs[variant.name])
        if reason is not None:
            report.eager[variant.name] = reason
            continue
        for arg in variant.arguments:
            if arg.role is Role.INPUT:
                variant.buffers[arg.name].zero_()
        try:  # the first eager runs on the device, on zeroed buffers: a program that cannot run stops the load
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    variant.run(variant.buffers)
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
        except Exception as exc:  # the program itself is broken on this device
            raise CaptureError(f"variant {variant.name} fails its first eager run on {device}: "
                               f"{type(exc).__name__}: {_first_line(exc)}") from None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                variant.run(variant.buffers)
        except Exception as exc:  # torch may leave capture state behind: no eager fallback, stop here
            raise CaptureError(f"variant {variant.name}: CUDA-graph capture failed on {device} "
                               f"({type(exc).__name__}: {_first_line(exc)}); load with --eager "
                               f"(load_core(eager=True)) to replay without CUDA graphs") from None
        variant.wrap("cuda-graph", lambda _eager, graph=graph: GraphReplay(graph))  # replaces the eager replay
        report.captured.append(variant.name)
    torch.cuda.synchronize(device)
    for tensor in state.values():
        tensor.zero_()
    report.pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
    return report


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
