"""Host traffic of one device: input uploads through pinned staging, frame readback retired by events.

Uploads. Each submission fills a variant's inputs on the host (``bindings.fill_inputs``). On CUDA it fills
pinned host mirrors of them, and ``InputStaging.upload`` enqueues non-blocking copies on the current stream,
ahead of the graph that reads them: no synchronous pageable copy, no host wait. When the variant's inputs are
views of one arena (``arrange_inputs``, done before CUDA-graph capture), the upload is one copy per submission.
A mirror is written again only after its previous upload has landed (an event). On the CPU the inputs are filled
in place and nothing is copied.

Readback. On CUDA, host storage is pinned; each readback waits for the producing graph's event on a dedicated
copy stream, copies, records the copy's event, and the host decodes only after that event. A partial-width copy
(the chosen pair and the first W pairs of each position) is one pitched 2-D copy (``cuMemcpy2DAsync``): no
device staging, no allocation. On the CPU the same calls are plain copies.
"""

from __future__ import annotations

import torch

from ignition.catalog.enums import Role
from ignition.runtime.cuda_driver import is_cuda, pitched_copy_to_host, primary_context

ARENA_ALIGNMENT = 256  # bytes: every input of an arena starts where a fresh CUDA allocation would (and kernels
#                        compiled with tt.divisibility=16 take any of them)


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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGNMENT) * ARENA_ALIGNMENT


def input_names(variant) -> list[str]:
    return [a.name for a in variant.arguments if a.role is Role.INPUT]


def arrange_inputs(variant) -> None:
    """Move ``variant``'s input buffers into one device arena (their contents kept), each input at an
    ``ARENA_ALIGNMENT`` boundary, so a submission uploads them with one copy. Only before anything has taken
    their addresses (a CUDA-graph capture bakes them in)."""
    names = [name for name in input_names(variant) if variant.buffers[name].numel()]
    if len(names) < 2 or _arena(variant.buffers, names) is not None:
        return
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += _aligned(variant.buffers[name].numel() * variant.buffers[name].element_size())
    first = variant.buffers[names[0]]
    arena = torch.zeros(total, dtype=torch.uint8, device=first.device)
    for name in names:
        old = variant.buffers[name]
        size = old.numel() * old.element_size()
        new = arena[offsets[name]:offsets[name] + size].view(old.dtype).view(old.shape)
        new.copy_(old)
        variant.buffers[name] = new


def _arena(buffers: dict[str, torch.Tensor], names: list[str]) -> tuple[torch.Tensor, int, int] | None:
    """(a byte view of the shared storage, first byte, end byte) when every input is a contiguous view of one
    storage and together they lie in one range no longer than twice their bytes; else None."""
    tensors = [buffers[name] for name in names]
    storage = tensors[0].untyped_storage()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    starts = [t.storage_offset() * t.element_size() for t in tensors]
    start, end = min(starts), max(s + t.numel() * t.element_size() for s, t in zip(starts, tensors))
    if end - start > 2 * sum(_aligned(t.numel() * t.element_size()) for t in tensors):
        return None  # views into something larger: uploading the whole range would cost more than it saves
    whole = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
    return whole, start, end


class InputStaging:
    """Host mirrors of one variant's input buffers and their upload (one copy when they share an arena)."""

    def __init__(self, device_buffers: dict[str, torch.Tensor], names: list[str], transfer: "HostTransfer"):
        self.device_buffers = device_buffers  # kept: its identity keys this staging
        self.transfer = transfer
        self.copies = 0  # uploads issued, for tests and benchmarks
        sized = [name for name in names if device_buffers[name].numel()]  # an empty input needs no upload
        arena = _arena(device_buffers, sized) if len(sized) > 1 else None
        self.mirrors = {name: transfer.host_empty(device_buffers[name].shape, device_buffers[name].dtype)
                        for name in names if name not in sized}
        self.uploads: list[str] = []  # the inputs copied one by one (none when they share an arena)
        self.device_block = self.host_block = None
        if arena is not None:
            whole, start, end = arena
            self.device_block = whole[start:end]
            self.host_block = transfer.host_empty((end - start,), torch.uint8)
            self.host_block.copy_(self.device_block)
            for name in sized:
                device = device_buffers[name]
                offset = device.storage_offset() * device.element_size() - start
                size = device.numel() * device.element_size()
                self.mirrors[name] = self.host_block[offset:offset + size].view(device.dtype).view(device.shape)
        else:
            for name in sized:
                self.mirrors[name] = transfer.host_empty(device_buffers[name].shape, device_buffers[name].dtype)
                self.mirrors[name].copy_(device_buffers[name])
            self.uploads = sized
        self.uploaded = torch.cuda.Event() if transfer.cuda else None
        self.pending = False

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The mirrors to fill, once the previous upload from them has landed."""
        if self.pending:
            self.uploaded.synchronize()
            self.pending = False
        return self.mirrors

    def upload(self) -> None:
        """Enqueue the copies of every mirror to the device on the current stream (non-blocking from pinned memory)."""
        if self.device_block is not None:
            self.device_block.copy_(self.host_block, non_blocking=True)
            self.copies += 1
        for name in self.uploads:
            self.device_buffers[name].copy_(self.mirrors[name], non_blocking=True)
            self.copies += 1
        if self.uploaded is not None:
            self.uploaded.record(torch.cuda.current_stream(self.transfer.device))
            self.pending = True


class _InPlace:
    """A variant whose inputs are filled where they are (the CPU): nothing to upload."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers

    def upload(self) -> None:
        pass


class HostTransfer:
    """Host traffic for one device: host allocation, input staging, readback copies and the events that retire them.

    ``staged`` (default: on CUDA) fills inputs in host mirrors and uploads them; otherwise inputs are filled in
    place."""

    def __init__(self, device: torch.device, staged: bool | None = None):
        self.device = device
        self.cuda = is_cuda(device)
        self.staged = self.cuda if staged is None else staged
        self._staging: dict[int, InputStaging] = {}
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.produced = torch.cuda.Event()
            self.copied = torch.cuda.Event()

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def inputs(self, variant) -> InputStaging | _InPlace:
        """What ``fill_inputs`` fills for ``variant`` (``.buffers``) and then uploads (``.upload()``)."""
        if not self.staged:
            return _InPlace(variant.buffers)
        staging = self._staging.get(id(variant.buffers))
        if staging is None:
            staging = InputStaging(variant.buffers, input_names(variant), self)
            self._staging[id(variant.buffers)] = staging
        return staging

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
        if not host.is_pinned():
            raise ValueError("a pitched readback copies asynchronously, so its host storage must be pinned")
        context = primary_context(self.device)
        previous = context.make_current()  # the engine's thread may have no context current
        try:
            pitched_copy_to_host(host.data_ptr(), dst_pitch, device_view.data_ptr(), src_pitch, row_bytes, rows,
                                 self.stream.cuda_stream)
        finally:
            context.restore(previous)

    def finish(self) -> None:
        """Block until the copies have landed; only then may the host decode."""
        if self.cuda:
            self.copied.record(self.stream)
            self.copied.synchronize()
