"""The core's weights file: safetensors, with every tensor's data at a 64-byte aligned offset where it can be.

``safetensors.torch.save_file`` places the data section 8-byte aligned and orders tensors by dtype and
name, so most tensors start at an offset that is a multiple of 8 but not of 64. The loader's tensors
are views of the file's bytes (``runtime/weights.py``), so they would be the only weights the GEMMs
read misaligned: torch's own allocations, and a ``from_pretrained`` model's, are 64-byte aligned.
Here the header is padded with spaces (the format allows it) so the data section starts at a multiple
of ``ALIGNMENT``, and the tensors whose size is a multiple of ``ALIGNMENT`` come first, by name, so each
of them starts aligned; the others follow, widest element first, then by name, so each still starts at
a multiple of its element size (the format allows no gaps between tensors, and a misaligned tensor
would be copied out of the buffer instead of viewed). The file is an ordinary safetensors file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from ignition.recipes.checkpoint import SAFETENSORS_DTYPES

ALIGNMENT = 64
"""Bytes: a cache line and AVX-512 vector; the CPU allocator's own alignment."""

_TAGS = {dtype: tag for tag, dtype in SAFETENSORS_DTYPES.items()}


def save_aligned(tensors: dict[str, torch.Tensor], path: Path | str, metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (CPU) as a safetensors file whose tensors start ``ALIGNMENT``-aligned where their sizes allow;
    returns the file's sha256 (hex), taken from the bytes as they are written."""
    order = sorted(tensors, key=lambda name: (_nbytes(tensors[name]) % ALIGNMENT != 0,
                                              -tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _TAGS:
            raise ValueError(f"weight {name!r}: dtype {tensor.dtype} has no safetensors tag; expected one of "
                             f"{', '.join(str(d) for d in _TAGS)}")
        size = _nbytes(tensor)
        header[name] = {"dtype": _TAGS[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    digest = hashlib.sha256()
    with open(path, "wb") as file:
        for chunk in (struct.pack("<Q", len(text)), text):
            file.write(chunk)
            digest.update(chunk)
        for name in order:
            tensor = tensors[name].detach().contiguous()
            if tensor.numel():
                data = tensor.view(-1).view(torch.uint8).numpy().data
                file.write(data)
                digest.update(data)
    return digest.hexdigest()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
