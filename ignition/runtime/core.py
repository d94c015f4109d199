"""load_core: check the core, load weights once and every variant, allocate the buffers the runtime owns.

Loading checks what a start needs, no more: the manifest, catalog and kernel table against their
schemas and every catalog rule, the sha256 of every file, the signature and trust settings
(``validate_core(check_graphs=False)``), and then each graph through the safe ``.pt2`` reader on
the very bytes whose sha256 was just compared before ``torch.export.load`` reads them. The program
loaded there is the one that runs. The weights are likewise read once, hashed and deserialized from
those bytes (the validator leaves the sha256 of the files loaded here to the loader), and a compiled
package is hashed and then loaded from a private copy of the verified bytes; the ONNX graphs (through
every ONNX rule) and ``tokenizer.json`` likewise (``ignition/runtime/verified.py``). So no file is read
twice and none can be swapped between its check and its load. ``validate-core`` stays the check of a
core at rest, with every finding; loading stops at the first graph that fails.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ignition  # noqa: F401  (registers the ops the graphs call)
from ignition.catalog.contract import manifest_token_capacity
from ignition.catalog.enums import Operation, Role, ValueSource
from ignition.catalog.model import MANIFEST_FILE, BufferDecl, lane_count
from ignition.components.device_reduction import jit_opted_in
from ignition.runtime.bindings import Windowed
from ignition.runtime.device import move_program, resolve_device
from ignition.runtime.graphs import CaptureError, CaptureReport, capture_variants
from ignition.runtime.launcher import LauncherError, PreparedReduction, load_launcher
from ignition.runtime.onnx_backend import RUNTIMES
from ignition.runtime.parallel_options import ParallelOptionError, check_runtime
from ignition.runtime.transfer import HostTransfer
from ignition.runtime.verified import (CoreLoadError, LoadOptionError, check_loaded_weights, load_tokenizer,
                                       private_copy, read_verified, tokenizer_file, weights_offsets)
from ignition.runtime.weights import WeightsFormatError, view_tensors
from ignition.validate.core import validate_core
from ignition.validate.files import safe_path
from ignition.validate.geometry import check_graph_vocabulary
from ignition.validate.graphs import check_graph
from ignition.validate.onnx_graphs import check_pairing
from ignition.validate.parallel import check_program, rank_graph_files

Progress = Callable[[str, str], None]  # (stage, item), called as each stage starts


class NotACoreError(CoreLoadError):
    """The path is no core at all (a Hugging Face checkpoint, a missing directory): a usage error.
    ``model_type``: the checkpoint's config.json ``model_type`` when the path is a checkpoint."""

    def __init__(self, message: str, checkpoint: bool = False, model_type: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.model_type = model_type


def identify_core(path: str | Path) -> None:
    """Raise NotACoreError, before any heavy work, when ``path`` cannot be a core: it is missing, not a
    directory, or a Hugging Face checkpoint (``config.json``, no manifest) that needs ``export-core``."""
    root = Path(path)
    if not root.exists():
        raise NotACoreError(f"{root} does not exist; expected a core directory written by `ignition export-core`")
    if not root.is_dir():
        raise NotACoreError(f"{root} is a file; expected a core directory written by `ignition export-core`")
    if not (root / MANIFEST_FILE).exists() and (root / "config.json").is_file():
        model_type = _model_type(root / "config.json")
        raise NotACoreError(f"{root} is a Hugging Face checkpoint, not a core; run "
                            f"`ignition export-core {root} --recipe RECIPE --out CORE` first, then use CORE",
                            checkpoint=True, model_type=model_type)


def _model_type(config: Path) -> str | None:
    try:
        value = json.loads(config.read_bytes()).get("model_type")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@dataclass(slots=True)
class LoadedVariant:
    name: str
    operation: Operation
    capacity: int
    arguments: list[BufferDecl]
    bindings: dict[str, ValueSource]
    layout: dict
    run: object  # callable(buffers: dict) -> tuple
    buffers: dict[str, torch.Tensor]  # every argument, in call order: weights/state shared, inputs/outputs owned
    next_frame: int = 0

    @property
    def lanes(self) -> int:
        return lane_count(self.operation, self.capacity)

    def owned_bytes(self, role: Role) -> int:
        return sum(a.nbytes for a in self.arguments if a.role is role)


@dataclass(slots=True)
class LoadedCore:
    path: Path
    manifest: dict
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    variants: dict[str, LoadedVariant]
    tokenizer: object | None = None
    device: torch.device = torch.device("cpu")
    transfer: HostTransfer | None = None
    reduction: PreparedReduction | None = None  # CUDA: the prepared-kernel launcher
    capture: CaptureReport | None = None  # CUDA graphs (None when eager)
    runtime: str = "torch"  # the backend chosen at load: torch or onnxruntime
    timings: dict[str, float] = field(default_factory=dict)  # load stage -> wall seconds, in order
    group: object | None = None  # rank 0 of a tensor-parallel run: its RankGroup (ignition/runtime/parallel.py)

    @property
    def load_seconds(self) -> float:
        return sum(self.timings.values())

    @property
    def features(self) -> dict:
        return self.manifest["features"]

    @property
    def k(self) -> int:
        return self.manifest["k"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def token_capacity(self) -> int:
        return manifest_token_capacity(self.manifest)

    def by_operation(self, operation: Operation) -> list[LoadedVariant]:
        return sorted((v for v in self.variants.values() if v.operation is operation), key=lambda v: v.capacity)

    def replica(self) -> "LoadedCore":
        """A second instance of this core for another engine (a draft core that is the target itself): the
        weights and programs are shared, the state (KV caches) and every owned buffer are its own."""
        if self.capture is not None:
            raise ValueError(f"core {self.path}: a CUDA-graph-captured core has no replica; load it again")
        state = {name: torch.zeros_like(tensor) for name, tensor in self.state.items()}
        variants = {}
        for name, variant in self.variants.items():
            buffers = {a.name: self.weights[a.name] if a.role is Role.WEIGHT else state[a.name] if a.role is Role.STATE
                       else torch.zeros_like(variant.buffers[a.name]) for a in variant.arguments}
            variants[name] = LoadedVariant(variant.name, variant.operation, variant.capacity, variant.arguments,
                                           variant.bindings, variant.layout, variant.run, buffers)
        return LoadedCore(path=self.path, manifest=self.manifest, weights=self.weights, state=state, variants=variants,
                          tokenizer=self.tokenizer, device=self.device, transfer=self.transfer,
                          reduction=self.reduction, capture=None)

    def memory_report(self) -> dict[str, int]:
        """Physical bytes of weights, state (KV), completion frames and other owned buffers."""
        frames = sum(v.buffers[a.name].numel() * v.buffers[a.name].element_size()
                     for v in self.variants.values() for a in v.arguments if a.role is Role.OUTPUT)
        inputs = sum(v.owned_bytes(Role.INPUT) for v in self.variants.values())
        report = {
            "weights_bytes": sum(t.numel() * t.element_size() for t in self.weights.values()),
            "state_bytes": sum(t.numel() * t.element_size() for t in self.state.values()),
            "completion_frame_bytes": frames,
            "input_bytes": inputs,
        }
        if self.device.type == "cuda":
            report["reduction_workspace_bytes"] = self.reduction.workspace_bytes if self.reduction else 0
            report["capture_pool_bytes"] = self.capture.pool_bytes if self.capture else 0
            report["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["device_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return report


def _compiled_allowed(catalog: dict, trusted: bool) -> bool:
    packaged = [v["name"] for v in catalog["variants"] if v.get("packages", {}).get("inductor")]
    if packaged and not trusted:
        warnings.warn(f"not loading the compiled packages of {', '.join(packaged)}: they hold native code and the "
                      "core is not trusted (pass trust_compiled=True / --trust-compiled, or a trusted key that "
                      "signed it); using the portable .pt2 programs", stacklevel=3)
    return trusted


def _load_runnable(root: Path, entry: dict, prefer_compiled: bool, program, device: torch.device, manifest: dict):
    """The variant's AOTInductor package when the core has one (preferred; CPU packages only), else its
    torch.export program (loaded once, by the safe reader's caller), moved to the device. The package
    is hashed as it is read and loaded from a private copy of those bytes (``private_copy``)."""
    package = entry.get("packages", {}).get("inductor")
    if package is not None and prefer_compiled and device.type == "cpu":
        from ignition.exporter import compile as compiled
        data = read_verified(root, package, manifest)
        try:
            with private_copy(data, package) as copy:
                return compiled.load_compiled(copy)
        except Exception as exc:  # a package built for another machine: the portable program still runs
            warnings.warn(f"variant {entry['name']}: cannot load {package} ({type(exc).__name__}: {exc}); "
                          f"using {entry['graph']}", stacklevel=3)
    try:
        program = move_program(program, device)
    except ValueError as exc:
        raise CoreLoadError(f"variant {entry['name']}: {exc}") from None
    return program.module()


def _onnx_backend(root: Path, weights: dict[str, torch.Tensor], device: torch.device):
    from ignition.runtime.onnx_backend import OnnxBackendError, OnnxRuntimeBackend
    try:
        return OnnxRuntimeBackend(root, weights, device)
    except OnnxBackendError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None


def _onnx_run(backend, entry: dict, arguments: list[BufferDecl], buffers: dict[str, torch.Tensor], manifest: dict,
              offsets: dict[str, tuple[int, int]]):
    """The variant's ONNX replay, from its graph's bytes read once, hashed, and checked by every ONNX rule
    validate-core runs (``check_onnx_graph``) before onnxruntime parses those same bytes."""
    from ignition.runtime.onnx_backend import OnnxBackendError
    from ignition.validate.onnx_graphs import check_onnx_graph

    rel = entry.get("packages", {}).get("onnx")
    if rel is None:
        raise CoreLoadError(f"{backend.root}: variant {entry['name']} has no ONNX graph: export the core with --onnx")
    data = bytes(read_verified(backend.root, rel, manifest))  # onnxruntime parses bytes (weights are external)
    found = check_onnx_graph(data, entry, manifest["weights"], offsets)
    if found:
        raise CoreLoadError(f"{backend.root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
    try:
        return backend.variant_run(entry, arguments, buffers, data)
    except OnnxBackendError as exc:
        raise CoreLoadError(f"{backend.root}: {exc}") from None


def _device_reduction(root: Path, report, device: torch.device) -> PreparedReduction | None:
    """The core's launcher of its prepared cubins on a CUDA device (None: JIT, opted in), bound to its variants."""
    if device.type != "cuda":
        return None
    if jit_opted_in():
        warnings.warn("IGNITION_TRITON_JIT=1: the reduction JIT-compiles Triton instead of launching the core's "
                      "prepared kernels (development only)", stacklevel=3)
        return None
    try:
        return load_launcher(root, report.manifest, report.catalog, report.kernels, device)
    except LauncherError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None


def read_manifest(path: str | Path) -> dict | None:
    """The core's manifest when it parses and matches its schema, read alone (no other file, no hashes):
    what the CLI checks options against before loading. None otherwise; load_core then says why."""
    from ignition.validate.schema import parse_json, schema_violations

    file = Path(path) / MANIFEST_FILE
    try:
        data = file.read_bytes()
    except OSError:
        return None
    manifest, problems = parse_json(data, MANIFEST_FILE)
    if problems or schema_violations(manifest, "manifest.schema.json", MANIFEST_FILE):
        return None
    return manifest


class _Stages:
    """Wall seconds per load stage, and the caller's progress callback as each one starts."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.timings: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def start(self, stage: str, item: str = "") -> None:
        self.stop()
        if self.progress is not None:
            self.progress(stage, item)
        self._current = (stage, time.perf_counter())

    def stop(self) -> None:
        if self._current is not None:
            stage, started = self._current
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - started
            self._current = None


def _load_program(root: Path, entry: dict, manifest: dict, rel: str):
    """The variant's graph file ``rel`` (this rank's, for a sharded core): sha256 and the safe reader on the
    bytes that torch.export.load then reads; a sharded core's graph also has its collectives checked."""
    graph_path, problems = safe_path(root, rel, f"variant {entry['name']}")
    if graph_path is None:  # validate_core already refused such a path; kept for a core changed since
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in problems))
    found, program = check_graph(graph_path, entry, sha256=manifest["files"].get(rel))
    if not found and program is not None:
        found = check_graph_vocabulary(program, manifest, rel)
        if "tensor_parallel" in manifest:
            found += check_program(program, manifest, rel)
    if found or program is None:
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
    return program


def _hashed_on_load(root: Path, manifest: dict | None, rank: int, runtime: str) -> set[str]:
    """The files load_core reads once, hashing the very bytes it loads (``read_verified``, ``check_graph``):
    the validator leaves their sha256 to it. Names come from the manifest read alone; whatever the
    validated manifest then names is hashed where it is read, so a manifest changed in between only
    means a file is hashed by the loader instead of the validator."""
    if manifest is None:
        return set()
    section = manifest.get("tensor_parallel")
    try:
        files = {section["rank_files"][rank]["weights"] if section else manifest["weights"]}
        catalog_path, _ = safe_path(root, manifest["catalog"], "manifest.json:catalog")
        catalog = json.loads(catalog_path.read_bytes())
        if runtime == "onnxruntime":  # the ONNX backend reads no .pt2: the validator hashes those
            files |= {v["packages"]["onnx"] for v in catalog["variants"] if "onnx" in v.get("packages", {})}
        else:
            files |= set(_graph_files(catalog, manifest, rank).values())
        if tokenizer_file(manifest) in manifest["files"]:
            files.add(tokenizer_file(manifest))
    except (OSError, ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError):
        return set()  # the validator reports what is wrong, and hashes everything
    return files


def _graph_files(catalog: dict, manifest: dict, rank: int) -> dict[str, str]:
    """Variant name -> the graph file this rank loads (a sharded core's rank files replace the catalog's)."""
    return {v["name"]: v["graph"] for v in catalog["variants"]} | rank_graph_files(manifest, rank)


def _rank_weights(root: Path, manifest: dict, rank: int, tensor_parallel: int) -> str:
    """The weights file of ``rank``; refuses a rank count that is not the core's."""
    section = manifest.get("tensor_parallel")
    ranks = section["ranks"] if section else 1
    if tensor_parallel != ranks:
        hint = f"run it with --tensor-parallel {ranks}" if section else "run it without --tensor-parallel"
        raise CoreLoadError(f"{root}: the core holds {ranks} rank shard{'s' if ranks > 1 else ''}, "
                            f"not {tensor_parallel}; {hint}")
    if not 0 <= rank < ranks:
        raise CoreLoadError(f"{root}: rank {rank} is outside the core's {ranks} ranks")
    return section["rank_files"][rank]["weights"] if section else manifest["weights"]


def load_core(path: str | Path, device: str | torch.device = "cpu", prefer_compiled: bool = True, *,
              eager: bool = False, trust_compiled: bool = False, trusted_key=None, runtime: str = "torch",
              progress: Progress | None = None, rank: int = 0, tensor_parallel: int = 1) -> LoadedCore:
    """Check the core (refusing an invalid one with the validator's findings), then load it onto ``device``.

    ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. On CUDA the reduction launches the core's
    prepared cubins (a core without a binary for the device's architecture is refused), and every
    capturable variant is captured as a CUDA graph unless ``eager``.

    Compiled packages hold native code, so they are loaded only when ``trust_compiled`` is set or the
    core's signature verifies against ``trusted_key`` (an Ed25519 public key or its PEM path; with a
    key, an unsigned or wrongly signed core is refused). Otherwise the portable ``.pt2`` runs, with a warning.

    ``runtime`` chooses the backend once: ``torch`` (the ``.pt2`` programs or compiled packages) or
    ``onnxruntime`` (the core's ONNX graphs, exported with ``--onnx``; see ``ignition.runtime.onnx_backend``).
    ``progress(stage, item)`` is called as each stage starts (check, weights, graph, capture,
    tokenizer); ``LoadedCore.timings`` holds the seconds of each.
    A sharded core loads one rank at a time (``rank`` of ``tensor_parallel``, which must be the core's
    rank count); ignition/runtime/parallel.py starts the ranks and their process group.
    """
    root = Path(path)
    if runtime not in RUNTIMES:
        raise LoadOptionError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
    try:
        check_runtime(runtime, tensor_parallel)
    except ParallelOptionError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None
    stages = _Stages(progress)
    identify_core(root)
    try:
        device = resolve_device(device)
    except ValueError as exc:
        raise LoadOptionError(str(exc)) from None
    stages.start("check", "hashes, schemas, catalog rules, signature")
    try:
        report = validate_core(root, check_graphs=False, trusted_key=trusted_key,
                               hashed_by_caller=_hashed_on_load(root, read_manifest(root), rank, runtime))
    except ValueError as exc:  # SigningError: the trusted key file itself is unusable
        raise CoreLoadError(str(exc)) from None
    if not report.ok:
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in report.violations))
    manifest, catalog = report.manifest, report.catalog
    weights_file = _rank_weights(root, manifest, rank, tensor_parallel)
    onnx = runtime == "onnxruntime"
    prefer_compiled = not onnx and prefer_compiled and _compiled_allowed(catalog, trust_compiled or report.trusted)
    reduction = None if onnx else _device_reduction(root, report, device)  # ONNX graphs reduce in standard ops
    stages.start("weights", weights_file)
    weights_data = read_verified(root, weights_file, manifest)
    try:  # views of the verified bytes: on CPU the weights are read once and never copied
        weights = view_tensors(weights_data)
    except WeightsFormatError as exc:
        raise CoreLoadError(f"{root}: {weights_file}: {exc}") from None
    check_loaded_weights(root, manifest, catalog, weights, weights_file)
    weights = {name: t.to(device) for name, t in weights.items()}
    offsets = weights_offsets(weights_data) if onnx else {}
    del weights_data  # the CPU views keep the buffer; a device copy lets it go
    backend = _onnx_backend(root, weights, device) if onnx else None
    if onnx and (found := check_pairing(catalog["variants"])):
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found))
    graph_files = _graph_files(catalog, manifest, rank)
    state = {d["name"]: BufferDecl.from_json(d).empty(device) for d in manifest["state"]}
    variants, programs = {}, {}
    entries = catalog["variants"]
    for index, entry in enumerate(entries, 1):
        stages.start("graphs", f"graph {index} of {len(entries)}: {entry['name']}")
        if not onnx:
            programs[entry["name"]] = _load_program(root, entry, manifest, graph_files[entry["name"]])
        arguments = [BufferDecl.from_json(a) for a in entry["arguments"]]
        buffers = {}
        for arg in arguments:
            if arg.role is Role.WEIGHT:
                buffers[arg.name] = weights[arg.name]
            elif arg.role is Role.STATE:
                buffers[arg.name] = state[arg.name]
            else:
                buffers[arg.name] = arg.empty(device)
        if onnx:  # the .pt2 programs are neither read nor loaded
            run = _onnx_run(backend, entry, arguments, buffers, manifest, offsets)
        else:
            run = _load_runnable(root, entry, prefer_compiled, programs[entry["name"]], device, manifest)
            if reduction is not None:  # the core's own launcher, while its graphs run (and are captured)
                run = reduction.bound(run)
        variants[entry["name"]] = LoadedVariant(
            name=entry["name"], operation=Operation(entry["operation"]), capacity=entry["capacity"],
            arguments=arguments, bindings={k: ValueSource(v) for k, v in entry["contract"]["bindings"].items()},
            layout=entry["contract"]["layout"], run=run, buffers=buffers)
    capture = None
    if device.type == "cuda" and not eager and not onnx:
        stages.start("capture", f"{len(variants)} CUDA graphs")
        try:  # at the full extents of every window
            capture = capture_variants(variants, programs, state, device)
        except CaptureError as exc:
            raise CoreLoadError(f"{root}: {exc}") from None
    for variant in variants.values():  # ONNX graphs are re-traced static, and CUDA graphs captured at full extents
        if not onnx and variant.layout.get("windows") and (capture is None or variant.name not in capture.captured):
            variant.run = Windowed(variant.run, variant.bindings, variant.layout["windows"])
    stages.start("tokenizer", manifest["tokenizer"] or "none")
    tokenizer = load_tokenizer(root, manifest)
    stages.stop()
    return LoadedCore(path=root, manifest=manifest, weights=weights, state=state, variants=variants,
                      tokenizer=tokenizer, device=device, transfer=HostTransfer(device),
                      reduction=reduction, capture=capture, runtime=runtime, timings=stages.timings)
