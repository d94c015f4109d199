"""Host memory for CPU replay: glibc's malloc keeps the blocks a replay frees, so the next replay reuses them.

NOTE: every CPU replay allocates the same temporaries again: a decode step at batch 8 of a Qwen3-0.6B-shaped core
makes about a dozen vocabulary-wide rows (``[8, 151936]`` float32, 4.6 MiB each: the sampling pipeline's
masks, penalties and temperature) besides the attention windows. glibc serves blocks that large with a fresh
``mmap`` and unmaps them on ``free``, so each replay faults in and zeroes every page of them again: in a
``torch.profiler`` trace of one such step those elementwise ops took 6-15 ms each, against 0.1-2.4 ms in a
loop that reuses its memory. ``retain_freed_memory`` sets glibc's mmap threshold to its maximum
(``RETAINED_BLOCK_BYTES``, 32 MiB), its trim threshold high and its top pad large (``TOP_PAD_BYTES``), so such
blocks come from the heap and stay there for reuse. It is process-wide, which is why
``LoadOptions.retain_host_memory`` says whether a load may do it; on a libc without ``mallopt`` it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
RETAINED_BLOCK_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30  # free memory at the heap's top kept before glibc returns it
TOP_PAD_BYTES = 1 << 30
"""Memory glibc adds to its heap's top whenever it grows or trims it. NOTE: on huge pages
(``ignition.HUGE_PAGES_VARIABLE``) torch aligns each block of 2 MiB or more to 2 MiB, and a replay's temporaries
then grew and trimmed the heap's top every request: an engine that only prefilled 8 x 512 tokens of the
Qwen3-0.6B-shaped core, three times after one load (an ad-hoc script), faulted in 61-64 thousand pages a request
after the first (199-204 tok/s); with this pad, none (278-281 tok/s, against 256-261 on 4 KiB pages)."""


@functools.cache
def _libc_function(name: str, argtypes: tuple, restype):
    """The C library's ``name`` with its signature set, or None where this libc has none (looked up once)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


@functools.cache
def retain_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks up to ``RETAINED_BLOCK_BYTES`` from the heap, to keep freed memory and to
    grow and trim its heap ``TOP_PAD_BYTES`` at a time; True when it took all three settings (once a process)."""
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:  # not glibc
        return False
    return all([bool(mallopt(M_MMAP_THRESHOLD, RETAINED_BLOCK_BYTES)),
                bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)), bool(mallopt(M_TOP_PAD, TOP_PAD_BYTES))])


MADV_DONTNEED = 4  # Linux's mman.h
PAGE_BYTES = mmap.PAGESIZE


def release_pages(tensor: torch.Tensor) -> int:
    """Return to the OS the whole pages inside a host tensor's bytes (Linux ``madvise(MADV_DONTNEED)``: they read
    as zeros afterwards), for a tensor that is a view of a larger buffer nothing will read there again (a weight
    replaced by its packed copy, ``backends/packed_linear.py``). Pages it shares with its neighbours are kept.
    Returns the bytes released (0 where the call is unavailable)."""
    start = tensor.data_ptr()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    end = (start + tensor.numel() * tensor.element_size()) // PAGE_BYTES * PAGE_BYTES
    madvise = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if end <= first or madvise is None:
        return 0
    return end - first if madvise(first, end - first, MADV_DONTNEED) == 0 else 0
