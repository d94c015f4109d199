"""Device-to-host readback into preallocated host storage, retired by events.

On CUDA, host storage is pinned; each readback waits for the producing graph's event on a
dedicated copy stream, copies, records the copy's event, and the host decodes only after
that event. A partial-width copy (the chosen pair and the first W pairs of each position)
is one pitched 2-D copy (``cuMemcpy2DAsync``): no device staging, no allocation. On the CPU
the same calls are plain copies.
"""

from __future__ import annotations

import torch


def pitched_rows(view: torch.Tensor) -> tuple[int, int, int]:
    """(rows, row bytes, pitch bytes) of a view whose rows are evenly spaced unit-stride runs."""
    if view.dim() < 2 or view.stride(-1) != 1:
        raise ValueError(f"a pitched copy needs a unit-stride last dimension, got strides {view.stride()}")
    pitch = view.stride(-2)
    for dim in range(view.dim() - 2):  # leading dimensions must fold into one row index
        if view.shape[dim] > 1 and view.stride(dim) != view.stride(dim + 1) * view.shape[dim + 1]:
            raise ValueError(f"rows of a view with shape {list(view.shape)} and strides {view.stride()} "
                             f"are not evenly spaced")
    rows = view.numel() // view.shape[-1] if view.shape[-1] else 0
    return rows, view.shape[-1] * view.element_size(), pitch * view.element_size()


class HostTransfer:
    """Readback for one device: host allocation, copies, and the event that retires them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.produced = torch.cuda.Event()
            self.copied = torch.cuda.Event()

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def begin(self) -> None:
        """Order the copies after everything the current stream has enqueued (the producing graph)."""
        if self.cuda:
            self.produced.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(self.produced)

    def copy(self, host: torch.Tensor, device_view: torch.Tensor) -> None:
        if not self.cuda:
            host.copy_(device_view)
            return
        if host.is_contiguous() and device_view.is_contiguous():
            with torch.cuda.stream(self.stream):
                host.copy_(device_view, non_blocking=True)
            return
        rows, row_bytes, src_pitch = pitched_rows(device_view)
        dst_rows, dst_row_bytes, dst_pitch = pitched_rows(host)
        if (rows, row_bytes) != (dst_rows, dst_row_bytes):
            raise ValueError(f"pitched copy of {list(device_view.shape)} into {list(host.shape)}")
        from ignition.runtime.launcher import _driver, check
        driver = _driver()
        copy = driver.CUDA_MEMCPY2D()
        copy.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice = device_view.data_ptr()
        copy.srcPitch = src_pitch
        copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
        copy.dstHost = host.data_ptr()
        copy.dstPitch = dst_pitch
        copy.WidthInBytes = row_bytes
        copy.Height = rows
        check(driver.cuMemcpy2DAsync(copy, driver.CUstream(self.stream.cuda_stream)))

    def finish(self) -> None:
        """Block until the copies have landed; only then may the host decode."""
        if self.cuda:
            self.copied.record(self.stream)
            self.copied.synchronize()
