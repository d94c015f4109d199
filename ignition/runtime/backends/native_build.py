"""The CPU replay's native kernels (``blocked_linear.c``, ``paged_attention.c``): each source compiled once per CPU
(``host_cache.cpu_key``: its model and instruction set), compiler, flags and source, into the machine's cache
directory (``host_cache.cache_dir``), and loaded with ctypes. A machine without a C compiler, or where the build
fails, raises ``NativeUnavailable`` with the reason; each kernel's module turns that into the path not being offered.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from ignition.runtime.backends.host_cache import cache_dir, cpu_key

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
"""What every kernel is built with: this CPU's instructions, FMA contraction, and torch's OpenMP threads."""
_build_lock = threading.Lock()


class NativeUnavailable(RuntimeError):
    """This machine cannot build or load a native kernel; the message says why."""


def compiler() -> str:
    """``$CC`` where set, else ``cc`` or ``gcc`` on PATH; NativeUnavailable where there is none."""
    named = os.environ.get("CC")
    found = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise NativeUnavailable(f"no C compiler: {f'$CC={named} is not on PATH' if named else 'no cc or gcc on PATH'}"
                                " (set $CC to one)")
    return found


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL, str]:
    """``source`` compiled with ``flags`` into ``<cache dir>/kernels`` under a name that hashes the source, the flags,
    the compiler's version and the CPU (``cpu_key``), and loaded: the library and that hash's first 16 digits (the
    build's id). Built once; another process building the same name at the same time is harmless (the file is
    replaced atomically)."""
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} --version failed: {exc}") from exc
    digest = hashlib.sha256("\0".join((source.read_text(), *flags, cc, version, cpu_key())).encode()).hexdigest()[:16]
    built = cache_dir() / "kernels" / f"{source.stem}-{digest}.so"
    with _build_lock:
        if not built.exists():
            scratch = built.with_name(f"{built.name}.{os.getpid()}.tmp")
            try:
                built.parent.mkdir(parents=True, exist_ok=True)
                done = subprocess.run([cc, *flags, str(source), "-o", str(scratch)], capture_output=True, text=True)
                if done.returncode == 0:
                    os.replace(scratch, built)  # atomically: another process may be loading the same name
            except OSError as exc:  # a read-only cache directory: the path is not offered, the load goes on
                raise NativeUnavailable(f"building into {built.parent} failed: {exc}") from exc
            if done.returncode != 0:
                scratch.unlink(missing_ok=True)
                raise NativeUnavailable(f"{cc} {' '.join(flags)} {source.name} failed: {done.stderr.strip()[-500:]}")
    try:
        return ctypes.CDLL(str(built)), digest
    except OSError as exc:
        raise NativeUnavailable(f"loading {built} failed: {exc}") from exc


def failure(load) -> str | None:
    """None where ``load()`` (a kernel module's ``library``) builds and loads its kernel; else the reason why not."""
    try:
        load()
    except NativeUnavailable as exc:
        return str(exc)
    return None


__all__ = ["FLAGS", "NativeUnavailable", "build", "compiler", "failure"]
