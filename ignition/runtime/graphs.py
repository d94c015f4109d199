"""CUDA graphs: every variant captured once after its first eager runs, with static buffers and one shared pool.

A variant's inputs, outputs and state are the loader's persistent buffers, which the engine fills in place, so a
replay reads and writes exactly what an eager call would. Before anything takes their addresses, each variant's
inputs move into one arena (``transfer.arrange_inputs``: one upload per submission). Then every program runs
eagerly on the device on zeroed inputs (slot 0, no requesting lane), the first time it ever runs there
(``first_runs``); capture follows, and the state is zeroed again afterwards. A variant whose graph calls a
host-synchronizing op cannot be captured: it is replayed eagerly and reported, never silently dropped.

Every other failure stops the load with a ``CaptureError`` (a ``CoreLoadError``): a program that fails its first
eager run names the variant and the cause; a failed capture is never papered over by eager replay. torch can leave
capture state behind when a capture fails (the stream still capturing, the caching allocator still routing the
capturing thread's allocations into the graph's pool, the capture stream still current), which would break later
captures and ``empty_cache``; ``capture_one`` undoes each of those before raising, and the message suggests
``--eager``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ignition.catalog.enums import Role
from ignition.runtime.transfer import arrange_inputs
from ignition.runtime.verified import CoreLoadError

HOST_SYNCING_OPS = {
    "ignition.score_prompt_rows.default": "prompt scoring runs its torch reference (host-synchronizing) on CUDA",
    "cond": "routed experts branch on the host (torch.cond reads each expert's predicate, recipes/moe.py)",
}
WARMUP_RUNS = 2


class CaptureError(CoreLoadError):
    """A variant failed its first eager runs or its capture; the load stops, naming it and the cause."""


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


def first_runs(variant, device: torch.device, runs: int = WARMUP_RUNS) -> None:
    """Run ``variant`` eagerly ``runs`` times on a side stream on zeroed inputs; CaptureError naming the variant
    and the cause when it fails (a tensor left on another device, a missing or misaligned kernel)."""
    for arg in variant.arguments:
        if arg.role is Role.INPUT:
            variant.buffers[arg.name].zero_()
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(runs):
                variant.run(variant.buffers)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
    except Exception as exc:  # the program itself is broken on this device
        raise CaptureError(f"variant {variant.name} fails its first eager run on {device}: "
                           f"{type(exc).__name__}: {_first_line(exc)}") from None


def capture_one(variant, pool, stream, device: torch.device) -> torch.cuda.CUDAGraph:
    """The variant's run captured on ``stream`` into a CUDA graph that allocates from ``pool`` (every capture of a
    pool on one stream, so the pool's blocks are reused across them); CaptureError (suggesting ``--eager``) when
    the capture fails, after undoing what the failed capture left behind."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # as torch.cuda.graph does: the pool starts from every cached block returned
    with torch.cuda.stream(stream):  # restores the previous current stream however the capture ends
        try:
            graph.capture_begin(pool=pool)
            variant.run(variant.buffers)
            graph.capture_end()  # raises when something in the body invalidated the capture
        except Exception as exc:
            abandon_capture(graph, pool, device)
            raise CaptureError(f"variant {variant.name}: CUDA-graph capture failed on {device} "
                               f"({type(exc).__name__}: {_first_line(exc)}); load with --eager "
                               f"(load_core(eager=True)) to replay without CUDA graphs") from None
    return graph


def abandon_capture(graph, pool, device: torch.device) -> None:
    """Undo what a failed capture can leave behind, each step only where it is still in place: end a stream capture
    still running, stop the caching allocator routing allocations into the pool (torch before 2.12 skips this when
    ``capture_end`` raises), drop the graph; then wait for the device, so later captures and ``empty_cache`` work."""
    if torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()
        except Exception:  # an invalidated capture ends with an error: ended is all that matters here
            pass
    end_allocating = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end_allocating is not None and pool is not None:
        try:
            end_allocating(device.index, pool)
        except Exception:  # not routing to the pool any more: capture_end already stopped it
            pass
    try:
        graph.reset()
    except Exception:
        pass
    torch.cuda.synchronize(device)


def capture_variants(variants: dict, programs: dict, state: dict[str, torch.Tensor],
                     device: torch.device) -> CaptureReport:
    """Capture every capturable variant into one pool; ``variant.run`` becomes its replay. Each variant's inputs
    are arranged into one arena first and every variant runs eagerly first (``first_runs``)."""
    report = CaptureReport()
    for variant in variants.values():
        arrange_inputs(variant)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    reserved_before = torch.cuda.memory_reserved(device)
    for variant in sorted(variants.values(), key=lambda v: -sum(a.nbytes for a in v.arguments)):  # largest first
        reason = eager_reason(programs[variant.name])
        first_runs(variant, device, runs=1 if reason else WARMUP_RUNS)
        if reason is not None:
            report.eager[variant.name] = reason
            continue
        graph = capture_one(variant, pool, stream, device)
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
