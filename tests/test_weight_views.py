"""The loader's weights reader (runtime/weights.py, runtime/verified.py): every tensor read once, equal to safetensors'
own load, the file's sha256 taken over every byte read; the weights a sink streams read through reused scratch and
handed to it, never returned; a malformed header refused by name, and a changed file named as one."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load, save

from ignition.runtime.verified import CoreLoadError, HashingReader, read_verified_weights
from ignition.runtime.weights import SCRATCH_SLOTS, WeightsFormatError, read_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
            "c": torch.randn(4, generator=g).to(torch.bfloat16), "odd": torch.ones(3, dtype=torch.int8),
            "after_odd": torch.randn(2, 2, generator=g), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
            "flag": torch.tensor([True, False, True]), "big": torch.randn(600, 700, generator=g)}


def _read(data: bytes, sink=None):
    reader = HashingReader(io.BytesIO(data), len(data))
    try:
        tensors, header = read_tensors(reader, len(data), sink)
        return tensors, header, reader.hexdigest()
    finally:
        reader.close()


def test_every_tensor_equals_safetensors_and_the_digest_is_the_files():
    data = save(_tensors(), metadata={"rank": "0"})
    tensors, header, digest = _read(data)
    expected = load(data)
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
        assert tensors[name].is_contiguous(), name
    assert digest == hashlib.sha256(data).hexdigest()
    (length,) = struct.unpack("<Q", data[:8])
    assert header == data[:8 + length]


class _Sink:
    """Streams every 2-D float32 weight; ``pack`` copies the scratch it is given a little later, on another thread,
    so a scratch the reader reused before its pack was done would show up as wrong values."""

    def __init__(self):
        self.packed, self.scratch, self.read_raw = {}, set(), []
        self.threads: list[threading.Thread] = []

    def streams(self, entry) -> bool:
        return len(entry.shape) == 2 and entry.dtype == torch.float32

    def pack(self, entry, tensor) -> Future:
        self.scratch.add(tensor.untyped_storage().data_ptr())
        future = Future()

        def later():
            time.sleep(0.02)
            self.packed[entry.name] = tensor.clone()
            future.set_result(None)

        self.threads.append(threading.Thread(target=later))
        self.threads[-1].start()
        return future

    def read(self, entry, tensor) -> None:
        self.read_raw.append(entry.name)


def test_streamed_weights_go_through_reused_scratch_to_the_sink_and_are_not_returned():
    g = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(16 - i, 16, generator=g) for i in range(7)} | {"norm": torch.randn(16, generator=g)}
    data = save(tensors)
    sink = _Sink()
    read, _, digest = _read(data, sink)
    assert set(read) == {"norm"} and sink.read_raw == ["norm"]
    assert sink.packed.keys() == {f"w{i}" for i in range(7)}
    for name, tensor in sink.packed.items():
        assert torch.equal(tensor, tensors[name]), name
    assert len(sink.scratch) <= SCRATCH_SLOTS  # seven weights, three buffers
    assert digest == hashlib.sha256(data).hexdigest()


def _file(header, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


@pytest.mark.parametrize("data,message", [
    (b"abc", "expected a safetensors file"),
    (struct.pack("<Q", 1 << 40), "runs past"),
    (_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "do not hold them"),
    (_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16), "do not hold them"),
    (_file({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "expected dtype"),
    (_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "do not hold them"),
    (_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16), "inside tensor 'a'"),
    (_file(["not", "an", "object"]), "not a JSON object"),
    (struct.pack("<Q", 3) + b"{x}", "not JSON"),
])
def test_malformed_headers_are_refused_by_name(data, message):
    with pytest.raises(WeightsFormatError, match=message):
        _read(data)


def _core(tmp_path, data: bytes, digest: str | None = None) -> dict:
    (tmp_path / "w.safetensors").write_bytes(data)
    return {"files": {"w.safetensors": digest or hashlib.sha256(data).hexdigest()}}


def test_a_changed_weights_file_is_named_as_one_even_when_its_header_breaks(tmp_path):
    good = save({"w": torch.ones(4)})
    manifest = _core(tmp_path, good)
    tensors, _ = read_verified_weights(tmp_path, "w.safetensors", manifest["files"])
    assert torch.equal(tensors["w"], torch.ones(4))
    (tmp_path / "w.safetensors").write_bytes(good[:-4] + b"\0\0\x80\x7f")  # same size, one value changed
    with pytest.raises(CoreLoadError, match="FILE-HASH"):
        read_verified_weights(tmp_path, "w.safetensors", manifest["files"])
    (tmp_path / "w.safetensors").write_bytes(b"\xff" * len(good))  # the header too
    with pytest.raises(CoreLoadError, match="FILE-HASH"):
        read_verified_weights(tmp_path, "w.safetensors", manifest["files"])
    (tmp_path / "w.safetensors").write_bytes(good[:20])
    with pytest.raises(CoreLoadError, match="FILE-HASH"):
        read_verified_weights(tmp_path, "w.safetensors", manifest["files"])


def test_a_malformed_file_whose_hash_matches_gets_the_format_error(tmp_path):
    data = _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16)
    with pytest.raises(CoreLoadError, match="w.safetensors: tensor 'w'.*do not hold them"):
        read_verified_weights(tmp_path, "w.safetensors", _core(tmp_path, data)["files"])


def test_the_exporters_weights_file_reads_back_whole(tmp_path):
    """exporter/weights_file.py: a safetensors file every reader loads (its padding and alignment included), hashed
    as written."""
    from safetensors import safe_open

    from ignition.exporter.weights_file import save_aligned

    tensors = _tensors()
    digest = save_aligned(tensors, tmp_path / "w.safetensors", metadata={"rank": "0"})
    data = (tmp_path / "w.safetensors").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()  # hashed as written: the export does not read it back
    with safe_open(tmp_path / "w.safetensors", "pt") as file:
        assert file.metadata() == {"rank": "0"}
        assert set(file.keys()) == set(tensors)
    read, _ = read_verified_weights(tmp_path, "w.safetensors", {"w.safetensors": digest})
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(read[name], tensor), name


def test_a_reader_that_drops_the_file_cache_drops_every_byte_it_read_once(tmp_path, monkeypatch):
    import os

    from ignition.runtime import verified

    monkeypatch.setattr(verified, "DROP_CACHE_BYTES", 1 << 16)
    tensors = _tensors() | {"more": torch.randn(300, 300)}
    data = save(tensors)
    manifest = _core(tmp_path, data)
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: (
        dropped.append((offset, length, advice)), real(fd, offset, length, advice))[1])
    read, _ = read_verified_weights(tmp_path, "w.safetensors", manifest["files"], drop_cache=True)
    assert all(torch.equal(read[name], tensor) for name, tensor in tensors.items())
    assert {advice for *_, advice in dropped} == {os.POSIX_FADV_DONTNEED}
    covered = 0
    for offset, length, _ in dropped:  # in order, back to back, to the end
        assert offset == covered and length > 0
        covered += length
    assert covered == len(data) and len(dropped) > 2
    dropped.clear()
    read_verified_weights(tmp_path, "w.safetensors", manifest["files"])
    assert not dropped


def test_the_load_drops_the_weights_file_cache_unless_told_not_to():
    from ignition.runtime.options import LoadOptions

    assert LoadOptions.create("cpu").drop_file_cache is True
    kept = LoadOptions.create("cpu", drop_file_cache=False)
    assert LoadOptions.from_json(kept.to_json()).drop_file_cache is False
