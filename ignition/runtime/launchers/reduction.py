"""A core's prepared-kernel launcher: its cubins, launched through the CUDA driver, bound to the core.

At load, ``load_launcher`` picks the kernel target of the device's compute capability (a core without one is
refused), loads each cubin once with ``cuModuleLoadData`` and sizes one workspace per shape the core's graphs
reduce: a ``PreparedReduction`` for a single-rank core, a ``PreparedVocabulary`` (vocabulary_launcher.py) for a
rank of a sharded one. The core's variants run through ``launcher.bound(run)``, so the CUDA implementation of
``ignition::reduce_logprobs`` reaches this core's launcher, which looks the shape up and issues the variant's
launches, in kernel-table order, on torch's current stream with ``cuLaunchKernel`` (runtime/launchers/launches.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import reduction_logits_dtype, reduction_rows
from ignition.components.workspaces import ReductionWorkspace, reduction_arguments
from ignition.runtime.cuda_driver import LauncherError, device_capability, pack_params  # noqa: F401 (re-exported)
from ignition.runtime.launchers.launches import (KernelTable, PreparedKernels, PreparedLaunch, claim_launches,
                                                 logprob_variants, select_target, target_name)
from ignition.runtime.launchers.vocabulary import PreparedVocabulary, scoring_shapes, vocabulary_shapes

__all__ = ["LauncherError", "PreparedLaunch", "PreparedReduction", "ReductionShape", "load_launcher", "pack_params",
           "reduction_shapes", "select_target", "target_name"]


@dataclass(frozen=True, slots=True)
class ReductionShape:
    """Everything that selects a reduction's prepared launches."""

    rows: int
    vocab_padded: int
    vocab_size: int
    k: int
    explicit_ids: bool
    logits_dtype: str  # torch dtype name


def reduction_shapes(spec: Manifest, catalog: dict) -> dict[ReductionShape, list[str]]:
    """Each shape the core's graphs reduce, with its launch keys in launch order."""
    shapes: dict[ReductionShape, list[str]] = {}
    dtype = reduction_logits_dtype(spec.model.dtype, sharded=False)
    for entry, layout in logprob_variants(catalog):
        rows = reduction_rows(entry["operation"], entry["capacity"], entry["contract"]["layout"])
        shape = ReductionShape(rows, spec.vocab_padded, spec.vocab_size, layout["k"],
                               bool(layout["explicit_ids"]), dtype)
        launches = list(entry.get("launches") or [])
        if not launches:
            raise LauncherError(f"variant {entry['name']} reduces logprobs but lists no prepared launches; "
                                f"re-export the core with --targets")
        claim_launches(shapes, shape, launches, f"variant {entry['name']}: launches {launches} differ from another "
                                                f"variant of the same reduction shape")
    return shapes


def load_launcher(root: Path, spec: Manifest, catalog: dict, table: dict | None, device: torch.device,
                  driver=None) -> "PreparedReduction | PreparedVocabulary | None":
    """The launcher of a core on ``device``: None when no graph of the core reduces logprobs, a
    ``PreparedVocabulary`` for a rank of a sharded core, else a ``PreparedReduction``.

    ``driver`` defaults to ``cuda.bindings.driver`` (tests pass an emulation of it)."""
    if not any(entry["contract"]["layout"].get("logprobs") for entry in catalog["variants"]):
        return None
    target = select_target(device_capability(device), list(table["targets"]) if table else [], str(device))
    if spec.sharded:  # a rank of a sharded core: six sharded launches, seven per scoring block
        return PreparedVocabulary.load(root, spec, table, vocabulary_shapes(spec, catalog), device, target,
                                       driver, scoring_shapes(spec, catalog))
    return PreparedReduction.from_table(root, table, reduction_shapes(spec, catalog), device, target, driver)


class PreparedReduction(PreparedKernels):
    """The CUDA implementation of ``ignition::reduce_logprobs`` for one core on one device."""

    def __init__(self, device: torch.device, table: KernelTable, launches: dict[ReductionShape, list[PreparedLaunch]],
                 workspaces: dict[ReductionShape, ReductionWorkspace]):
        super().__init__(device, table)
        self.launches = launches
        self.workspaces = workspaces

    @classmethod
    def from_table(cls, root: Path, table: dict, shapes: dict[ReductionShape, list[str]], device: torch.device,
                   target: str, driver=None) -> "PreparedReduction":
        """Load the binaries of ``target`` that ``shapes`` launch (a kernel table and the files it names under
        ``root``) and size each shape's workspace."""
        kernels = KernelTable(root, table, target, device, driver)
        launches, workspaces = {}, {}
        for shape, keys in shapes.items():
            launches[shape] = kernels.launches(keys)
            first = kernels.entry(keys[0])  # launch 1 runs over (rows, tiles) with SUB sub-blocks per tile
            sub = first["constexprs"].get("SUB", 1)  # tables prepared before the cutoff have no sub-blocks
            workspaces[shape] = ReductionWorkspace.allocate(shape.rows, first["grid"][1], sub, device)
        return cls(device, kernels, launches, workspaces)

    @property
    def workspace_bytes(self) -> int:
        return sum(w.nbytes for w in self.workspaces.values())

    def __call__(self, logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
        shape = ReductionShape(logits.shape[0], logits.shape[1], vocab_size, k, token_ids is not None,
                               str(logits.dtype).removeprefix("torch."))
        launches = self.launches.get(shape)
        if launches is None:
            raise LauncherError(f"no prepared launches for reduction {shape}; the core prepared "
                                f"{sorted(map(str, self.launches))}")
        try:
            args = reduction_arguments(self.workspaces[shape], logits, chosen, requested, out, out_rows, token_ids,
                                       token_id_counts, vocab_size)
        except ValueError as exc:
            raise LauncherError(str(exc)) from None
        self.launch(launches, args)
