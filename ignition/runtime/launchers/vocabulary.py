"""The prepared launcher of a sharded core: six cubins per rank for the vocabulary-sharded reduction, and seven
per row-block size for sharded prompt scoring (``PreparedScoring``).

``launcher.load_launcher`` hands a core with a ``tensor_parallel`` section to
``PreparedVocabulary.load``. Every rank loads the same binaries (the launch plan does not depend on
the rank; a shard's position is a runtime argument) and one workspace per (rows, vocab_shard). The
CUDA stage ops (``ignition.components.device_reduction``) call ``statistics``, ``candidates`` and
``merge``; each issues its launches (``catalog.parallel.VOCABULARY_LAUNCHES``) on torch's current
stream with ``cuLaunchKernel``, parameters packed as for the single-rank launcher. The two exchange
outputs are fresh tensors from torch's caching allocator (the graph pool under capture); nothing
here imports Triton or compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import reduction_logits_dtype, reduction_rows
from ignition.catalog.parallel import (EXCHANGE_WORDS, SCORING_EXCHANGE_WORDS, SCORING_LAUNCHES, VOCABULARY_LAUNCHES,
                                       variant_scoring_blocks)
from ignition.components.workspaces import (ScoringWorkspace, VocabularyWorkspace, scoring_arguments, stage_arguments,
                                             stage_launches)
from ignition.runtime.cuda_driver import LauncherError
from ignition.runtime.launchers.launches import (KernelTable, PreparedKernels, PreparedLaunch, claim_launches,
                                                logprob_variants)


@dataclass(frozen=True, slots=True)
class VocabularyShape:
    """Everything that selects one rank's prepared launches of a sharded reduction."""

    rows: int
    vocab_shard: int
    ranks: int
    k: int
    explicit_ids: bool
    logits_dtype: str  # torch dtype name


@dataclass(frozen=True, slots=True)
class ScoringShape:
    """Everything that selects one rank's prepared launches of one sharded prompt-scoring row block."""

    rows: int  # the block's rows (at most SCORING_ROW_BLOCK)
    vocab_shard: int
    ranks: int
    logits_dtype: str


def _variant_launches(entry: dict, ranks: int) -> list[str]:
    """A sharded logprob variant's launch keys: six for generation, then seven per scoring row-block size."""
    launches = list(entry.get("launches") or [])
    wanted = len(VOCABULARY_LAUNCHES) + len(SCORING_LAUNCHES) * len(variant_scoring_blocks(entry))
    if len(launches) != wanted:
        raise LauncherError(f"variant {entry['name']} reduces logprobs over {ranks} ranks but lists "
                            f"{len(launches)} prepared launches, not {wanted}; re-export the core with --targets")
    return launches


def scoring_shapes(spec: Manifest, catalog: dict) -> dict[ScoringShape, list[str]]:
    """Each row block the sharded core's scored graphs score, with its seven launch keys in launch order."""
    section, dtype = spec.parallel, reduction_logits_dtype(spec.model.dtype, sharded=True)
    shapes: dict[ScoringShape, list[str]] = {}
    for entry, _ in logprob_variants(catalog):
        launches = _variant_launches(entry, section.ranks)[len(VOCABULARY_LAUNCHES):]
        for index, rows in enumerate(variant_scoring_blocks(entry)):
            shape = ScoringShape(rows, section.vocab_shard, section.ranks, dtype)
            own = launches[index * len(SCORING_LAUNCHES):(index + 1) * len(SCORING_LAUNCHES)]
            claim_launches(shapes, shape, own, f"variant {entry['name']}: scoring launches {own} differ from another "
                                               f"variant's for the same row block")
    return shapes


def vocabulary_shapes(spec: Manifest, catalog: dict) -> dict[VocabularyShape, list[str]]:
    """Each shape the sharded core's graphs reduce, with its six launch keys in launch order."""
    section, dtype = spec.parallel, reduction_logits_dtype(spec.model.dtype, sharded=True)
    shapes: dict[VocabularyShape, list[str]] = {}
    for entry, layout in logprob_variants(catalog):
        rows = reduction_rows(entry["operation"], entry["capacity"], entry["contract"]["layout"])
        shape = VocabularyShape(rows, section.vocab_shard, section.ranks, layout["k"], bool(layout["explicit_ids"]),
                                dtype)
        launches = _variant_launches(entry, section.ranks)[:len(VOCABULARY_LAUNCHES)]
        claim_launches(shapes, shape, launches, f"variant {entry['name']}: launches {launches} differ from another "
                                                f"variant of the same reduction shape")
    return shapes


def _load_shapes(shapes: dict, workspace_class: type, kernels: KernelTable, device: torch.device) -> tuple[dict, dict]:
    """Each shape's loaded launches, and one ``workspace_class`` per (rows, vocab_shard) sized by its first launch
    (``tile_stats`` or ``score.tile_stats``: (rows, tiles) with SUB sub-blocks per tile)."""
    launches, workspaces = {}, {}
    for shape, keys in shapes.items():
        launches[shape] = kernels.launches(keys)
        first = kernels.entry(keys[0])
        if (shape.rows, shape.vocab_shard) not in workspaces:
            workspaces[(shape.rows, shape.vocab_shard)] = workspace_class.allocate(
                shape.rows, first["grid"][1], first["constexprs"]["SUB"], device)
    return launches, workspaces


def _index_stages(shapes: dict, stage_keys, table, label: str) -> dict[tuple, list[PreparedLaunch]]:
    """(stage, *key) -> the stage's launches, for every shape; ``stage_keys(shape)`` gives each stage's key (the
    inputs its launches depend on). LauncherError when two shapes with one key would launch different binaries."""
    stages: dict[tuple, list[PreparedLaunch]] = {}
    for shape, launches in shapes.items():
        for stage, key in stage_keys(shape):
            own = stage_launches(launches, stage, table)
            if stages.setdefault((stage, *key), own) != own:  # a plan's stage depends only on its key
                raise LauncherError(f"{label}{stage} of {shape} launches {[x.key for x in own]}, another shape "
                                    f"with the same {stage} inputs launches {[x.key for x in stages[(stage, *key)]]}")
    return stages


def _stage_of(stages: dict, stage: str, key: tuple, label: str, none: str) -> list[PreparedLaunch]:
    """The launches of ``stage`` for ``key``; LauncherError naming the keys the core prepared (``none``: none)."""
    launches = stages.get((stage, *key))
    if launches is None:
        prepared = sorted(str(k[1:]) for k in stages if k[0] == stage)
        raise LauncherError(f"no prepared {label}{stage} launches for {key}; the core prepared {prepared or none}")
    return launches


class PreparedVocabulary(PreparedKernels):
    """The CUDA implementation of the three sharded stage ops for one core on one device (one rank)."""

    def __init__(self, device: torch.device, table: KernelTable, shapes: dict[VocabularyShape, list[PreparedLaunch]],
                 workspaces: dict[tuple[int, int], VocabularyWorkspace],
                 scoring: "dict[ScoringShape, list[PreparedLaunch]] | None" = None,
                 scoring_workspaces: dict[tuple[int, int], ScoringWorkspace] | None = None):
        super().__init__(device, table)
        self.scoring = PreparedScoring(self, scoring or {}, scoring_workspaces or {})
        self.shapes = shapes
        self.workspaces = workspaces
        self._stages = _index_stages(shapes, lambda shape: (
            ("statistics", (shape.rows, shape.vocab_shard, shape.logits_dtype)),
            ("candidates", (shape.rows, shape.vocab_shard, shape.ranks, shape.explicit_ids, shape.logits_dtype)),
            ("merge", (shape.rows, shape.vocab_shard, shape.ranks, shape.k, shape.explicit_ids))),
            VOCABULARY_LAUNCHES, "stage ")

    @classmethod
    def load(cls, root: Path, spec: Manifest, table: dict, shapes: dict[VocabularyShape, list[str]],
             device: torch.device, target: str, driver=None,
             scoring: dict[ScoringShape, list[str]] | None = None) -> "PreparedVocabulary":
        kernels = KernelTable(root, table, target, device, driver)
        launches, workspaces = _load_shapes(shapes, VocabularyWorkspace, kernels, device)
        scoring_launches, scoring_workspaces = _load_shapes(scoring or {}, ScoringWorkspace, kernels, device)
        return cls(device, kernels, launches, workspaces, scoring_launches, scoring_workspaces)

    @property
    def workspace_bytes(self) -> int:
        return sum(w.nbytes for w in list(self.workspaces.values()) + list(self.scoring.workspaces.values()))

    def _stage(self, stage: str, key: tuple) -> list[PreparedLaunch]:
        return _stage_of(self._stages, stage, key, "", "[]")

    def _workspace(self, rows: int, vocab_shard: int) -> VocabularyWorkspace:
        return self.workspaces[(rows, vocab_shard)]

    @staticmethod
    def new_exchange(rows: int, device: torch.device) -> torch.Tensor:
        """One rank's exchange words ``[rows, EXCHANGE_WORDS]`` FP32 (the op's fresh output)."""
        return torch.empty(rows, EXCHANGE_WORDS, dtype=torch.float32, device=device)

    @staticmethod
    def _dtype(logits: torch.Tensor) -> str:
        if logits.stride(-1) != 1:
            raise LauncherError(f"logits must have unit vocabulary stride, got strides {logits.stride()}")
        return str(logits.dtype).removeprefix("torch.")

    def statistics(self, logits, requested, vocab_start, vocab_size):
        rows, shard = logits.shape
        launches = self._stage("statistics", (rows, shard, self._dtype(logits)))
        exchange = self.new_exchange(rows, logits.device)
        self.launch(launches, stage_arguments("statistics", self._workspace(rows, shard), logits=logits,
                                              requested=requested, exchange=exchange, vocab_start=vocab_start,
                                              vocab_size=vocab_size, vocab_shard=shard))
        return exchange

    def candidates(self, logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size):
        rows, shard = logits.shape
        key = (rows, shard, statistics.shape[0] // rows, token_ids is not None, self._dtype(logits))
        launches = self._stage("candidates", key)
        exchange = self.new_exchange(rows, logits.device)
        self.launch(launches, stage_arguments("candidates", self._workspace(rows, shard), logits=logits,
                                              chosen=chosen, requested=requested, token_ids=token_ids,
                                              token_id_counts=token_id_counts, exchange=exchange,
                                              statistics=statistics, vocab_start=vocab_start,
                                              vocab_size=vocab_size, vocab_shard=shard))
        return exchange

    def merge(self, statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size,
              vocab_shard, k):
        rows = chosen.shape[0]
        launches = self._stage("merge", (rows, vocab_shard, statistics.shape[0] // rows, k, token_ids is not None))
        self.launch(launches, stage_arguments("merge", self._workspace(rows, vocab_shard), chosen=chosen,
                                              requested=requested, token_ids=token_ids,
                                              token_id_counts=token_id_counts, statistics=statistics,
                                              candidates=candidates, out=out, out_rows=out_rows,
                                              vocab_size=vocab_size, vocab_shard=vocab_shard))


class PreparedScoring:
    """The CUDA implementation of the three sharded prompt-scoring stage ops (``PreparedVocabulary.scoring``):
    seven launches per row block (``catalog.parallel.SCORING_LAUNCHES``), issued through the parent's driver."""

    def __init__(self, parent: PreparedVocabulary, shapes: dict[ScoringShape, list[PreparedLaunch]],
                 workspaces: dict[tuple[int, int], ScoringWorkspace]):
        self.parent, self.shapes, self.workspaces = parent, shapes, workspaces
        self._stages = _index_stages(shapes, lambda shape: (
            ("statistics", (shape.rows, shape.vocab_shard, shape.logits_dtype)),
            ("candidates", (shape.rows, shape.vocab_shard, shape.ranks, shape.logits_dtype)),
            ("merge", (shape.rows, shape.vocab_shard, shape.ranks))), SCORING_LAUNCHES, "scoring stage ")

    def _stage(self, stage: str, key: tuple) -> list[PreparedLaunch]:
        return _stage_of(self._stages, stage, key, "scoring ", "none (export it with --prompt-logprobs)")

    def _workspace(self, rows: int, vocab_shard: int) -> ScoringWorkspace:
        return self.workspaces[(rows, vocab_shard)]

    @staticmethod
    def new_exchange(rows: int, device: torch.device) -> torch.Tensor:
        """One rank's scoring exchange words ``[rows, SCORING_EXCHANGE_WORDS]`` int32 (the op's fresh output)."""
        return torch.empty(rows, SCORING_EXCHANGE_WORDS, dtype=torch.int32, device=device)

    def statistics(self, logits, targets, vocab_start, vocab_size):
        rows, shard = logits.shape
        launches = self._stage("statistics", (rows, shard, self.parent._dtype(logits)))
        exchange = self.new_exchange(rows, logits.device)
        self.parent.launch(launches, scoring_arguments("statistics", self._workspace(rows, shard), logits=logits,
                                                       targets=targets, exchange=exchange, vocab_start=vocab_start,
                                                       vocab_size=vocab_size, vocab_shard=shard))
        return exchange

    def candidates(self, logits, statistics, targets, vocab_start, vocab_size):
        rows, shard = logits.shape
        launches = self._stage("candidates", (rows, shard, statistics.shape[0] // rows, self.parent._dtype(logits)))
        exchange = self.new_exchange(rows, logits.device)
        self.parent.launch(launches, scoring_arguments("candidates", self._workspace(rows, shard), logits=logits,
                                                       targets=targets, exchange=exchange, statistics=statistics,
                                                       vocab_start=vocab_start, vocab_size=vocab_size,
                                                       vocab_shard=shard))
        return exchange

    def merge(self, statistics, candidates, targets, out, out_rows, vocab_size, vocab_shard):
        rows = targets.shape[0]
        launches = self._stage("merge", (rows, vocab_shard, statistics.shape[0] // rows))
        self.parent.launch(launches, scoring_arguments("merge", self._workspace(rows, vocab_shard), targets=targets,
                                                       statistics=statistics, candidates=candidates, out=out,
                                                       out_rows=out_rows, vocab_size=vocab_size,
                                                       vocab_shard=vocab_shard))
