"""What the CPU backends keep per machine: the CPU model they key it by and the directory it lives in (the GEMM
calibration's timings, ``gemm_calibration``; the blocked product's build, ``blocked_linear``)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``$IGNITION_CACHE_DIR``, else ``$XDG_CACHE_HOME/ignition``, else ``~/.cache/ignition``."""
    root = os.environ.get("IGNITION_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ignition"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


__all__ = ["cache_dir", "cpu_model"]
