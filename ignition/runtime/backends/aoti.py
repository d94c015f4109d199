"""The ``aoti`` backend: a variant's AOTInductor package where the core has one (CPU, trusted cores only),
its ``.pt2`` program otherwise. A package is hashed as it is read and loaded from a private copy of those
bytes (``private_copy``); one built for another machine falls back to the portable program with a warning."""

from __future__ import annotations

import warnings

from ignition.catalog.model import BufferDecl
from ignition.runtime.backends.protocol import Runner
from ignition.runtime.backends.pt2 import Pt2Backend
from ignition.runtime.verified import private_copy, read_verified


def has_packages(catalog: dict) -> list[str]:
    """The variants that carry an AOTInductor package."""
    return [v["name"] for v in catalog["variants"] if v.get("packages", {}).get("inductor")]


def load_package(path):
    """Load a compiled package; returns a callable taking the same (buffers_dict,) as the program.

    This dlopens native code from the package: only for trusted cores (``select_backend`` decides; the
    validator never calls it)."""
    import ignition.components.logprobs  # noqa: F401  (registers ignition::reduce_logprobs for the proxy executor)
    from torch._inductor import aoti_load_package
    return aoti_load_package(str(path))


class AotiBackend(Pt2Backend):
    name = "aoti"
    capturable = False  # packages are loaded on the CPU only
    needs_reduction = True
    supports_ranks = True
    packs_linears = False  # a package runs its own kernels
    aten_softmax = False  # inductor generates its own softmax loops
    windowed = True

    def runner(self, entry: dict, arguments: list[BufferDecl], buffers) -> Runner:
        package = entry.get("packages", {}).get("inductor")
        program = self.program(entry)  # checked and kept even when the package runs: the fallback, and validation
        if package is not None:
            data = read_verified(self.root, package, self.spec.files)
            try:
                with private_copy(data, package) as copy:
                    return load_package(copy)
            except Exception as exc:  # a package built for another machine: the portable program still runs
                warnings.warn(f"variant {entry['name']}: cannot load {package} ({type(exc).__name__}: {exc}); "
                              f"using {self.graphs[entry['name']]}", stacklevel=4)
        return program.module()
