"""load_core: validate, load weights once and every variant, allocate the buffers the runtime owns."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

import ignition  # noqa: F401  (registers the ops the graphs call)
from ignition.catalog.contract import manifest_token_capacity
from ignition.catalog.enums import Operation, Role, ValueSource
from ignition.catalog.model import BufferDecl, lane_count
from ignition.components.device_reduction import install_reduction, jit_opted_in
from ignition.runtime.device import move_program, resolve_device
from ignition.runtime.graphs import CaptureReport, capture_variants
from ignition.runtime.launcher import LauncherError, PreparedReduction
from ignition.runtime.transfer import HostTransfer
from ignition.validate.core import validate_core


class CoreLoadError(Exception):
    """The core is invalid or cannot be loaded; the message lists every finding."""


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


def _load_tokenizer(path: Path):
    file = path / "tokenizer" / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(file))


def _compiled_allowed(catalog: dict, trusted: bool) -> bool:
    packaged = [v["name"] for v in catalog["variants"] if v.get("packages", {}).get("inductor")]
    if packaged and not trusted:
        warnings.warn(f"not loading the compiled packages of {', '.join(packaged)}: they hold native code and the "
                      "core is not trusted (pass trust_compiled=True / --trust-compiled, or a trusted key that "
                      "signed it); using the portable .pt2 programs", stacklevel=3)
    return trusted


def _load_runnable(root: Path, entry: dict, prefer_compiled: bool, program, device: torch.device):
    """The variant's AOTInductor package when the core has one (preferred; CPU packages only), else its
    torch.export program (already loaded once by validation), moved to the device."""
    package = entry.get("packages", {}).get("inductor")
    if package is not None and prefer_compiled and device.type == "cpu":
        from ignition.exporter.compile import load_compiled
        try:
            return load_compiled(root / package)
        except Exception as exc:  # a package built for another machine: the portable program still runs
            warnings.warn(f"variant {entry['name']}: cannot load {package} ({type(exc).__name__}: {exc}); "
                          f"using {entry['graph']}", stacklevel=3)
    try:
        program = move_program(program, device)
    except ValueError as exc:
        raise CoreLoadError(f"variant {entry['name']}: {exc}") from None
    return program.module()


def _device_reduction(root: Path, report, device: torch.device) -> PreparedReduction | None:
    """Install the op's implementation for a CUDA device: the core's prepared cubins (or JIT, opted in)."""
    if device.type != "cuda":
        return None
    if jit_opted_in():
        warnings.warn("IGNITION_TRITON_JIT=1: the reduction JIT-compiles Triton instead of launching the core's "
                      "prepared kernels (development only)", stacklevel=3)
        install_reduction(device, None)
        return None
    try:
        reduction = PreparedReduction.load(root, report.manifest, report.catalog, report.kernels, device)
    except LauncherError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None
    install_reduction(device, reduction)
    return reduction


def load_core(path: str | Path, device: str | torch.device = "cpu", prefer_compiled: bool = True, *,
              eager: bool = False, trust_compiled: bool = False, trusted_key=None) -> LoadedCore:
    """Validate the core (refusing an invalid one with the validator's findings), then load it onto ``device``.

    ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. On CUDA the reduction launches the core's
    prepared cubins (a core without a binary for the device's architecture is refused), and every
    capturable variant is captured as a CUDA graph unless ``eager``.

    Compiled packages hold native code, so they are loaded only when ``trust_compiled`` is set or the
    core's signature verifies against ``trusted_key`` (an Ed25519 public key or its PEM path; with a
    key, an unsigned or wrongly signed core is refused). Otherwise the portable ``.pt2`` runs, with a warning.
    """
    root = Path(path)
    try:
        device = resolve_device(device)
    except ValueError as exc:
        raise CoreLoadError(str(exc)) from None
    try:
        report = validate_core(root, trusted_key=trusted_key)
    except ValueError as exc:  # SigningError: the trusted key file itself is unusable
        raise CoreLoadError(str(exc)) from None
    if not report.ok:
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in report.violations))
    manifest, catalog = report.manifest, report.catalog
    prefer_compiled = prefer_compiled and _compiled_allowed(catalog, trust_compiled or report.trusted)
    reduction = _device_reduction(root, report, device)
    weights = {name: t.to(device) for name, t in load_file(str(root / manifest["weights"])).items()}
    state = {d["name"]: BufferDecl.from_json(d).empty(device) for d in manifest["state"]}
    variants = {}
    for entry in catalog["variants"]:
        arguments = [BufferDecl.from_json(a) for a in entry["arguments"]]
        buffers = {}
        for arg in arguments:
            if arg.role is Role.WEIGHT:
                buffers[arg.name] = weights[arg.name]
            elif arg.role is Role.STATE:
                buffers[arg.name] = state[arg.name]
            else:
                buffers[arg.name] = arg.empty(device)
        run = _load_runnable(root, entry, prefer_compiled, report.programs[entry["name"]], device)
        variants[entry["name"]] = LoadedVariant(
            name=entry["name"], operation=Operation(entry["operation"]), capacity=entry["capacity"],
            arguments=arguments, bindings={k: ValueSource(v) for k, v in entry["contract"]["bindings"].items()},
            layout=entry["contract"]["layout"], run=run, buffers=buffers)
    capture = None
    if device.type == "cuda" and not eager:
        capture = capture_variants(variants, report.programs, state, device)
    return LoadedCore(path=root, manifest=manifest, weights=weights, state=state, variants=variants,
                      tokenizer=_load_tokenizer(root), device=device, transfer=HostTransfer(device),
                      reduction=reduction, capture=capture)

