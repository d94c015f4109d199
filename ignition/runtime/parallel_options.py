"""What tensor parallelism accepts, shared by ``load_core`` and the rank start-up (``parallel.py``).

Its own module so that core.py and parallel.py need not import each other: parallel.py starts ranks that call
``load_core``, and ``load_core`` refuses a backend that cannot replay rank shards.
"""

from __future__ import annotations


class ParallelError(RuntimeError):
    """A tensor-parallel group cannot start or has lost a rank; the message names the rank and the cause."""


class ParallelOptionError(ParallelError):
    """Options that cannot run tensor parallelism at all (a usage error, refused before anything starts)."""


SUPPORTED_RUNTIME = "torch"


def check_runtime(runtime: str, ranks: int) -> None:
    """The one refusal of tensor parallelism with a backend that cannot replay rank shards."""
    if ranks > 1 and runtime != SUPPORTED_RUNTIME:
        raise ParallelOptionError(f"--runtime {runtime} replays single-rank cores only, so it cannot run "
                                  f"--tensor-parallel {ranks}; tensor parallelism is supported with --runtime "
                                  f"{SUPPORTED_RUNTIME} (gloo on CPU, NCCL on CUDA)")
