"""The loader's weights are views of the one verified buffer (runtime/weights.py), equal to safetensors' own load."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from ignition.runtime.weights import WeightsFormatError, view_tensors


def test_views_equal_safetensors_and_share_the_buffer():
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).to(torch.bfloat16),
               "odd": torch.ones(3, dtype=torch.int8), "after_odd": torch.randn(2, 2), "scalar": torch.tensor(2.5)}
    data = bytearray(save(tensors))
    views = view_tensors(data)
    expected = load(bytes(data))
    assert views.keys() == expected.keys()
    for name, tensor in expected.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor), name
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    shared = [name for name, t in views.items() if base <= t.data_ptr() < base + len(data)]
    assert "a" in shared and "b" in shared  # aligned tensors are views, not copies


def _file(header: dict, payload: bytes = b"") -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + payload)


@pytest.mark.parametrize("data,message", [
    (bytearray(b"abc"), "expected a safetensors file"),
    (bytearray(struct.pack("<Q", 1 << 40)), "runs past"),
    (_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "do not hold them"),
    (_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16), "do not hold them"),
    (_file({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "expected dtype"),
    (_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "do not hold them"),
    (_file(["not", "an", "object"]), "not a JSON object"),
])
def test_malformed_headers_are_refused_by_name(data, message):
    with pytest.raises(WeightsFormatError, match=message):
        view_tensors(data)


def test_the_exporter_writes_weights_the_loader_views_64_byte_aligned(tmp_path):
    """exporter/weights_file.py: a safetensors file every reader loads, whose tensors of a multiple of 64 bytes
    start at 64-byte aligned offsets; read aligned (read_verified), their views are aligned tensors."""
    from safetensors import safe_open

    from ignition.exporter.weights_file import ALIGNMENT, save_aligned
    from ignition.runtime.verified import read_verified

    g = torch.Generator().manual_seed(0)
    tensors = {"z.big": torch.randn(48, 64, generator=g), "a.odd": torch.ones(3, dtype=torch.int8),
               "m.bf16": torch.randn(32, generator=g).to(torch.bfloat16), "b.norm": torch.randn(16, generator=g),
               "c.ids": torch.arange(5, dtype=torch.int64), "y.empty": torch.zeros(0, 4),
               "d.bf16_odd": torch.randn(3, generator=g).to(torch.bfloat16), "e.f32_odd": torch.randn(5, generator=g),
               "f.flag": torch.tensor([True, False, True])}
    digest = save_aligned(tensors, tmp_path / "w.safetensors", metadata={"rank": "0"})
    assert digest == _sha256(tmp_path / "w.safetensors")  # hashed as written: the export does not read it back
    with safe_open(tmp_path / "w.safetensors", "pt") as file:
        assert file.metadata() == {"rank": "0"}
        assert set(file.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(file.get_tensor(name), tensor), name
    data = read_verified(tmp_path, "w.safetensors", {"files": {"w.safetensors": _sha256(tmp_path / "w.safetensors")}},
                         aligned=True)
    views = view_tensors(data)
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor), name
        if tensor.numel():  # every tensor a view of the buffer (none copied for misalignment), aligned to its size
            assert base <= views[name].data_ptr() < base + len(data), name
            assert views[name].data_ptr() % tensor.element_size() == 0, name
        if tensor.numel() * tensor.element_size() % ALIGNMENT == 0 and tensor.numel():
            assert views[name].data_ptr() % ALIGNMENT == 0, name
    # The same tensors through safetensors' own writer: most start 8-byte but not 64-byte aligned.
    data = bytearray(save(tensors))
    assert any(t.data_ptr() % ALIGNMENT for t in view_tensors(memoryview(torch.frombuffer(data, dtype=torch.uint8)
                                                                           .clone().numpy())).values())


def _sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
