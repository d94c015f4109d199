"""The core's weights, read once from its safetensors file: each tensor straight into memory of its own, or, for a
weight the load's first graph reads only in its packed form (``backends/packed_linear.py``), through a small scratch
buffer that its pack reads and the next such weight reuses.

NOTE: what a load costs on this project's VM is mostly the fresh memory it touches: memory the guest handed back to
the host faults in at 2-10 s a GiB (``torch.empty(256 MiB).zero_()`` in a loop, right after an export), against
0.25 s for memory it still holds. The Qwen3-0.6B-shaped FP32 core's load read the whole 2.4 GB file into one buffer
and then packed its projections into 2.2 GB of new memory, 4.6 GB in all; its read, hash and pack took 10-16 s
right after an export. Through the scratch the projections' raw bytes never get memory of their own, and the load
touches what it keeps (the packs, the tied embedding and the norms, 2.9 GB): the same read, hash and pack took
4.9-6.4 s there (a prototype script, each run right after an export, alternated; ``benchmarks/realsize.py`` measures
the whole load).
"""

from __future__ import annotations

import json
import math
import struct
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""safetensors dtype names -> torch dtypes (the ones a core's weights can hold)."""
SCRATCH_SLOTS = 3
"""Scratch buffers a streamed read cycles through: one being read and hashed while two packs read the others."""
ZEROED_FIRST_BYTES = 1 << 20
"""A tensor this large has its pages faulted in by torch's threads (``zero_``) before the one reading thread fills
it: on this project's VM one thread faulted fresh pages at 0.2-1 GB/s, two at 1.1-1.3 GB/s."""
GAP_CHUNK = 1 << 20
"""Bytes outside every tensor (padding, a trailer) are read and hashed in pieces this large."""


class WeightsFormatError(ValueError):
    """The weights file is not a safetensors file this loader can read; the message says where."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the file: its name, dtype, shape and byte range, the range counted from the file's start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Reader(Protocol):
    """The file, read front to back (``verified.HashingReader``, which hashes every byte it reads)."""

    def read_into(self, view: memoryview) -> Future:
        """Fill ``view`` with the next bytes; the future is done once nothing reads ``view`` any more."""


class StreamSink(Protocol):
    """Where the weights that run packed go as they are read (``packed_linear.LinearPacks``)."""

    def streams(self, entry: TensorEntry) -> bool:
        """Whether ``entry`` is read into scratch and handed to ``pack`` (nothing of it returned)."""

    def pack(self, entry: TensorEntry, tensor: torch.Tensor) -> Future:
        """Start packing ``tensor``, scratch that is reused once the future is done."""

    def read(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        """``entry`` was read into ``tensor``, memory of its own that the reader returns."""


def header_length(prefix: bytes, size: int) -> int:
    """The header's byte count, from the file's first 8 bytes (``size``: the whole file's)."""
    if size < 8:
        raise WeightsFormatError(f"expected a safetensors file, found {size} bytes")
    (length,) = struct.unpack_from("<Q", prefix, 0)
    if 8 + length > size:
        raise WeightsFormatError(f"header of {length} bytes runs past the file's {size} bytes")
    return length


def tensor_entries(header_bytes: bytes, size: int) -> list[TensorEntry]:
    """Every tensor the header declares, checked to lie inside the file and apart from each other, in file order."""
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError) as exc:
        raise WeightsFormatError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WeightsFormatError("header is not a JSON object")
    start = 8 + len(header_bytes)
    entries = sorted((_entry(name, value, start, size) for name, value in header.items() if name != "__metadata__"),
                     key=lambda e: (e.begin, e.end))
    for before, after in zip(entries, entries[1:]):
        if after.begin < before.end:
            raise WeightsFormatError(f"tensor {after.name!r} starts at byte {after.begin}, inside tensor "
                                     f"{before.name!r} (bytes {before.begin} to {before.end}); expected tensors apart")
    return entries


def _entry(name: str, entry, start: int, size: int) -> TensorEntry:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(extent) for extent in entry["shape"])
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise WeightsFormatError(f"tensor {name!r}: expected dtype (one of {', '.join(DTYPES)}), shape and "
                                 f"data_offsets, found {str(entry)[:120]}") from None
    needed = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or begin < 0 or end - begin != needed or start + end > size:
        raise WeightsFormatError(f"tensor {name!r}: {list(shape)} {entry['dtype']} needs {needed} bytes; its "
                                 f"data_offsets [{begin}, {end}] do not hold them inside the file")
    return TensorEntry(name, dtype, shape, start + begin, start + end)


def read_tensors(reader: Reader, size: int, sink: StreamSink | None = None) -> tuple[dict[str, torch.Tensor], bytes]:
    """(every tensor that ``sink`` does not stream, in memory of its own; the file's first bytes up to the tensors:
    the length and the header) from a file of ``size`` bytes, read front to back once. A tensor that ``sink.streams``
    is read into scratch and handed to ``sink.pack``, and nothing of it is returned; every other one is read into its
    own memory and shown to ``sink.read``. The caller compares the file's hash before it uses anything read here."""
    prefix = bytearray(8)
    if size >= 8:
        reader.read_into(memoryview(prefix))
    length = header_length(prefix, size)
    header_bytes = bytearray(length)
    reader.read_into(memoryview(header_bytes))
    entries = tensor_entries(bytes(header_bytes), size)
    tensors: dict[str, torch.Tensor] = {}
    scratch = _Scratch(SCRATCH_SLOTS)
    offset = 8 + length
    try:
        for entry in entries:
            _skip(reader, entry.begin - offset)
            offset = entry.end
            if sink is not None and sink.streams(entry):
                buffer, slot = scratch.take(entry.nbytes)
                hashed = reader.read_into(_bytes_of(buffer))
                scratch.hold(slot, hashed, sink.pack(entry, buffer.view(entry.dtype).view(entry.shape)))
                continue
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            if entry.nbytes >= ZEROED_FIRST_BYTES:
                tensor.view(-1).view(torch.uint8).zero_()
            if entry.nbytes:
                reader.read_into(_bytes_of(tensor))
            tensors[entry.name] = tensor
            if sink is not None:
                sink.read(entry, tensor)
        _skip(reader, size - offset)
    finally:
        scratch.drain()
    return tensors, bytes(prefix + header_bytes)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _skip(reader: Reader, count: int) -> None:
    """Read (and so hash) ``count`` bytes that belong to no tensor, each piece fresh memory the hash holds until it
    is done (one piece waits for the one before, so a long stretch holds two at most)."""
    previous = None
    while count > 0:
        piece = bytearray(min(count, GAP_CHUNK))
        hashed = reader.read_into(memoryview(piece))
        if previous is not None:
            previous.result()
        previous, count = hashed, count - len(piece)


class _Scratch:
    """Byte buffers reused in turn; a buffer is taken again only once what read it last (hash, pack) is done."""

    def __init__(self, slots: int):
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.readers: list[tuple[Future, ...]] = [()] * slots
        self.next = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        slot = self.next
        self.next = (slot + 1) % len(self.buffers)
        for future in self.readers[slot]:
            future.result()
        self.readers[slot] = ()
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes], slot

    def hold(self, slot: int, *futures: Future) -> None:
        self.readers[slot] = futures

    def drain(self) -> None:
        """Wait for every pending reader (errors included: the caller's future says them)."""
        for futures in self.readers:
            for future in futures:
                future.exception()
