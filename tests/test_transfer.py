"""Host traffic on the CPU (runtime/transfer.py): staged input uploads and the pitched readback's driver call.

Staging is what CUDA uses (pinned mirrors, non-blocking uploads); forced on for a CPU core here, it must give the
same results as filling inputs in place, write the device inputs only through its uploads, and upload a variant's
inputs with one copy per submission once they share an arena. The pitched readback builds cuda-python's real
``CUDA_MEMCPY2D`` struct; a stand-in ``cuMemcpy2DAsync`` performs the copy the struct describes, byte for byte.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ignition.catalog.enums import Role
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from ignition.runtime.transfer import ARENA_ALIGNMENT, HostTransfer, arrange_inputs, input_names, pitched_rows

REQUESTS = [dict(prompt_ids=[1, 2, 3], max_tokens=5, logprobs=5, ignore_eos=True),
            dict(prompt_ids=[7, 8], max_tokens=4, logprob_token_ids=[0, 9, 4], ignore_eos=True),
            dict(prompt_ids=[5], max_tokens=3, ignore_eos=True)]


def _generate(core):
    results = Engine(core).generate([Request(**r) for r in REQUESTS])
    return [(r.error, r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries]) for r in results]


class InputWrites(TorchDispatchMode):
    """Every operator that writes into the storage of a variant's device inputs, by name."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.writes = storages, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor) \
                    and value.untyped_storage().data_ptr() in self.storages:
                self.writes[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def test_staged_inputs_give_the_same_results_with_one_upload_per_submission(toy_core):
    expected = _generate(load_core(toy_core))
    core = load_core(toy_core)
    for variant in core.variants.values():
        arrange_inputs(variant)
        offsets = [variant.buffers[n].data_ptr() - variant.buffers[input_names(variant)[0]].data_ptr()
                   for n in input_names(variant)]
        assert all(offset % ARENA_ALIGNMENT == 0 for offset in offsets), variant.name
        assert len({variant.buffers[n].untyped_storage().data_ptr() for n in input_names(variant)}) == 1
    core.transfer = HostTransfer(torch.device("cpu"), staged=True)
    runs = Counter()
    for variant in core.variants.values():
        run = variant.run
        variant.run = lambda buffers, run=run, name=variant.name: runs.update([name]) or run(buffers)
    storages = {v.buffers[n].untyped_storage().data_ptr() for v in core.variants.values() for n in input_names(v)}
    watch = InputWrites(storages)
    with watch:
        got = _generate(core)
    assert got == expected
    staging = {name: core.transfer.inputs(v) for name, v in core.variants.items() if runs[name]}
    assert staging and all(staging[name].copies == runs[name] for name in staging), (runs, staging)
    assert all(s.device_block is not None and s.uploads == [] for s in staging.values())  # one copy each time
    assert watch.writes == Counter({"copy_": sum(runs.values())})  # the inputs change only by their uploads


def test_staging_without_an_arena_uploads_each_input(toy_core):
    """A variant whose inputs were never arranged (an eager replica, say) still uploads every input it fills."""
    expected = _generate(load_core(toy_core))
    core = load_core(toy_core)
    core.transfer = HostTransfer(torch.device("cpu"), staged=True)
    assert _generate(core) == expected
    for variant in core.variants.values():
        staging = core.transfer.inputs(variant)
        if staging.copies:
            assert staging.device_block is None
            assert set(staging.uploads) == {n for n in input_names(variant) if variant.buffers[n].numel()}


def test_arranging_keeps_every_inputs_contents():
    buffers = {"a": torch.arange(3, dtype=torch.int64), "b": torch.full((2, 5), 7, dtype=torch.int32),
               "w": torch.ones(4)}
    arguments = [SimpleNamespace(name="a", role=Role.INPUT), SimpleNamespace(name="b", role=Role.INPUT),
                 SimpleNamespace(name="w", role=Role.WEIGHT)]
    variant = SimpleNamespace(arguments=arguments, buffers=dict(buffers))
    arrange_inputs(variant)
    assert variant.buffers["w"] is buffers["w"]  # only inputs move
    for name in ("a", "b"):
        assert torch.equal(variant.buffers[name], buffers[name]) and variant.buffers[name].data_ptr() != \
            buffers[name].data_ptr()
    assert variant.buffers["b"].data_ptr() - variant.buffers["a"].data_ptr() == ARENA_ALIGNMENT


class PitchedDriver:
    """cuda-python's driver module with ``cuMemcpy2DAsync`` replaced by a CPU copy of what its struct says."""

    def __init__(self):
        from cuda.bindings import driver
        self.real, self.calls = driver, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def cuMemcpy2DAsync(self, copy, stream):  # noqa: N802 - the driver's name
        assert copy.srcMemoryType == self.real.CUmemorytype.CU_MEMORYTYPE_DEVICE
        assert copy.dstMemoryType == self.real.CUmemorytype.CU_MEMORYTYPE_HOST
        assert (copy.srcXInBytes, copy.srcY, copy.dstXInBytes, copy.dstY) == (0, 0, 0, 0)
        assert copy.WidthInBytes <= min(copy.srcPitch, copy.dstPitch)
        for row in range(copy.Height):
            ctypes.memmove(copy.dstHost + row * copy.dstPitch, int(copy.srcDevice) + row * copy.srcPitch,
                           copy.WidthInBytes)
        self.calls.append(int(stream))
        return (self.real.CUresult.CUDA_SUCCESS,)


@pytest.mark.parametrize("frame,width", [(0, 2), (1, 12), (1, 258)])
def test_pitched_readback_struct_copies_exactly_the_rows(frame, width):
    pytest.importorskip("cuda.bindings")
    from ignition.runtime.cuda_driver import pitched_copy_to_host

    payload = torch.randint(-2**31, 2**31 - 1, (2, 4, 3, 258), dtype=torch.int32)  # [frames, cap, T, 258]
    host = torch.zeros(4, 3, 258, dtype=torch.int32)
    source, target = payload[frame, :, :, :width], host[:, :, :width]
    rows, row_bytes, source_pitch = pitched_rows(source)
    _, _, host_pitch = pitched_rows(target)
    driver = PitchedDriver()
    pitched_copy_to_host(target.data_ptr(), host_pitch, source.data_ptr(), source_pitch, row_bytes, rows, 5, driver)
    assert driver.calls == [5]
    assert torch.equal(host[:, :, :width], payload[frame, :, :, :width]) and not host[:, :, width:].any()


def test_pitched_readback_refuses_rows_wider_than_a_pitch_and_skips_empty_copies():
    from ignition.runtime.cuda_driver import pitched_copy_to_host

    with pytest.raises(ValueError, match="pitches of at least 48 bytes, got device 32 and host 48"):
        pitched_copy_to_host(0x1000, 48, 0x2000, 32, 48, 3, 0, driver=object())
    pitched_copy_to_host(0x1000, 48, 0x2000, 48, 48, 0, 0, driver=object())  # no rows: no driver call at all
