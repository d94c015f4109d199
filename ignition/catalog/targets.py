"""Kernel targets a core can carry prepared cubins for: the contract's table of GPU architectures.

The exporter prepares for these names (``export-core --targets``), the validator checks kernel
tables against them, and the runtime launcher matches a device's compute capability to one.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS_DIR = "kernels"


@dataclass(frozen=True, slots=True)
class Target:
    backend: str
    arch: int  # compute capability, major * 10 + minor
    warp_size: int
    max_shared_bytes: int  # per-block limit with opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)


# Per-block opt-in shared memory, CUDA C++ Programming Guide (13.1), "Compute Capabilities":
# 9.0 (Hopper, "Shared Memory" of CC 9.0): a block addresses up to 227 KB = 232448 bytes;
# 12.0 (consumer/workstation Blackwell, section 20.10.3): "up to 99 KB" = 101376 bytes.
TARGETS: dict[str, Target] = {
    "cuda:90": Target("cuda", 90, 32, 232448),
    "cuda:120": Target("cuda", 120, 32, 101376),
}



def parse_targets(text: str) -> list[str]:
    """``"cuda:90,cuda:120"`` -> ``["cuda:90", "cuda:120"]``; unknown or repeated names raise ValueError."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        raise ValueError(f"unknown kernel target(s) {', '.join(map(repr, unknown))}; known targets: "
                         f"{', '.join(TARGETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"kernel targets repeat a name: {text!r}")
    if not names:
        raise ValueError(f"no kernel target named in {text!r}; known targets: {', '.join(TARGETS)}")
    return names
