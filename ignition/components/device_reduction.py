"""Which implementation of ``ignition::reduce_logprobs`` runs on an accelerator.

The CPU runs the pure-torch reference (``logprobs.py``). On CUDA the op launches kernels
prepared ahead of time: the runtime installs, once per device at load, a launcher built from
the core's kernel table (``ignition.runtime.launcher``). Nothing here imports Triton, so a
serving process never compiles. Just-in-time Triton is a developer opt-in
(``IGNITION_TRITON_JIT=1``) for running the op outside a loaded core.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ignition.components.logprobs import check_reduction_args, reduce_logprobs_op

JIT_ENV = "IGNITION_TRITON_JIT"
"""Set to 1 to let the CUDA op JIT-compile Triton when no prepared launcher is installed."""

_launchers: dict[torch.device, Callable] = {}


def install_reduction(device: torch.device, launcher: Callable | None) -> None:
    """Route the op on ``device`` to ``launcher`` (same arguments as the op); None removes it."""
    if launcher is None:
        _launchers.pop(device, None)
    else:
        _launchers[device] = launcher


def installed_reduction(device: torch.device) -> Callable | None:
    return _launchers.get(device)


def jit_opted_in() -> bool:
    return os.environ.get(JIT_ENV) == "1"


def _reduce_on_device(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    launcher = _launchers.get(logits.device)
    if launcher is None:
        if not jit_opted_in():
            raise RuntimeError(
                f"ignition::reduce_logprobs on {logits.device}: no prepared kernels are loaded for this device. "
                f"Load the core with load_core(path, device='{logits.device}') so its prepared cubins launch, "
                f"or set {JIT_ENV}=1 to JIT-compile Triton (development only: serving never compiles)")
        from ignition.components.triton_logprobs import reduce_logprobs_triton
        launcher = reduce_logprobs_triton
    check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)
    launcher(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)


reduce_logprobs_op.register_kernel("cuda")(_reduce_on_device)
