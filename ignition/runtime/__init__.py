"""The minimal loader's public Python API: load a core, run requests through an engine.

    from ignition.runtime import Engine, LoadOptions, Request, load_core

    engine = Engine(load_core("core/", LoadOptions.create(device="cpu")))
    (result,) = engine.generate([Request([1, 2, 3], max_tokens=8)])

The names resolve on first use, so importing a runtime module (``ignition.runtime.options`` for the CLI) does not
load torch and the graph machinery with it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_core": "ignition.runtime.core",
    "LoadOptions": "ignition.runtime.options",
    "Engine": "ignition.runtime.engine",
    "Request": "ignition.runtime.requests",
    "SamplingParams": "ignition.runtime.requests",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ignition.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
