"""Weights as views of the one buffer the loader read and hashed: no second copy.

``safetensors.torch.load(bytes)`` copies every tensor out of the file's bytes, so a loader that reads
and hashes the file first holds the weights twice at its peak. Here each tensor is a view of the
verified buffer instead (``torch.frombuffer`` at the tensor's offset): the buffer read once is the
storage the graphs run on, and its hash is the hash of what runs. A tensor whose offset is not a
multiple of its element size (the format does not promise alignment) is copied out alone.
"""

from __future__ import annotations

import json
import struct

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""safetensors dtype names -> torch dtypes (the ones a core's weights can hold)."""


class WeightsFormatError(ValueError):
    """The weights buffer is not a safetensors file this loader can view; the message says where."""


def view_tensors(data: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file in ``data``, as a view of ``data`` (which must stay alive and unchanged)."""
    if len(data) < 8:
        raise WeightsFormatError(f"expected a safetensors file, found {len(data)} bytes")
    (header_length,) = struct.unpack_from("<Q", data, 0)
    start = 8 + header_length
    if start > len(data):
        raise WeightsFormatError(f"header of {header_length} bytes runs past the file's {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8:start]))
    except (ValueError, RecursionError) as exc:
        raise WeightsFormatError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WeightsFormatError("header is not a JSON object")
    whole = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _view(whole, start, name, entry)
    return tensors


def _view(whole: torch.Tensor, start: int, name: str, entry) -> torch.Tensor:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(extent) for extent in entry["shape"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise WeightsFormatError(f"tensor {name!r}: expected dtype (one of {', '.join(DTYPES)}), shape and "
                                 f"data_offsets, found {str(entry)[:120]}") from None
    count = 1
    for extent in shape:
        count *= extent
    size = count * dtype.itemsize
    if min(shape, default=0) < 0 or begin < 0 or end - begin != size or start + end > whole.numel():
        raise WeightsFormatError(f"tensor {name!r}: {shape} {entry['dtype']} needs {size} bytes; its data_offsets "
                                 f"[{begin}, {end}] do not hold them inside the file")
    raw = whole[start + begin:start + end]
    if (start + begin) % dtype.itemsize:  # a misaligned view would hand kernels unaligned pointers
        raw = raw.clone()
    return raw.view(dtype).view(shape)
