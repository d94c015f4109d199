"""runtime/host_memory.py: a CPU load keeps freed blocks in glibc's heap unless LoadOptions says not to."""

from __future__ import annotations

import platform

import pytest

import ignition.runtime.core as core_module
from ignition.runtime.core import load_core
from ignition.runtime.host_memory import retain_freed_memory
from ignition.runtime.options import LoadOptions


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_both_settings():
    assert retain_freed_memory() is True


@pytest.mark.parametrize("retain", [True, False])
def test_load_retains_host_memory_only_when_asked(toy_core, monkeypatch, retain):
    calls = []
    monkeypatch.setattr(core_module, "retain_freed_memory", lambda: calls.append(1) or True)
    load_core(toy_core, retain_host_memory=retain)
    assert calls == ([1] if retain else [])


def test_the_choice_travels_to_worker_ranks():
    options = LoadOptions.create("cpu", retain_host_memory=False)
    assert LoadOptions.from_json(options.to_json()).retain_host_memory is False
    assert LoadOptions.create("cpu").retain_host_memory is True


HUGE_PAGE_PROBE = """
import os
import ignition, torch
print(os.environ.get(ignition.HUGE_PAGES_VARIABLE))
def huge_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:"))
before = huge_kib()
block = torch.empty(64 << 20, dtype=torch.uint8).zero_()
print(huge_kib() - before)
"""


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word), None where it has none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@pytest.mark.parametrize("preset", [None, "0"])
def test_importing_ignition_asks_torch_for_huge_pages_unless_the_environment_says(preset):
    """``import ignition`` sets THP_MEM_ALLOC_ENABLE=1 before torch's first allocation (import torch first, as most
    programs do), so a 64 MiB tensor lies on huge pages where the kernel allows them; a preset 0 is kept."""
    import os
    import subprocess
    import sys

    from ignition import HUGE_PAGES_VARIABLE

    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_VARIABLE}
    if preset is not None:
        env[HUGE_PAGES_VARIABLE] = preset
    done = subprocess.run([sys.executable, "-c", "import torch\n" + HUGE_PAGE_PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    setting, grown_kib = done.stdout.split()
    assert setting == (preset or "1")
    if preset == "0":
        if _thp_mode() == "madvise":  # ("always" gives huge pages to every process)
            assert int(grown_kib) == 0
    elif _thp_mode() in ("always", "madvise") and platform.system() == "Linux":
        assert int(grown_kib) >= 32 << 10  # most of the 64 MiB on 2 MiB pages (unaligned ends aside)
