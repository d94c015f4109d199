"""LoadOptions: every load-time choice (device, backend, ranks, eager, trust), made once and passed down.

The CLI, the server and library callers build one ``LoadOptions`` with ``LoadOptions.create``, which
validates every field and resolves the device; ``load_core`` and the tensor-parallel start-up read it
and never decide again. Worker ranks receive it whole (``to_json`` / ``from_json`` over their stdin),
each with its own device from ``rank_device``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ignition.catalog.parallel import MAX_TENSOR_PARALLEL, PROCESS_GROUP_TIMEOUT_S
from ignition.runtime.backends import RUNTIMES, backend_family, blocked_linear
from ignition.runtime.backends.gemm_calibration import BLOCKED, GEMM_MODES
from ignition.runtime.backends.packed_linear import packing_available
from ignition.runtime.backends import paged_attention, rms_norm
from ignition.runtime.cuda_driver import DEVICE_CHOICES, is_cuda, resolve_device
from ignition.runtime.parallel.rendezvous import LOOPBACK
from ignition.runtime.verified import LoadOptionError

def native_kernels_unavailable() -> str | None:
    """None where every kernel of ``LoadOptions.native_kernels`` (the paged attention, the RMSNorm) builds and loads
    here; else the first reason why not."""
    return paged_attention.unavailable() or rms_norm.unavailable()


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What a load was asked for, validated. Build it with ``create``; fields are already resolved."""

    device: torch.device  # rank 0's device; ``rank_device`` gives the others
    runtime: str = "torch"  # the backend family (ignition.runtime.backends.RUNTIMES)
    ranks: int = 1  # tensor-parallel ranks (the core must hold that many shards)
    rank: int = 0  # the rank this process loads
    eager: bool = False  # CUDA: no CUDA-graph capture
    prefer_compiled: bool = True  # load AOTInductor packages when the core has them and they are trusted
    trust_compiled: bool = False  # load compiled packages without a signature
    trusted_key: object | None = None  # an Ed25519 public key: the core must be signed by it
    tp_host: str = LOOPBACK  # where the tensor-parallel store and transports listen
    timeout_s: float = PROCESS_GROUP_TIMEOUT_S  # the process group's timeout
    retain_host_memory: bool = True  # CPU: glibc keeps freed blocks for the next replay (runtime/host_memory.py)
    pack_linears: bool = True  # CPU: linear weights packed once for oneDNN (runtime/backends/packed_linear.py)
    drop_file_cache: bool = True  # the weights file's page cache dropped as it is read (runtime/verified.py)
    gemm: str = "calibrate"  # CPU: packed, blocked or aten.linear per weight shape, timed here (gemm_calibration.py)
    kv_cache_memory: int | None = None  # bytes of the paged KV pool (runtime/kv_pool.py); None: the core's upper bound
    kv_host_memory: int = 0  # bytes of the host tier evicted KV blocks move to
    native_kernels: bool = True  # CPU: decode attention on the KV pool in place, RMSNorm in one call (backends/)

    @classmethod
    def create(cls, device: str | torch.device = "auto", runtime: str = "torch", ranks: int = 1, *, eager: bool = False,
               prefer_compiled: bool = True, trust_compiled: bool = False, trusted_key=None,
               tp_host: str = LOOPBACK, timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
               retain_host_memory: bool = True, pack_linears: bool = True,
               drop_file_cache: bool = True, gemm: str = "calibrate", kv_cache_memory: int | None = None,
               kv_host_memory: int = 0, native_kernels: bool = True) -> "LoadOptions":
        """Validate and resolve; LoadOptionError naming the option that cannot work here."""
        if runtime not in RUNTIMES:
            raise LoadOptionError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_TENSOR_PARALLEL:
            raise LoadOptionError(f"--tensor-parallel must be between 1 and {MAX_TENSOR_PARALLEL}, got {ranks!r}")
        if ranks > 1 and not backend_family(runtime).supports_ranks:
            supported = ", ".join(name for name in RUNTIMES if backend_family(name).supports_ranks)
            raise LoadOptionError(f"--runtime {runtime} replays single-rank cores only, so it cannot run "
                                  f"--tensor-parallel {ranks}; tensor parallelism is supported with --runtime "
                                  f"{supported} (gloo on CPU, NCCL on CUDA)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise LoadOptionError(f"the process-group timeout must be a positive number of seconds, got {timeout_s!r}")
        if isinstance(trusted_key, (str, Path)):
            from ignition.catalog.signatures import SigningError, load_trusted_key
            try:
                trusted_key = load_trusted_key(trusted_key)
            except SigningError as exc:
                raise LoadOptionError(f"--trusted-key {exc}") from None
        try:
            resolved = resolve_device(device)
        except ValueError as exc:
            raise LoadOptionError(str(exc)) from None
        pack_linears = bool(pack_linears) and not is_cuda(resolved) and packing_available()  # a CPU choice only
        if gemm not in GEMM_MODES:
            raise LoadOptionError(f"--gemm must be one of {', '.join(GEMM_MODES)}, got {gemm!r}")
        missing = blocked_linear.unavailable() if gemm == BLOCKED and pack_linears else None
        if missing:
            raise LoadOptionError(f"--gemm {BLOCKED} needs the blocked product, which this machine cannot build: "
                                  f"{missing}; use --gemm calibrate, packed or aten")
        for option, value, least in (("--kv-cache-memory", kv_cache_memory, 1), ("--kv-host-memory", kv_host_memory, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise LoadOptionError(f"{option} must be a byte count of at least {least}, got {value!r}")
        options = cls(resolved, runtime, ranks, 0, bool(eager), bool(prefer_compiled), bool(trust_compiled),
                      trusted_key, tp_host, float(timeout_s), bool(retain_host_memory), pack_linears,
                      bool(drop_file_cache), gemm, kv_cache_memory, kv_host_memory,
                      bool(native_kernels) and not is_cuda(resolved) and native_kernels_unavailable() is None)
        options.rank_device(ranks - 1)  # every rank must get a device before anything starts
        return options

    @property
    def cuda(self) -> bool:
        """Whether this load runs on a CUDA device (the one place the runtime asks)."""
        return is_cuda(self.device)

    @property
    def collective_backend(self) -> str:
        """The torch.distributed backend of a tensor-parallel group: NCCL on CUDA, gloo on the CPU."""
        return "nccl" if self.cuda else "gloo"

    def rank_device(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: the CPU for every rank on CPU; on CUDA, consecutive GPUs from rank 0's
        (``--device cuda:1 --tensor-parallel 2`` runs ranks 0 and 1 on cuda:1 and cuda:2). LoadOptionError
        when this machine has too few."""
        if not 0 <= rank < self.ranks:
            raise LoadOptionError(f"rank {rank} is outside the {self.ranks} ranks")
        if not self.cuda:
            return self.device
        index = self.device.index + rank
        if index >= torch.cuda.device_count():
            raise LoadOptionError(f"--tensor-parallel {self.ranks} from {self.device} needs CUDA devices "
                                  f"{self.device.index}..{self.device.index + self.ranks - 1}, but torch sees "
                                  f"{torch.cuda.device_count()}")
        return torch.device("cuda", index)

    def for_rank(self, rank: int, device: torch.device | None = None) -> "LoadOptions":
        """These options as rank ``rank`` loads them (its own device unless ``device`` is given, as torchrun's
        LOCAL_RANK gives it)."""
        return replace(self, rank=rank, device=device if device is not None else self.rank_device(rank))

    def for_draft(self) -> "LoadOptions":
        """The options a speculative draft core loads with: rank 0's device, one rank, and its compiled packages
        trusted only by its own signature (``--trust-compiled`` names the target core only)."""
        return replace(self, ranks=1, rank=0, trust_compiled=False)

    def to_json(self) -> str:
        """One line for a worker rank's stdin (the trusted key as its PEM text): rank 0's options, which the
        worker turns into its own with ``for_rank``."""
        fields = asdict(self) | {"device": str(self.device)}
        if self.trusted_key is not None:
            from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
            fields["trusted_key"] = self.trusted_key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
        return json.dumps(fields)

    @classmethod
    def from_json(cls, line: str) -> "LoadOptions":
        """What ``to_json`` wrote, checked field by field."""
        try:
            fields = json.loads(line)
            key = fields.pop("trusted_key")
            fields.pop("rank")  # rank 0's options: each worker takes its own with ``for_rank``
            device = fields.pop("device")
            runtime, ranks = fields.pop("runtime"), fields.pop("ranks")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LoadOptionError(f"unreadable load options from rank 0: {exc}") from None
        if key is not None:
            from cryptography.hazmat.primitives.serialization import load_pem_public_key
            key = load_pem_public_key(key.encode())
        try:
            return cls.create(device, runtime, ranks, trusted_key=key, **fields)
        except TypeError as exc:
            raise LoadOptionError(f"unreadable load options from rank 0: {exc}") from None


__all__ = ["LoadOptions", "LoadOptionError", "resolve_device", "DEVICE_CHOICES", "LOOPBACK"]
