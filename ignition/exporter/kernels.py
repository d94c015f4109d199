"""Ahead-of-time kernel preparation: compile every launch for every named target, no GPU needed.

The runtime never compiles: each (launch, target) becomes a cubin under ``kernels/`` plus one
entry of the kernel table (``kernels.json``, schema ``kernels.schema.json``). Preparation is
hermetic and reproducible: a fresh Triton cache directory per call, line information off
(it would embed this checkout's absolute source paths in the binary), and FP fusion set
explicitly. Preparing the same specs twice gives byte-identical files and table.

Each binary gets the specialization Triton's JIT gives a call with aligned arguments: every pointer
argument carries ``tt.divisibility=16`` (so loads vectorize as they do under the JIT), recorded per
parameter in the table as ``divisibility``; the launcher refuses an address that breaks it. The JIT also
specializes integer arguments by value (1 becomes a constant, multiples of 16 divisible), which one
prepared binary cannot: every integer parameter of a prepared kernel must be ``do_not_specialize``.

Triton is imported only inside ``prepare_kernels``. The targets themselves are contract data
(``ignition.catalog.targets``).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ignition.catalog.contract import POINTER_DIVISIBILITY
from ignition.catalog.targets import KERNELS_DIR, TARGETS, Target, parse_targets

if TYPE_CHECKING:
    from ignition.components.triton_logprobs import LaunchSpec


_INTEGER_TYPES = ("i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")


class KernelPreparationError(RuntimeError):
    """A launch cannot be prepared for a target (compilation failed or it does not fit)."""


def divisibility(spec: LaunchSpec) -> dict[str, int]:
    """Parameter -> the divisibility its binary assumes: ``POINTER_DIVISIBILITY`` for every pointer argument, as the
    JIT assumes of an aligned one. KernelPreparationError for an integer parameter the JIT would specialize by value."""
    names = spec.kernel.arg_names
    unspecialized = {names[i] if isinstance(i, int) else i for i in spec.kernel.do_not_specialize}
    by_value = [name for name, kind in spec.signature.items() if kind in _INTEGER_TYPES and name not in unspecialized]
    if by_value:
        raise KernelPreparationError(f"kernel {spec.name}: integer parameter(s) {', '.join(by_value)} would be "
                                     f"specialized by value under the JIT, which a prepared binary cannot be; mark "
                                     f"them do_not_specialize")
    return {name: POINTER_DIVISIBILITY for name, kind in spec.signature.items() if kind.startswith("*")}


def launch_key(spec: LaunchSpec) -> str:
    """Stable key of one launch: its name plus a digest of everything that defines it."""
    config = {"kernel": f"{spec.kernel.fn.__module__}.{spec.kernel.fn.__qualname__}", "signature": spec.signature,
              "constexprs": spec.constexprs, "num_warps": spec.num_warps, "num_stages": spec.num_stages,
              "grid": list(spec.grid)}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return f"{spec.name}.{digest[:12]}"


def prepare_kernels(specs: list[LaunchSpec], targets: list[str], out_dir: Path) -> dict:
    """Compile each distinct spec for each target into ``out_dir/kernels``; returns the kernel table."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ignition.components.triton_logprobs import ENABLE_FP_FUSION

    targets = parse_targets(",".join(targets))
    unique = {launch_key(spec): spec for spec in specs}
    (Path(out_dir) / KERNELS_DIR).mkdir(parents=True, exist_ok=True)
    entries = []
    with tempfile.TemporaryDirectory(prefix="ignition-triton-") as cache_dir, \
            triton.knobs.cache.scope(), triton.knobs.compilation.scope(), triton.knobs.runtime.scope():
        triton.knobs.cache.dir = cache_dir
        triton.knobs.compilation.disable_line_info = True
        triton.knobs.compilation.override = False
        triton.knobs.compilation.dump_ir = False
        triton.knobs.runtime.override_arch = None
        for key, spec in sorted(unique.items()):
            for target_name in sorted(targets):
                target = TARGETS[target_name]
                aligned = divisibility(spec)
                attrs = {(spec.kernel.arg_names.index(name),): [["tt.divisibility", value]]
                         for name, value in aligned.items()}
                source = ASTSource(fn=spec.kernel, signature=dict(spec.signature), constexprs=dict(spec.constexprs),
                                   attrs=attrs)
                try:
                    compiled = triton.compile(source, target=GPUTarget(target.backend, target.arch, target.warp_size),
                                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                                       "enable_fp_fusion": ENABLE_FP_FUSION})
                except Exception as exc:
                    raise KernelPreparationError(f"kernel {spec.name} ({key}) failed to compile for {target_name}: "
                                                 f"{exc}") from exc
                entries.append(_write_binary(Path(out_dir), key, spec, target_name, target, compiled))
    return {"triton_version": triton.__version__, "targets": sorted(targets), "kernels": entries}


def _write_binary(out_dir: Path, key: str, spec: LaunchSpec, target_name: str, target: Target, compiled) -> dict:
    aligned = divisibility(spec)
    scratch = {name: int(getattr(compiled.metadata, name, 0) or 0)
               for name in ("global_scratch_size", "profile_scratch_size")}
    if any(scratch.values()):  # the launcher passes null scratch pointers (SCRATCH_POINTERS), never buffers
        raise KernelPreparationError(f"kernel {spec.name} ({key}) needs Triton scratch memory on {target_name} "
                                     f"({scratch}); prepared launches get null scratch pointers")
    shared = int(compiled.metadata.shared)
    if shared > target.max_shared_bytes:
        raise KernelPreparationError(f"kernel {spec.name} ({key}) needs {shared} bytes of shared memory per block "
                                     f"on {target_name}; the target allows {target.max_shared_bytes}")
    binary = compiled.asm["cubin"]
    digest = hashlib.sha256(binary).hexdigest()
    rel = f"{KERNELS_DIR}/{spec.name}.{target_name.replace(':', '_')}.{digest[:16]}.cubin"
    path = out_dir / rel
    if not path.is_file() or path.read_bytes() != binary:
        path.write_bytes(binary)
    return {"key": key, "name": spec.name, "target": target_name, "file": rel, "sha256": digest,
            "triton_hash": compiled.hash, "kernel_name": compiled.metadata.name,
            "signature": [{"name": name, "type": kind} | ({"divisibility": aligned[name]} if name in aligned else {})
                          for name, kind in spec.signature.items()],  # call order
            "constexprs": dict(spec.constexprs), "num_warps": spec.num_warps,
            "num_stages": spec.num_stages, "shared_bytes": shared, "grid": list(spec.grid)}
