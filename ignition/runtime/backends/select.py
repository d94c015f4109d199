"""The one backend choice of a load (``select_backend``), made by ``load_core`` and never asked again."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.runtime.backends import backend_family
from ignition.runtime.backends.aoti import AotiBackend, has_packages
from ignition.runtime.backends.onnx import OnnxBackend
from ignition.runtime.backends.packed_linear import LinearPacks
from ignition.runtime.backends.protocol import Backend
from ignition.runtime.backends.pt2 import Pt2Backend
from ignition.runtime.options import LoadOptions
from ignition.runtime.verified import weights_offsets


def _compiled_allowed(catalog: dict, trusted: bool) -> bool:
    packaged = has_packages(catalog)
    if packaged and not trusted:
        warnings.warn(f"not loading the compiled packages of {', '.join(packaged)}: they hold native code and the "
                      "core is not trusted (pass trust_compiled=True / --trust-compiled, or a trusted key that "
                      "signed it); using the portable .pt2 programs", stacklevel=4)
    return trusted


def select_backend(options: LoadOptions, root: Path, manifest: dict, catalog: dict, trusted: bool,
                   weights: Callable[[], tuple[dict[str, torch.Tensor], object]],
                   packs: LinearPacks | None = None, *, spec: Manifest) -> Backend:
    """The one backend choice: ONNX when ``--runtime onnxruntime``; else AOTInductor when the core has packages,
    they are trusted and wanted and the device is the CPU (packages are built for it); else the ``.pt2`` programs,
    their linears on ``packs`` (``LoadOptions.pack_linears``). ``weights()`` waits for the loaded weights and the
    bytes they view (``_read_weights``); only the ONNX backend needs them to be built."""
    if backend_family(options.runtime) is OnnxBackend:
        tensors, data = weights()
        return OnnxBackend(root, manifest, catalog, tensors, weights_offsets(data), options.device, spec)
    if options.prefer_compiled and _compiled_allowed(catalog, options.trust_compiled or trusted) \
            and has_packages(catalog) and not options.cuda:
        return AotiBackend(root, manifest, catalog, options.rank, options.device, spec=spec)
    return Pt2Backend(root, manifest, catalog, options.rank, options.device, packs, spec=spec,
                      native_kernels=options.native_kernels)


__all__ = ["select_backend"]
