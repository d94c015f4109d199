"""Kernel preparation for a recipe build: every launch a variant replays, for every target.

Runs before any graph is captured. The launch plan of a variant follows from its declared
contract: one reduction row per lane (decode: capacity lanes; prefill family: one lane; verify: S+1 per lane),
the core's padded vocabulary, K, explicit IDs, and the dtype of the logits the reduction reads
(``catalog.model.reduction_logits_dtype``: float32 on a single rank, the model dtype on a sharded one). After
capture, ``check_captured_launches`` confirms the graph's reduction node really has that shape, so a prepared
core never misses a launch configuration.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ignition.catalog.model import reduction_logits_dtype, reduction_rows
from ignition.exporter.kernels import launch_key, parse_targets, prepare_kernels
from ignition.recipes.base import GraphBuild, RecipeBuild


def _lanes(graph: GraphBuild) -> int:
    return reduction_rows(graph.variant.operation, graph.variant.capacity, graph.variant.layout)


def scored_rows(variant) -> int:
    """Prompt rows C a scored variant scores: the extent of its targets argument (0: the variant scores nothing)."""
    scoring = variant.layout.get("prompt_logprobs")
    if not scoring:
        return 0
    return next(a.shape[0] for a in variant.arguments if a.name == scoring["targets"])


def _reduced_dtype(build: RecipeBuild) -> torch.dtype:
    return getattr(torch, reduction_logits_dtype(build.model["dtype"], sharded=build.parallel is not None))


def variant_plan(build: RecipeBuild, graph: GraphBuild):
    """The variant's launches: four single-rank ones, or for a sharded build the six every rank runs (one plan for
    all ranks: a shard's position is a runtime argument, so identical shapes share one binary), then for a scored
    sharded variant the seven scoring launches of each distinct row-block size (``scoring_row_blocks``)."""
    layout = graph.variant.layout.get("logprobs")
    if layout is None:
        return []
    dtype = _reduced_dtype(build)
    if build.parallel is not None:
        from ignition.catalog.parallel import scoring_row_blocks
        from ignition.components.triton_scoring import scoring_launch_plan
        from ignition.components.triton_vocabulary import vocabulary_launch_plan
        plan = vocabulary_launch_plan(_lanes(graph), build.parallel.vocab_shard, build.parallel.ranks, layout["k"],
                                      layout["explicit_ids"], dtype)
        scoring = graph.variant.layout.get("prompt_logprobs")
        for rows in scoring_row_blocks(scored_rows(graph.variant), scoring["row_block"]) if scoring else []:
            plan += scoring_launch_plan(rows, build.parallel.vocab_shard, build.parallel.ranks, dtype)
        return plan
    from ignition.components.triton_logprobs import launch_plan
    return launch_plan(_lanes(graph), build.vocab_padded, build.vocab_size, layout["k"], layout["explicit_ids"], dtype)


def prepare_build_kernels(build: RecipeBuild, targets, staging: Path) -> dict:
    """Compile the launches of every variant, record their keys on the variants, return the kernel table."""
    targets = parse_targets(",".join(targets))
    specs = []
    for graph in build.graphs:
        plan = variant_plan(build, graph)
        graph.variant.launches = [launch_key(spec) for spec in plan]
        specs += plan
    return prepare_kernels(specs, targets, staging)


def check_captured_launches(build: RecipeBuild, graph: GraphBuild, program) -> str | None:
    """None when the captured reduction node matches the prepared plan, else what differs (for a sharded
    build: the ``vocab_shard_statistics`` node, whose logits are the rank's ``[rows, vocab_shard]``)."""
    if not graph.variant.launches:
        return None
    op = "reduce_logprobs" if build.parallel is None else "vocab_shard_statistics"
    nodes = [n for n in program.graph.nodes if n.op == "call_function" and str(n.target) == f"ignition.{op}.default"]
    wanted = 2 if graph.variant.layout.get("mixed") else 1  # a mixed graph reduces once per role
    if len(nodes) != wanted:
        return f"expected {wanted} ignition::{op} node(s), found {len(nodes)}"
    width = build.vocab_padded if build.parallel is None else build.parallel.vocab_shard
    expected = (_lanes(graph), width, _reduced_dtype(build))
    for node in nodes:
        logits = node.args[0].meta["val"]
        found = (logits.shape[0], logits.shape[1], logits.dtype)
        if found != expected:
            return f"prepared launches for logits {expected}, the graph reduces {found}"
    scoring = graph.variant.layout.get("prompt_logprobs")
    if build.parallel is None or not scoring:
        return None
    rows, block = scored_rows(graph.variant), scoring["row_block"]
    wanted = [(min(block, rows - start), width, expected[2]) for start in range(0, rows, block)]
    found = [(n.args[0].meta["val"].shape[0], n.args[0].meta["val"].shape[1], n.args[0].meta["val"].dtype)
             for n in program.graph.nodes
             if n.op == "call_function" and str(n.target) == "ignition.score_shard_statistics.default"]
    if found != wanted:
        return f"prepared scoring launches for row blocks {wanted}, the graph scores {found}"
    return None
