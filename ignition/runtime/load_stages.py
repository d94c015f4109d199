"""How ``load_core`` runs its stages: timed and announced (``Stages``), with the interpreter tuned for a load that
reads graphs on one thread while another reads the weights (``short_switch_interval``) and builds millions of
objects it keeps (``collector_paused``)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

Progress = Callable[[str, str], None]  # (stage, item), called as each stage starts

LOAD_SWITCH_INTERVAL = 0.0005
"""Seconds a thread holds the GIL before one that waits for it takes its turn, while the weights are read beside the
graphs (``short_switch_interval``).

NOTE: the graphs are read by Python code that holds the GIL, while the weights' reader, its hash and the packs make
several hundred calls that release it (a read, a torch op, a sha256 update) and each must take it back. At Python's
default 5 ms a turn, a reader that reads and packs weight by weight took 9-10.6 s to read the Qwen3-0.6B-shaped core's
weights beside a thread that only counted, and 2.5-4.8 s alone (an ad-hoc script, three alternated runs each)."""


@contextmanager
def short_switch_interval():
    """The interpreter's thread switch interval at most ``LOAD_SWITCH_INTERVAL`` inside, as it was after."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, LOAD_SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside (as it was after).

    NOTE: a load builds millions of Python objects that it keeps (each graph's program JSON, then its FX nodes), and
    every few hundred thousand of them the collector walks all that are alive: with it running, reading the 28-layer
    Qwen3-0.6B-shaped core's five graphs took 2.6-3.2 s, without it 1.6-1.9 s, and the whole load 3.5-7.6 s against
    2.8-3.5 s (an ad-hoc script, three alternated loads each). What a load leaves unreachable is collected after it,
    as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Stages:
    """Wall seconds per load stage, and the caller's progress callback as each one starts."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.timings: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def start(self, stage: str, item: str = "", announce: bool = True) -> None:
        """``announce=False``: time a stage already announced (the wait for the weights), calling no one."""
        self.stop()
        if self.progress is not None and announce:
            self.progress(stage, item)
        self._current = (stage, time.perf_counter())

    def stop(self) -> None:
        if self._current is not None:
            stage, started = self._current
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - started
            self._current = None


__all__ = ["LOAD_SWITCH_INTERVAL", "Progress", "Stages", "collector_paused", "short_switch_interval"]
