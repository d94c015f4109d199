"""What every prepared launcher shares: a core's kernel table loaded into the device's primary context, launches on
torch's current stream, and the per-core binding through which the core's graphs reach their own launcher.

A launcher belongs to one loaded core. ``PreparedKernels.bound(run)`` wraps a variant's ``run`` so that, while it
runs, the CUDA implementations of the reduction ops (``ignition.components.device_reduction``) find this launcher:
a second core on the same device (a draft core, a core without logprobs) binds its own, or none, and never displaces
it. A captured CUDA graph recorded its launches when it was captured, so its replays need no binding.

Launch parameters are the kernel's non-constexpr arguments in signature order (the argument binders of
``ignition.components.workspaces`` give them by name, tensors passed as their addresses), then
``SCRATCH_POINTERS`` null pointers (Triton's global and profile scratch). Nothing here imports Triton or compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ignition.components.device_reduction import bind_launcher
from ignition.runtime.cuda_driver import LauncherError, PrimaryContext, launch, load_driver, load_function, pack_params
from ignition.validate.files import read_core_file

KERNEL_MAX_BYTES = 64 * 2**20
"""The largest prepared kernel binary a launcher reads (a cubin of the reduction's launches is tens of KiB)."""


@dataclass(frozen=True, slots=True)
class PreparedLaunch:
    key: str
    function: object  # CUfunction
    signature: list[dict]  # the kernel table's: name, type, and divisibility for aligned pointers
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int


def logprob_variants(catalog: dict):
    """Each catalog variant that reduces logprobs, with its ``logprobs`` layout."""
    for entry in catalog["variants"]:
        layout = entry["contract"]["layout"].get("logprobs")
        if layout is not None:
            yield entry, layout


def claim_launches(shapes: dict, shape, launches: list[str], conflict: str) -> None:
    """Records ``launches`` for ``shape``; LauncherError ``conflict`` (and the others) when it already has others."""
    if shapes.setdefault(shape, launches) != launches:
        raise LauncherError(f"{conflict} ({shapes[shape]})")


def target_name(capability: tuple[int, int]) -> str:
    major, minor = capability
    return f"cuda:{major * 10 + minor}"


def select_target(capability: tuple[int, int], targets: list[str], device: str = "the device") -> str:
    """The kernel target for a compute capability, or LauncherError naming both sides."""
    name = target_name(capability)
    if name not in targets:
        prepared = ", ".join(targets) if targets else "no target (exported without --targets)"
        raise LauncherError(f"{device} has compute capability {capability[0]}.{capability[1]} (kernel target {name}), "
                            f"but the core's kernels were prepared for {prepared}; re-export it with "
                            f"--targets {name}")
    return name


class KernelTable:
    """A core's kernel table for one target on one device: each cubin loaded once, into the device's primary
    context (made current on this thread while loading)."""

    def __init__(self, root: Path, table: dict, target: str, device: torch.device, driver=None):
        self.root, self.target = Path(root), target
        self.driver = driver or load_driver()
        self.context = PrimaryContext(device, self.driver)
        self.entries = {(e["key"], e["target"]): e for e in table["kernels"]}
        self.functions: dict[str, object] = {}  # cubin file -> CUfunction
        self.modules: list = []  # CUmodules stay loaded while the core is

    def entry(self, key: str) -> dict:
        entry = self.entries.get((key, self.target))
        if entry is None:
            raise LauncherError(f"kernels.json has no {self.target} binary for launch {key}")
        return entry

    def launches(self, keys: list[str]) -> list[PreparedLaunch]:
        """The prepared launches of ``keys``, in order."""
        previous = self.context.make_current()
        try:
            return [self._launch(key) for key in keys]
        finally:
            self.context.restore(previous)

    def _launch(self, key: str) -> PreparedLaunch:
        entry = self.entry(key)
        if entry["file"] not in self.functions:
            binary, problems = read_core_file(self.root, entry["file"], "kernels.json", KERNEL_MAX_BYTES)
            if binary is None:
                raise LauncherError(f"kernels.json launch {key}: {'; '.join(str(p) for p in problems)}")
            module, function = load_function(self.driver, binary, entry["kernel_name"], entry["shared_bytes"])
            self.modules.append(module)
            self.functions[entry["file"]] = function
        grid = tuple(entry["grid"]) + (1,) * (3 - len(entry["grid"]))
        return PreparedLaunch(key, self.functions[entry["file"]], entry["signature"], grid, entry["num_warps"] * 32,
                              entry["shared_bytes"])


class BoundRun:
    """A variant's ``run(buffers)`` with its core's launcher bound while it runs (``PreparedKernels.bound``)."""

    def __init__(self, run, launcher: "PreparedKernels"):
        self.run, self.launcher = run, launcher

    def __call__(self, buffers):
        with bind_launcher(self.launcher.device, self.launcher):
            return self.run(buffers)


class PreparedKernels:
    """The base of one core's launcher on one device: its loaded kernel table, the launch loop and the count."""

    def __init__(self, device: torch.device, table: KernelTable):
        self.device, self.table = device, table
        self.target, self.driver, self.context = table.target, table.driver, table.context
        self.launch_count = 0

    def bound(self, run) -> BoundRun:
        """``run`` with this launcher bound while it runs: what a loaded variant of this core calls."""
        return BoundRun(run, self)

    def launch(self, launches: list[PreparedLaunch], args: dict) -> None:
        """Issue ``launches`` in order on torch's current stream, parameters bound by name from ``args`` (tensors as
        their addresses). Every launch's parameters are packed, and checked, before the first is issued."""
        values = {name: value.data_ptr() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
        packed = [pack_params(x.signature, values, f"launch {x.key}") for x in launches]
        stream = self.current_stream()
        previous = self.context.make_current()  # the calling thread may have no context current (the engine's)
        try:
            for x, (params, _holders) in zip(launches, packed):
                launch(self.driver, x.function, x.grid, x.threads, x.shared_bytes, stream, params)
        finally:
            self.context.restore(previous)
        self.launch_count += len(launches)

    def current_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream
