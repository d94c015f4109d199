"""The prepared-kernel launcher: a core's cubins, launched through the CUDA driver.

At load, ``PreparedReduction.load`` picks the kernel target of the device's compute
capability (a core without one is refused), loads each cubin with ``cuModuleLoadData`` and
sizes one reduction workspace per shape the core's graphs reduce. At replay, the CUDA
implementation of ``ignition::reduce_logprobs`` calls the launcher, which looks the shape up
and issues the variant's launches, in kernel-table order, on torch's current stream with
``cuLaunchKernel``. Parameters are the kernel's non-constexpr arguments in signature order,
then ``SCRATCH_POINTERS`` null pointers (Triton's global and profile scratch). Nothing here
imports Triton, allocates, or compiles: the driver is NVIDIA's ``cuda-python``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ignition.catalog.contract import SCRATCH_POINTERS, TILE_SORT_KEYS
from ignition.catalog.model import reduction_rows


class LauncherError(RuntimeError):
    """The core's prepared kernels cannot serve this device (target, file or driver failure)."""


@dataclass(frozen=True, slots=True)
class ReductionShape:
    """Everything that selects a reduction's prepared launches."""

    rows: int
    vocab_padded: int
    vocab_size: int
    k: int
    explicit_ids: bool
    logits_dtype: str  # torch dtype name


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


def reduction_shapes(manifest: dict, catalog: dict) -> dict[ReductionShape, list[str]]:
    """Each shape the core's graphs reduce, with its launch keys in launch order."""
    shapes: dict[ReductionShape, list[str]] = {}
    for entry, layout in logprob_variants(catalog):
        rows = reduction_rows(entry["operation"], entry["capacity"], entry["contract"]["layout"])
        shape = ReductionShape(rows, manifest["vocab_padded"], manifest["vocab_size"], layout["k"],
                               bool(layout["explicit_ids"]), manifest["model"]["dtype"])
        launches = list(entry.get("launches") or [])
        if not launches:
            raise LauncherError(f"variant {entry['name']} reduces logprobs but lists no prepared launches; "
                                f"re-export the core with --targets")
        claim_launches(shapes, shape, launches, f"variant {entry['name']}: launches {launches} differ from another "
                                                f"variant of the same reduction shape")
    return shapes


def open_table(table: dict, device: torch.device, driver=None) -> tuple:
    """The driver (default cuda-python) with torch's primary context current on this thread for ``device``, and
    the kernel table's entries by (key, target); LauncherError when no context is current."""
    driver = driver or _driver()
    torch.zeros(1, device=device)  # makes torch's primary context current on this thread
    if int(check(driver.cuCtxGetCurrent(), driver)) == 0:
        raise LauncherError(f"no CUDA context is current for {device}")
    return driver, {(e["key"], e["target"]): e for e in table["kernels"]}


def launch_all(driver, stream: int, launches: list, values: dict) -> None:
    """Issues ``launches`` in order on ``stream`` (a CUDA stream handle), parameters packed from ``values`` by name."""
    stream = driver.CUstream(stream)
    for launch in launches:
        params, _holders = pack_params(launch.signature, values)
        check(driver.cuLaunchKernel(launch.function, *launch.grid, launch.threads, 1, 1, launch.shared_bytes,
                                    stream, ctypes.addressof(params), 0), driver)


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


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise LauncherError("CUDA replay needs NVIDIA's cuda-python driver bindings: pip install cuda-bindings") from exc
    return driver


def check(result, driver=None):
    """Unwrap a cuda-python ``(CUresult, *values)`` tuple, raising LauncherError on failure."""
    driver = driver or _driver()
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        raise LauncherError(f"CUDA driver call failed: {name.decode() if name else int(error)}")
    return values[0] if len(values) == 1 else (values or None)


_PARAM_TYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
                "fp32": ctypes.c_float, "fp64": ctypes.c_double}


def pack_params(signature: list[dict], values: dict[str, int | float]) -> tuple[ctypes.Array, list]:
    """``cuLaunchKernel`` parameters: the non-constexpr arguments in order, then the null scratch pointers.

    Returns the ``void*[]`` array and the objects it points into (keep both alive until the launch).
    """
    holders = []
    for param in signature:
        kind = param["type"]
        if kind == "constexpr":
            continue
        value = values[param["name"]]
        holders.append(ctypes.c_void_p(value) if kind.startswith("*") else _PARAM_TYPES[kind](value))
    holders += [ctypes.c_void_p(0) for _ in range(SCRATCH_POINTERS)]
    array = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    return array, holders


@dataclass(frozen=True, slots=True)
class PreparedLaunch:
    key: str
    function: object  # CUfunction
    signature: list[dict]
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int


def load_launches(root: Path, entries: dict, keys: list[str], target: str, driver, functions: dict,
                  modules: list) -> list[PreparedLaunch]:
    """The prepared launches of ``keys`` for ``target``: each cubin loaded once (``functions`` by file)."""
    launches = []
    for key in keys:
        entry = entries.get((key, target))
        if entry is None:
            raise LauncherError(f"kernels.json has no {target} binary for launch {key}")
        if entry["file"] not in functions:
            image = np.frombuffer((Path(root) / entry["file"]).read_bytes(), dtype=np.uint8)
            module = check(driver.cuModuleLoadData(image.ctypes.data), driver)
            modules.append(module)
            functions[entry["file"]] = check(driver.cuModuleGetFunction(module, entry["kernel_name"].encode()), driver)
        function = functions[entry["file"]]
        if entry["shared_bytes"] > 48 * 1024:  # above the default dynamic limit: opt in, as Triton does
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(function, attribute, entry["shared_bytes"]), driver)
        grid = tuple(entry["grid"]) + (1,) * (3 - len(entry["grid"]))
        launches.append(PreparedLaunch(key, function, entry["signature"], grid, entry["num_warps"] * 32,
                                       entry["shared_bytes"]))
    return launches


@dataclass(slots=True)
class ReductionWorkspace:
    """Sized once per shape at load and reused by every replay (no serving allocation)."""

    tiles: int
    stats: torch.Tensor  # [rows, tiles, 2] fp32
    maxima: torch.Tensor  # [rows, tiles, SUB] fp32 sub-block maxima
    lse: torch.Tensor  # [rows] fp32
    cutoff: torch.Tensor  # [rows] fp32
    keys: torch.Tensor  # [rows, tiles, TILE_SORT_KEYS] int64
    chosen: torch.Tensor  # [rows] int64: chosen ids widened when a graph passes int32

    @classmethod
    def allocate(cls, rows: int, tiles: int, sub: int, device: torch.device) -> "ReductionWorkspace":
        def fp32(*shape):
            return torch.empty(shape, dtype=torch.float32, device=device)
        return cls(tiles, fp32(rows, tiles, 2), fp32(rows, tiles, sub), fp32(rows), fp32(rows),
                   torch.empty(rows, tiles, TILE_SORT_KEYS, dtype=torch.int64, device=device),
                   torch.empty(rows, dtype=torch.int64, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.stats, self.maxima, self.lse, self.cutoff, self.keys, self.chosen

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class PreparedReduction:
    """The CUDA implementation of ``ignition::reduce_logprobs`` for one device and one core."""

    def __init__(self, device: torch.device, target: str, launches: dict, workspaces: dict, modules: list,
                 driver=None):
        self.device, self.target = device, target
        self.driver = driver or _driver()
        self.launches: dict[ReductionShape, list[PreparedLaunch]] = launches
        self.workspaces: dict[ReductionShape, ReductionWorkspace] = workspaces
        self._modules = modules  # CUmodules stay loaded while the core is
        self.launch_count = 0

    @classmethod
    def load(cls, root: Path, manifest: dict, catalog: dict, table: dict | None, device: torch.device,
             driver=None) -> "PreparedReduction | None":
        """The launcher for a core on ``device``; None when no graph of the core reduces logprobs; for a sharded
        core, a ``PreparedVocabulary`` (ignition/runtime/vocabulary_launcher.py).

        ``driver`` defaults to ``cuda.bindings.driver`` (tests pass an emulation of it)."""
        if not any(entry["contract"]["layout"].get("logprobs") for entry in catalog["variants"]):
            return None
        target = select_target(torch.cuda.get_device_capability(device), list(table["targets"]) if table else [],
                               str(device))
        if "tensor_parallel" in manifest:  # a rank of a sharded core: six sharded launches, seven per scoring block
            from ignition.runtime.vocabulary_launcher import PreparedVocabulary, scoring_shapes, vocabulary_shapes
            return PreparedVocabulary.load(root, manifest, table, vocabulary_shapes(manifest, catalog), device, target,
                                           driver, scoring_shapes(manifest, catalog))
        return cls.from_table(root, table, reduction_shapes(manifest, catalog), device, target, driver)

    @classmethod
    def from_table(cls, root: Path, table: dict, shapes: dict[ReductionShape, list[str]], device: torch.device,
                   target: str, driver=None) -> "PreparedReduction":
        """Load the binaries of ``target`` that ``shapes`` launch (a kernel table and the files it names under
        ``root``) and size each shape's workspace."""
        driver, entries = open_table(table, device, driver)
        functions, modules, launches, workspaces = {}, [], {}, {}
        for shape, keys in shapes.items():
            launches[shape] = load_launches(root, entries, keys, target, driver, functions, modules)
            first = entries[(keys[0], target)]  # launch 1 runs over (rows, tiles) with SUB sub-blocks per tile
            sub = first["constexprs"].get("SUB", 1)  # tables prepared before the cutoff have no sub-blocks
            workspaces[shape] = ReductionWorkspace.allocate(shape.rows, first["grid"][1], sub, device)
        return cls(device, target, launches, workspaces, modules, driver)

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
        if logits.stride(-1) != 1:
            raise LauncherError(f"logits must have unit vocabulary stride, got strides {logits.stride()}")
        workspace = self.workspaces[shape]
        if chosen.dtype != torch.int64 or not chosen.is_contiguous():  # kernels index ids with unit stride
            workspace.chosen.copy_(chosen)
            chosen = workspace.chosen
        ids = token_ids if token_ids is not None else requested  # never read without HAS_IDS
        counts = token_id_counts if token_id_counts is not None else requested
        strided = [name for name, t in (("requested", requested), ("out_rows", out_rows), ("token_ids", ids),
                                        ("token_id_counts", counts)) if not t.is_contiguous()]
        if strided:
            raise LauncherError(f"prepared launches index {', '.join(strided)} with unit stride; got strided views")
        values = {"logits_ptr": logits.data_ptr(), "chosen_ptr": chosen.data_ptr(), "requested_ptr": requested.data_ptr(),
                  "token_ids_ptr": ids.data_ptr(), "counts_ptr": counts.data_ptr(),
                  "stats_ptr": workspace.stats.data_ptr(), "lse_ptr": workspace.lse.data_ptr(),
                  "maxima_ptr": workspace.maxima.data_ptr(), "cutoff_ptr": workspace.cutoff.data_ptr(),
                  "keys_ptr": workspace.keys.data_ptr(), "out_ptr": out.data_ptr(),
                  "out_rows_ptr": out_rows.data_ptr(), "logits_row_stride": logits.stride(0),
                  "vocab_size": vocab_size, "num_tiles": workspace.tiles}
        launch_all(self.driver, self.current_stream(), launches, values)
        self.launch_count += len(launches)

    def current_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream
