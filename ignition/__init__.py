"""Ignition: export LLM checkpoints to validated cores with exact in-graph logprobs.

Importing ``ignition`` registers the ``ignition::*`` ops, which loading a core's ``.pt2``
graphs requires. It also asks torch's CPU allocator for transparent huge pages
(``HUGE_PAGES_VARIABLE``), unless the environment already says either way.
"""

import os as _os

HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"
"""torch's CPU allocator puts each block of 2 MiB or more on transparent huge pages when this is ``1``; it reads the
variable once, at the process's first CPU allocation, so it is set here, before anything of Ignition's allocates
(``import torch`` alone does not). A process that set it (``0`` to keep 4 KiB pages) keeps its choice, and one that
allocated CPU tensors before importing Ignition keeps what torch read then; child processes (worker ranks) inherit it.

NOTE: a load's cost on this project's VM is mostly first touches of fresh memory; on huge pages the kernel takes 512
times fewer faults for the same bytes (``benchmarks/startup.py --load-only --compare huge-pages``), and decode steps
did not change (``benchmarks/decode_steps.py --compare huge-pages``). A replay's multi-MiB temporaries need glibc's
heap padded (``runtime/host_memory.TOP_PAD_BYTES``), or each request faults them in again; ``docs/benchmarks.md``."""
_os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")

from ignition import components as _components  # noqa: E402,F401  (registers ignition::reduce_logprobs)

__version__ = "0.1.0"
