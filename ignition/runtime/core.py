"""load_core: check the core, load weights once and every variant, allocate the buffers the runtime owns.

Loading checks what a start needs, no more: the manifest, catalog and kernel table against their
schemas and every catalog rule, the sha256 of every file, the signature and trust settings
(``validate_core(check_graphs=False)``), and then each graph through the safe ``.pt2`` reader on
the very bytes whose sha256 was just compared before Ignition's program reader builds the graph from
them (``validate/program_reader.py``; validate-core loads the same bytes with ``torch.export.load``). The
program read there is the one that runs. The weights are likewise read once, hashed and deserialized from
those bytes (the validator leaves the sha256 of the files loaded here to the loader), and a compiled
package is hashed and then loaded from a private copy of the verified bytes; the ONNX graphs (through
every ONNX rule) and ``tokenizer.json`` likewise (``ignition/runtime/verified.py``). So no file is read
twice and none can be swapped between its check and its load. ``validate-core`` stays the check of a
core at rest, with every finding; loading stops at the first graph that fails.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import ignition  # noqa: F401  (registers the ops the graphs call)
from ignition.catalog.enums import Operation, Role, ValueSource
from ignition.catalog.geometry import DYNAMIC_BLOCKS
from ignition.catalog.manifest import Manifest
from ignition.catalog.model import BufferDecl, lane_count
from ignition.catalog.softmax_order import short_row_mismatch
from ignition.components.device_reduction import jit_opted_in
from ignition.runtime.backends import backend_family
from ignition.runtime.backends.select import select_backend
from ignition.runtime.backends.gemm_calibration import GemmPlan, decode_rows
from ignition.runtime.backends.packed_linear import LinearPacks
from ignition.runtime.bindings import Windowed
from ignition.runtime.graphs import CaptureError, CaptureReport, capture_variants
from ignition.runtime.host_memory import retain_freed_memory
from ignition.runtime.identify import NotACoreError, check_rank_count, identify_core, read_manifest  # noqa: F401
from ignition.runtime.launchers.reduction import LauncherError, PreparedReduction, load_launcher
from ignition.runtime.load_stages import Progress, Stages, collector_paused, short_switch_interval
from ignition.runtime.kv_pool import KVPool, KVPoolError, plan_pool, pool_shape
from ignition.runtime.options import LoadOptions
from ignition.runtime.transfer import HostTransfer
from ignition.runtime.verified import (CoreLoadError, CoreRunError, LoadOptionError, check_loaded_weights, load_tokenizer,
                                       read_verified_weights)
from ignition.validate.core import validate_core
from ignition.validate.files import METADATA_MAX_BYTES, read_core_file


def without_autograd(inner: Callable, variant: str = "") -> Callable:
    """A replay run under ``torch.inference_mode``: a graph is replayed, never differentiated, so its operators skip
    autograd's dispatch and view tracking (a decode step of Qwen3-0.6B's width makes about 6,500 operator calls,
    most of them small). The buffers are ordinary tensors that the graph updates in place, which inference mode
    allows; what a replay returns is read, never updated. An index error or a failed allocation raised by the
    graph is the core's fault: a ``CoreRunError`` naming ``variant``."""
    def replay(buffers: dict[str, torch.Tensor]):
        try:
            with torch.inference_mode():
                return inner(buffers)
        except (IndexError, MemoryError, torch.OutOfMemoryError) as exc:
            raise CoreRunError(f"variant {variant}: the core's graph failed: {type(exc).__name__}: "
                               f"{str(exc)[:200]}") from None
        except Exception as exc:  # RuntimeError from torch; onnxruntime's own Fail and RuntimeException types
            if not _CORE_FAULT.search(str(exc)) and not type(exc).__module__.startswith("onnxruntime"):
                raise
            raise CoreRunError(f"variant {variant}: the core's graph failed: {str(exc)[:200]}") from None
    return replay


_CORE_FAULT = re.compile(r"out of memory|can't allocate memory|out of range|out of bounds|index .* is out")
"""RuntimeError messages of an index or allocation failure (torch raises both kinds as RuntimeError too)."""


@dataclass(slots=True)
class LoadedVariant:
    name: str
    operation: Operation
    capacity: int
    arguments: list[BufferDecl]
    bindings: dict[str, ValueSource]
    layout: dict
    runner: object  # the backend's replay: callable(buffers: dict)
    buffers: dict[str, torch.Tensor]  # every argument, in call order: weights/state shared, inputs/outputs owned
    next_frame: int = 0
    layers: list[str] = field(default_factory=list)  # what wraps or replaces the backend's runner, innermost first
    run: object = None  # the outermost layer: what a submission calls (set by __post_init__ and ``wrap``)

    def __post_init__(self):
        self.run = self.runner

    def wrap(self, name: str, layer: Callable) -> None:
        """Put ``layer(inner)`` around the current replay (``layers`` records it). Inference mode, the core's
        launcher binding, CUDA capture, windowing and tensor parallelism compose this way, in that order; nothing else
        changes ``run``."""
        self.run = layer(self.run)
        self.layers.append(name)

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
    options: LoadOptions | None = None  # what the load was asked for (device, backend family, ranks, trust)
    backend: str = "pt2"  # the backend load_core chose: pt2, aoti or onnx
    transfer: HostTransfer | None = None
    reduction: PreparedReduction | None = None  # CUDA: the prepared-kernel launcher
    capture: CaptureReport | None = None  # CUDA graphs (None when eager)
    timings: dict[str, float] = field(default_factory=dict)  # load stage -> wall seconds, in order
    group: object | None = None  # rank 0 of a tensor-parallel run: its RankGroup (ignition/runtime/parallel/group.py)
    kv_pool: KVPool | None = None  # the paged caches' pool (runtime/kv_pool.py; ``paged`` False for a core without)
    _spec: Manifest | None = None

    @property
    def load_seconds(self) -> float:
        return sum(self.timings.values())

    def __post_init__(self):
        if self.kv_pool is None:  # a LoadedCore assembled by hand (tests): the pool its state was allocated at
            size = plan_pool(self.spec.model, [BufferDecl.from_json(dict(d)) for d in self.spec.state])
            self.kv_pool = KVPool.build(size, self.state, self.options is not None and self.options.cuda)

    @property
    def device(self) -> torch.device:
        return self.options.device if self.options is not None else torch.device("cpu")

    @property
    def spec(self) -> Manifest:
        """The typed view of the manifest: ``load_core`` builds it once, from the validated manifest."""
        if self._spec is None:  # a LoadedCore assembled by hand (tests)
            self._spec = Manifest.from_json(self.manifest)
        return self._spec

    @property
    def features(self) -> dict:
        """The manifest's features as JSON (``spec.features`` is the typed view)."""
        return self.spec.features.as_json()

    @property
    def k(self) -> int:
        return self.spec.k

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def token_capacity(self) -> int:
        return self.spec.token_capacity

    def by_operation(self, operation: Operation) -> list[LoadedVariant]:
        return sorted((v for v in self.variants.values() if v.operation is operation), key=lambda v: v.capacity)

    def replica(self) -> "LoadedCore":
        """A second instance of this core for another engine (a draft core that is the target itself): the
        weights and programs are shared, the state (KV caches) and every owned buffer are its own."""
        if self.capture is not None:
            raise ValueError(f"core {self.path}: a CUDA-graph-captured core has no replica; load it again")
        state = {name: torch.zeros_like(tensor) for name, tensor in self.state.items()}
        on_cuda = self.options is not None and self.options.cuda
        pool = None if self.kv_pool is None else KVPool.build(self.kv_pool.size, state, on_cuda)
        variants = {}
        for name, variant in self.variants.items():
            buffers = {a.name: self.weights[a.name] if a.role is Role.WEIGHT else state[a.name] if a.role is Role.STATE
                       else torch.zeros_like(variant.buffers[a.name]) for a in variant.arguments}
            replica = LoadedVariant(variant.name, variant.operation, variant.capacity, variant.arguments,
                                    variant.bindings, variant.layout, variant.runner, buffers)
            replica.wrap("inference-mode", lambda inner, name=replica.name: without_autograd(inner, name))
            if variant.layout.get("windows") and "windowed" in variant.layers:
                replica.wrap("windowed", lambda inner: Windowed(inner, replica.bindings, replica.layout["windows"]))
            variants[name] = replica
        return LoadedCore(path=self.path, manifest=self.manifest, weights=self.weights, state=state, variants=variants,
                          tokenizer=self.tokenizer, options=self.options, backend=self.backend,
                          transfer=self.transfer, reduction=self.reduction, capture=None, kv_pool=pool,
                          _spec=self.spec)

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
        if self.options is not None and self.options.cuda:
            report["reduction_workspace_bytes"] = self.reduction.workspace_bytes if self.reduction else 0
            report["capture_pool_bytes"] = self.capture.pool_bytes if self.capture else 0
            report["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["device_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return report


def _device_reduction(root: Path, spec: Manifest, report, device: torch.device) -> PreparedReduction | None:
    """The core's launcher of its prepared cubins on a CUDA device (None: JIT, opted in), bound to its variants."""
    if jit_opted_in():
        warnings.warn("IGNITION_TRITON_JIT=1: the reduction JIT-compiles Triton instead of launching the core's "
                      "prepared kernels (development only)", stacklevel=3)
        return None
    try:
        return load_launcher(root, spec, report.catalog, report.kernels, device)
    except LauncherError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None


def _read_weights(root: Path, manifest: dict, files, catalog: dict, weights_file: str, device: torch.device,
                  packs: LinearPacks | None = None, drop_cache: bool = False) -> tuple[dict[str, torch.Tensor], bytes]:
    """(the weights on ``device``, the file's length and header bytes): ``weights_file`` read once and hashed
    (``read_verified_weights``), each tensor read into its own memory or, one that ``packs`` streams, packed from
    scratch (``drop_cache``: the file's page cache dropped as it is read); then checked against the catalog's
    declarations again."""
    weights, header = read_verified_weights(root, weights_file, files, packs, drop_cache)
    weights |= packs.streamed_weights() if packs is not None else {}  # checked as read: packed is not the file's
    check_loaded_weights(root, manifest, catalog, weights | (packs.streamed_as_read() if packs else {}), weights_file)
    return {name: t.to(device) for name, t in weights.items()}, header


def _hashed_on_load(root: Path, manifest: dict | None, options: LoadOptions) -> set[str]:
    """The files load_core reads once, hashing the very bytes it loads (``read_verified``, ``check_graph``):
    the validator leaves their sha256 to it. Names come from the manifest read alone; whatever the
    validated manifest then names is hashed where it is read, so a manifest changed in between only
    means a file is hashed by the loader instead of the validator."""
    if manifest is None:
        return set()
    rank = options.rank
    try:
        spec = Manifest.from_json(manifest)
        files = {spec.rank_weights(rank)}
        data, _ = read_core_file(root, spec.catalog, "manifest.json:catalog", METADATA_MAX_BYTES)
        if data is None:
            return set()
        catalog = json.loads(data)
        files |= backend_family(options.runtime).files(catalog, manifest, rank)  # the validator hashes the others
        if spec.tokenizer_file in spec.files:
            files.add(spec.tokenizer_file)
    except (OSError, ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError):
        return set()  # the validator reports what is wrong, and hashes everything
    return files


def _rank_weights(root: Path, spec: Manifest, options: LoadOptions) -> str:
    """The weights file of this rank; refuses a rank count that is not the core's."""
    check_rank_count(root, spec, options.ranks)
    return spec.rank_weights(options.rank)


def load_core(path: str | Path, options: LoadOptions | None = None, *, progress: Progress | None = None,
              **choices) -> LoadedCore:
    """Check the core (refusing an invalid one with the validator's findings), then load it as ``options`` say.

    ``options`` is a ``LoadOptions`` (ignition/runtime/options.py); without it, ``choices`` build one with
    ``LoadOptions.create`` (``tensor_parallel`` and ``rank`` name the ranks).
    On CUDA the reduction launches the core's prepared cubins (a core without a binary for the device's
    architecture is refused), and every capturable variant is captured as a CUDA graph unless ``eager``.

    Compiled packages hold native code, so they are loaded only when ``trust_compiled`` is set or the
    core's signature verifies against ``trusted_key`` (with a key, an unsigned or wrongly signed core is
    refused). Otherwise the portable ``.pt2`` runs, with a warning. The backend is chosen once
    (``select_backend``). ``progress(stage, item)`` is called as each stage starts (check; weights, as a worker
    thread starts reading and hashing them; graphs, read and checked meanwhile; runners, each variant bound to its
    buffers, linears packed; capture; tokenizer); ``LoadedCore.timings`` holds the seconds of each (weights: its start
    and the wait for the read that is left after the graphs). A sharded core loads
    one rank at a time; ignition/runtime/parallel/group.py starts the ranks and their process group.
    """
    root = Path(path)
    if options is None:
        rank = choices.pop("rank", 0)
        choices["ranks"] = choices.pop("tensor_parallel", choices.get("ranks", 1))
        try:
            options = LoadOptions.create(**choices)
        except TypeError as exc:
            raise LoadOptionError(f"load_core: {exc}") from None
        options = options.for_rank(rank) if rank else options
    elif choices:
        raise LoadOptionError(f"load_core: pass either LoadOptions or keyword choices, not both ({', '.join(choices)})")
    with collector_paused():
        return _load(root, options, progress)


def _load(root: Path, options: LoadOptions, progress: Progress | None) -> LoadedCore:
    stages = Stages(progress)
    identify_core(root)
    if options.retain_host_memory and not options.cuda:  # before the first replay allocates anything
        retain_freed_memory()
    stages.start("check", "hashes, schemas, catalog rules, signature")
    try:
        report = validate_core(root, check_graphs=False, trusted_key=options.trusted_key,
                               hashed_by_caller=_hashed_on_load(root, read_manifest(root), options))
    except ValueError as exc:  # SigningError: the trusted key file itself is unusable
        raise CoreLoadError(str(exc)) from None
    if not report.ok:
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in report.violations))
    manifest, catalog = report.manifest, report.catalog
    spec = Manifest.from_json(manifest)
    device = options.device
    weights_file = _rank_weights(root, spec, options)
    entries = catalog["variants"]
    declared = {entry["name"]: [BufferDecl.from_json(a) for a in entry["arguments"]] for entry in entries}
    packs = LinearPacks(gemm=GemmPlan(options.gemm, rows=decode_rows(entries))) if options.pack_linears and \
        backend_family(options.runtime).packs_linears else None
    # The weights are read and hashed on a worker thread (file reads and sha256 release the GIL) while this one
    # reads and checks the graph files (Python work), so load takes about the longer of the two, not their sum.
    with short_switch_interval(), ThreadPoolExecutor(1, thread_name_prefix="ignition-weights") as pool:
        stages.start("weights", weights_file)  # the read starts: after the check, as before any overlap
        reading = pool.submit(_read_weights, root, manifest, spec.files, catalog, weights_file, device, packs,
                              options.drop_file_cache)
        try:
            backend = select_backend(options, root, manifest, catalog, report.trusted, reading.result, packs, spec=spec)
            mismatch = None if options.cuda or not backend.aten_softmax else \
                short_row_mismatch(spec.model.softmax_short_row)
            if mismatch:
                warnings.warn(f"{root}: {mismatch}", stacklevel=4)
            if packs is not None and not backend.packs_linears:  # AOTInductor packages run their own kernels
                packs.decline()
                packs = None
            for index, entry in enumerate(entries, 1):
                stages.start("graphs", f"graph {index} of {len(entries)}: {entry['name']}")
                try:  # preparing evaluates a graph's weight-only nodes (runtime/backends/weight_constants.py)
                    backend.prepare(entry, declared[entry["name"]])
                except (IndexError, MemoryError, torch.OutOfMemoryError) as exc:
                    raise CoreLoadError(f"variant {entry['name']}: the core's graph failed: {type(exc).__name__}: "
                                        f"{str(exc)[:200]}") from None
        finally:  # the reader may wait for the first graph to say which weights it packs from scratch
            if packs is not None:
                packs.decline()
        stages.start("weights", weights_file, announce=False)  # the wait for the read that is left
        weights, _ = reading.result()
    if packs is not None:  # on the worker threads, while the variants are bound and their code generated
        packs.start(weights)
    reduction = _device_reduction(root, spec, report, device) if options.cuda and backend.needs_reduction else None
    state_decls = [BufferDecl.from_json(d) for d in spec.state]
    try:
        pool_size = plan_pool(spec.model, state_decls, options.kv_cache_memory, options.kv_host_memory)
    except KVPoolError as exc:
        raise CoreLoadError(f"{root}: {exc}") from None
    fixed = [entry["name"] for entry in entries if not entry["contract"]["layout"].get(DYNAMIC_BLOCKS)]
    if pool_size.num_blocks != pool_size.declared_blocks and (fixed or not backend.windowed):
        raise CoreLoadError(f"{root}: a KV pool of {pool_size.num_blocks} blocks (--kv-cache-memory) needs graphs that "
                            f"take any block count; the {backend.name} graphs of "
                            f"{', '.join(fixed) or 'every variant'} fix it at model.kv_blocks = "
                            f"{pool_size.declared_blocks} (load without --kv-cache-memory, or with at least "
                            f"{pool_size.declared_blocks * pool_size.bytes_per_block} bytes)")
    state = {decl.name: replace(decl, shape=pool_shape(decl, pool_size)).empty(device) for decl in state_decls}
    variants = {}
    for index, entry in enumerate(entries, 1):
        stages.start("runners", f"variant {index} of {len(entries)}: {entry['name']}")
        arguments = declared[entry["name"]]
        buffers = {}
        for arg in arguments:
            if arg.role is Role.WEIGHT:
                buffers[arg.name] = weights[arg.name]
            elif arg.role is Role.STATE:
                buffers[arg.name] = state[arg.name]
            else:
                buffers[arg.name] = arg.empty(device)
        variant = LoadedVariant(
            name=entry["name"], operation=Operation(entry["operation"]), capacity=entry["capacity"],
            arguments=arguments, bindings={k: ValueSource(v) for k, v in entry["contract"]["bindings"].items()},
            layout=entry["contract"]["layout"], runner=backend.runner(entry, arguments, buffers), buffers=buffers)
        variant.wrap("inference-mode", lambda inner, name=variant.name: without_autograd(inner, name))
        if reduction is not None:  # the core's own launcher, while its graphs run (and are captured)
            variant.wrap("launcher", reduction.bound)
        variants[entry["name"]] = variant
    if packs is not None:  # the raw copies no graph reads any more
        packs.finish(weights, variants.values())
    capture = None
    if options.cuda and not options.eager and backend.capturable:
        stages.start("capture", f"{len(variants)} CUDA graphs")
        try:  # at the full extents of every window
            capture = capture_variants(variants, backend.programs, state, device)
        except CaptureError as exc:
            raise CoreLoadError(f"{root}: {exc}") from None
    for variant in variants.values():  # ONNX graphs are re-traced static, and CUDA graphs captured at full extents
        windowed = backend.windowed and variant.layout.get("windows")
        if windowed and (capture is None or variant.name not in capture.captured):
            variant.wrap("windowed", lambda inner, v=variant: Windowed(inner, v.bindings, v.layout["windows"]))
    stages.start("tokenizer", spec.tokenizer or "none")
    tokenizer = load_tokenizer(root, spec)
    stages.stop()
    return LoadedCore(path=root, manifest=manifest, weights=weights, state=state, variants=variants,
                      tokenizer=tokenizer, options=options, backend=backend.name, transfer=HostTransfer(device),
                      reduction=reduction, capture=capture, timings=stages.timings,
                      kv_pool=KVPool.build(pool_size, state, options.cuda), _spec=spec)
