"""What the CPU backends keep per machine: the CPU they key it by and the directory it lives in (the GEMM
calibration's timings, ``gemm_calibration``; the blocked product's build, ``blocked_linear``)."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``$IGNITION_CACHE_DIR``, else ``$XDG_CACHE_HOME/ignition``, else ``~/.cache/ignition``."""
    root = os.environ.get("IGNITION_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ignition"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _first(cpuinfo: str, field: str) -> str | None:
    """The first processor's ``field`` in ``cpuinfo`` text, or None."""
    for line in cpuinfo.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == field:
            return value.strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows: what tables print beside a
    measurement."""
    found = _first(_cpuinfo() if cpuinfo is None else cpuinfo, "model name")
    return found or platform.processor() or platform.machine() or "unknown CPU"


def cpu_key(cpuinfo: str | None = None) -> str:
    """What the per-machine cache is keyed by: the model name, its family, model and stepping, and a digest of its
    instruction-set flags. A virtual machine's model name alone says little ("AMD EPYC" names an AVX2 Zen 2 and an
    AVX-512 Zen 4 alike), and a product built with ``-march=native`` for one of them stops the other with an illegal
    instruction."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    numbers = "/".join(_first(text, field) or "?" for field in ("cpu family", "model", "stepping"))
    flags = " ".join(sorted((_first(text, "flags") or _first(text, "Features") or "").split()))
    return f"{cpu_model(text)} ({numbers}; flags {hashlib.sha256(flags.encode()).hexdigest()[:12]})"


__all__ = ["cache_dir", "cpu_key", "cpu_model"]
