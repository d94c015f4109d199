"""Scratch between the launches of one logprob reduction, and how each launch binds its arguments.

One workspace class per reduction and one argument binder per reduction, shared by the JIT path
(``triton_logprobs.launch_reduction``, ``triton_vocabulary``) and the prepared launchers
(``ignition.runtime.launchers.reduction.PreparedReduction``, ``ignition.runtime.launchers.vocabulary``): the binder
returns every runtime argument by kernel parameter name, as tensors; the JIT passes them to Triton, the
prepared launcher their addresses to ``cuLaunchKernel``. Nothing here imports Triton.

- single-rank (``ReductionWorkspace``, ``reduction_arguments``): the four launches of one reduction;
- sharded (``VocabularyWorkspace``, ``stage_arguments``): stage 1 fills the workspace (tile statistics,
  sub-block maxima, tau) that stage 2 of the same reduction reads; a rank runs its stages in stream order
  with the all-gathers between them;
- sharded prompt scoring (``ScoringWorkspace``, ``scoring_arguments``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ignition.catalog.contract import POINTER_DIVISIBILITY, TILE_SORT_KEYS
from ignition.catalog.parallel import VOCABULARY_LAUNCHES


@dataclass(slots=True)
class Workspace:
    """What every workspace has: its tile count and the tensors after it, sized once per shape and reused."""

    tiles: int

    @staticmethod
    def fp32(*shape, device) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the workspace, in field order (the fields after ``tiles``)."""
        return tuple(getattr(self, f.name) for f in fields(self)[1:])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(slots=True)
class ReductionWorkspace(Workspace):
    """The single-rank reduction's scratch between its four launches."""

    stats: torch.Tensor  # [rows, tiles, 2] fp32: tile maximum, exp-sum relative to it
    maxima: torch.Tensor  # [rows, tiles, SUB] fp32 sub-block maxima
    lse: torch.Tensor  # [rows] fp32
    cutoff: torch.Tensor  # [rows] fp32
    keys: torch.Tensor  # [rows, tiles, TILE_SORT_KEYS] int64
    chosen: torch.Tensor  # [rows] int64: chosen ids widened when a graph passes int32 or a strided view

    @classmethod
    def allocate(cls, rows: int, tiles: int, sub: int, device) -> "ReductionWorkspace":
        return cls(tiles, cls.fp32(rows, tiles, 2, device=device), cls.fp32(rows, tiles, sub, device=device),
                   cls.fp32(rows, device=device), cls.fp32(rows, device=device),
                   torch.empty(rows, tiles, TILE_SORT_KEYS, dtype=torch.int64, device=device),
                   torch.empty(rows, dtype=torch.int64, device=device))


def widened_chosen(workspace, chosen: torch.Tensor) -> torch.Tensor:
    """``chosen`` as the kernels index it (int64, unit stride, 16-byte aligned): itself, or its copy in
    ``workspace.chosen`` (a graph may pass int32 ids, or a column or an offset view of its records)."""
    if chosen.dtype != torch.int64 or not chosen.is_contiguous() or chosen.data_ptr() % POINTER_DIVISIBILITY:
        workspace.chosen.copy_(chosen)
        return workspace.chosen
    return chosen


def reduction_arguments(workspace: ReductionWorkspace, logits, chosen, requested, out, out_rows, token_ids,
                        token_id_counts, vocab_size: int) -> dict:
    """Every runtime argument of the four single-rank launches, by parameter name.

    ValueError when a tensor the kernels index with unit stride is a strided view (``chosen`` is widened
    instead). Without selected ids, ``requested`` stands in for the id pointers, which are never read."""
    ids = token_ids if token_ids is not None else requested  # never read without HAS_IDS
    counts = token_id_counts if token_id_counts is not None else requested
    strided = [name for name, t in (("requested", requested), ("out_rows", out_rows), ("token_ids", ids),
                                    ("token_id_counts", counts)) if not t.is_contiguous()]
    if logits.stride(-1) != 1 or strided:
        raise ValueError(f"reduce_logprobs: the launches index logits rows (vocabulary stride {logits.stride(-1)}, "
                         f"must be 1) and {', '.join(strided) or 'every id and flag tensor'} with unit stride")
    return {"logits_ptr": logits, "chosen_ptr": widened_chosen(workspace, chosen), "requested_ptr": requested,
            "token_ids_ptr": ids, "counts_ptr": counts, "stats_ptr": workspace.stats, "lse_ptr": workspace.lse,
            "maxima_ptr": workspace.maxima, "cutoff_ptr": workspace.cutoff, "keys_ptr": workspace.keys,
            "out_ptr": out, "out_rows_ptr": out_rows, "logits_row_stride": logits.stride(0),
            "vocab_size": vocab_size, "num_tiles": workspace.tiles}


@dataclass(slots=True)
class ShardNormalization(Workspace):
    """The scratch both sharded reductions share: tile statistics, sub-block maxima, tau, lse and cutoff."""

    stats: torch.Tensor  # [rows, tiles, 2] fp32
    maxima: torch.Tensor  # [rows, tiles, SUB] fp32
    tau: torch.Tensor  # [rows] fp32
    lse: torch.Tensor  # [rows] fp32
    cutoff: torch.Tensor  # [rows] fp32

    @classmethod
    def normalization(cls, rows: int, tiles: int, sub: int, device) -> tuple:
        """The shared fields' values, in field order (a subclass's ``allocate`` appends its own)."""
        return (tiles, cls.fp32(rows, tiles, 2, device=device), cls.fp32(rows, tiles, sub, device=device),
                *(cls.fp32(rows, device=device) for _ in range(3)))

    def pointers(self) -> dict[str, torch.Tensor]:
        return {"stats_ptr": self.stats, "maxima_ptr": self.maxima, "tau_ptr": self.tau, "lse_ptr": self.lse,
                "cutoff_ptr": self.cutoff}


@dataclass(slots=True)
class VocabularyWorkspace(ShardNormalization):
    """One rank's scratch between its stage ops, sized by the plan; reused by every call of the shape."""

    keys: torch.Tensor  # [rows, tiles, TILE_SORT_KEYS] int64
    chosen: torch.Tensor  # [rows] int64: chosen ids widened

    @classmethod
    def allocate(cls, rows: int, tiles: int, sub: int, device) -> "VocabularyWorkspace":
        return cls(*cls.normalization(rows, tiles, sub, device),
                   torch.empty(rows, tiles, TILE_SORT_KEYS, dtype=torch.int64, device=device),
                   torch.empty(rows, dtype=torch.int64, device=device))

    def pointers(self) -> dict[str, torch.Tensor]:
        return ShardNormalization.pointers(self) | {"keys_ptr": self.keys}


def stage_launches(plan: list, stage: str, table=VOCABULARY_LAUNCHES) -> list:
    """The launches of ``plan`` (specs or prepared launches, in the order of ``table``: VOCABULARY_LAUNCHES, or
    SCORING_LAUNCHES for a scoring plan) that one stage op issues."""
    return [entry for entry, launch in zip(plan, table, strict=True) if launch.stage == stage]


def _shard_arguments(stage: str, rows: int, tiles: int, logits, vocab_start: int, vocab_size: int, vocab_shard: int,
                     outputs: dict) -> dict:
    """The arguments both sharded reductions bind alike: the shard's position and lanes, the logits, and the
    exchange and output tensors by parameter name (FP32 words as their int32 bits)."""
    lanes = max(0, min(vocab_shard, vocab_size - vocab_start))
    args = {"num_tiles": tiles, "rows": rows, "vocab_start": vocab_start, "shard_lanes": lanes,
            "vocab_shard": vocab_shard, "vocab_size": vocab_size if stage == "merge" else lanes}
    if logits is not None:
        args |= {"logits_ptr": logits, "logits_row_stride": logits.stride(0)}
    for name, tensor in outputs.items():
        if tensor is not None:
            args[f"{name}_ptr"] = tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor
    return args


def stage_arguments(stage: str, workspace: VocabularyWorkspace, *, logits=None, chosen=None, requested, token_ids=None,
                    token_id_counts=None, exchange=None, statistics=None, candidates=None, out=None, out_rows=None,
                    vocab_start: int = 0, vocab_size: int, vocab_shard: int) -> dict:
    """Every runtime argument a stage's launches may take, by parameter name (the launcher binds the same).

    Stages 1 and 2 see the shard: their ``vocab_size`` parameter (of the reused single-rank kernels)
    is the shard's lane count below the vocabulary; the merge sees the global ``vocab_size``."""
    args = workspace.pointers() | {"requested_ptr": requested} | _shard_arguments(
        stage, requested.shape[0], workspace.tiles, logits, vocab_start, vocab_size, vocab_shard,
        {"exchange": exchange, "statistics": statistics, "candidates": candidates, "out": out, "out_rows": out_rows})
    if chosen is not None:
        args["chosen_ptr"] = widened_chosen(workspace, chosen)
    args["token_ids_ptr"] = token_ids if token_ids is not None else requested  # never read without HAS_IDS
    args["counts_ptr"] = token_id_counts if token_id_counts is not None else requested
    return args


@dataclass(slots=True)
class ScoringWorkspace(ShardNormalization):
    """One rank's scratch between the three sharded prompt-scoring stage ops of one row block."""

    value: torch.Tensor  # [rows] fp32: the target's reported value
    keys: torch.Tensor  # [rows, tiles, TILE_SORT_KEYS] int64
    greater: torch.Tensor  # [rows, tiles] int32
    valid: torch.Tensor  # [rows] int32: written by the statistics launch
    every_row: torch.Tensor  # [rows] int32 ones: tile_stats runs before validity is known

    @classmethod
    def allocate(cls, rows: int, tiles: int, sub: int, device) -> "ScoringWorkspace":
        return cls(*cls.normalization(rows, tiles, sub, device), cls.fp32(rows, device=device),
                   torch.empty(rows, tiles, TILE_SORT_KEYS, dtype=torch.int64, device=device),
                   torch.empty(rows, tiles, dtype=torch.int32, device=device),
                   torch.empty(rows, dtype=torch.int32, device=device),
                   torch.ones(rows, dtype=torch.int32, device=device))


def scoring_arguments(stage: str, workspace: ScoringWorkspace, *, logits=None, targets, exchange=None,
                      statistics=None, candidates=None, out=None, out_rows=None, vocab_start: int = 0,
                      vocab_size: int, vocab_shard: int) -> dict:
    """Every runtime argument of a scoring stage's launches, by parameter name. The reused single-rank
    kernels (tile_stats, tile_candidates) take ``requested_ptr`` and a ``vocab_size`` of the shard's lanes:
    tile_stats every row (validity is not known yet), tile_candidates the rows launch 2 found valid."""
    return workspace.pointers() | {
        "value_ptr": workspace.value, "keys_ptr": workspace.keys, "greater_ptr": workspace.greater,
        "valid_ptr": workspace.valid,
        "requested_ptr": workspace.every_row if stage == "statistics" else workspace.valid,
        "counts_ptr": workspace.valid,  # never read: scoring has no selected ids (HAS_IDS False)
        "targets_ptr": targets, "global_vocab_size": vocab_size} | _shard_arguments(
        stage, targets.shape[0], workspace.tiles, logits, vocab_start, vocab_size, vocab_shard,
        {"exchange": exchange, "statistics": statistics, "candidates": candidates, "out": out, "out_rows": out_rows})
