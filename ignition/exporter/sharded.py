"""Export of a tensor-parallel build: every rank's graphs captured under a fake process group.

Rank r's graphs are traced with ``torch.distributed`` initialized as the fake backend
(``torch.testing._internal.distributed.fake_pg``) at rank r of N, so each functional collective
is recorded in the ``.pt2`` with its group size and the default group's name. At run time every
rank starts a real gloo or NCCL default group (ignition/runtime/parallel/group.py), whose name is the
same, and the recorded collectives bind to it. Rank 0's files are the core's ordinary weights and
graphs; rank r >= 1 stores ``ranks/{r}/weights.safetensors`` (its header metadata names rank r) and
``ranks/{r}/graphs/*.pt2``. The manifest binds every rank's weights to its rank: index and sha256.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ignition.catalog.model import GRAPHS_DIR, WEIGHTS_FILE
from ignition.catalog.parallel import EXCHANGES, RANK_METADATA, RANKS_DIR, RANKS_METADATA
from ignition.exporter.weights_file import save_aligned
from ignition.recipes.base import GraphBuild, RecipeBuild


def rank_metadata(rank: int, ranks: int) -> dict[str, str]:
    """The safetensors header metadata of rank ``rank``'s own weights file (ranks >= 1): which shard it is."""
    return {RANK_METADATA: str(rank), RANKS_METADATA: str(ranks)}


def rank_weights_file(rank: int) -> str:
    return WEIGHTS_FILE if rank == 0 else f"{RANKS_DIR}/{rank}/{WEIGHTS_FILE}"


def rank_graph_file(rank: int, variant_name: str) -> str:
    prefix = "" if rank == 0 else f"{RANKS_DIR}/{rank}/"
    return f"{prefix}{GRAPHS_DIR}/{variant_name}.pt2"


@contextmanager
def fake_process_group(rank: int, ranks: int):
    """The default process group as the fake backend at ``rank`` of ``ranks`` (tracing only; no transport)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("cannot export a sharded core from a process that already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def capture_ranks(build: RecipeBuild, staging: Path, capture: Callable, save_program: Callable,
                  progress: Callable[[str, str], None], timings: dict[str, float]) -> str:
    """Capture and save every rank's graphs, write ranks >= 1's weights; returns the traced group name."""
    sharded = build.parallel
    group_name = ""
    for rank in range(sharded.ranks):
        weights = sharded.rank_weights[rank]
        if rank > 0:
            (staging / RANKS_DIR / str(rank) / GRAPHS_DIR).mkdir(parents=True)
            save_aligned(weights, staging / rank_weights_file(rank), metadata=rank_metadata(rank, sharded.ranks))
        with fake_process_group(rank, sharded.ranks) as group_name:
            for graph, module in zip(build.graphs, sharded.rank_modules[rank], strict=True):
                started = time.perf_counter()
                progress("capture", f"rank {rank}: {graph.variant.name}")
                program = capture(GraphBuild(graph.variant, module), weights)
                save_program(program, staging, rank_graph_file(rank, graph.variant.name))
                timings[f"capture:r{rank}:{graph.variant.name}"] = time.perf_counter() - started
    return group_name


def tensor_parallel_manifest(build: RecipeBuild, group_name: str, files: dict[str, str]) -> dict:
    """The manifest's ``tensor_parallel`` section: ranks, files per rank (each bound to its rank by index and
    its weights' sha256 from ``files``, the manifest's hash map), shard geometry and exchanges."""
    sharded = build.parallel
    return {
        "ranks": sharded.ranks,
        "vocab_shard": sharded.vocab_shard,
        "group": group_name,
        "rank_files": [{"rank": rank, "weights": rank_weights_file(rank), "sha256": files[rank_weights_file(rank)],
                        "graphs": {g.variant.name: rank_graph_file(rank, g.variant.name) for g in build.graphs}}
                       for rank in range(sharded.ranks)],
        "shards": sharded.shards,
        "exchanges": [exchange.to_json() for exchange in EXCHANGES],
    }
