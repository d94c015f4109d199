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
