"""Verified bytes: every core file the loader uses is read once, hashed against the manifest, checked and
used from those bytes (``read_verified``); what validate-core checked on its own read of a file is checked
again on the bytes that are used (weights declarations, vocabulary rows, tokenizer ids)."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from ignition.validate.files import safe_path
from ignition.validate.report import Violation


READ_CHUNK = 64 << 20
"""Bytes read between two hash updates of a large core file (``_read_hashing``)."""


class CoreLoadError(Exception):
    """The core is invalid or cannot be loaded; the message lists every finding."""


class LoadOptionError(CoreLoadError):
    """The caller's load options cannot work here (an unknown runtime, a device this machine lacks): a usage
    error, whatever the core holds."""


def read_verified(root: Path, rel: str, manifest: dict, aligned: bool = False) -> bytearray | memoryview:
    """The bytes of the core file ``rel``, read once, after their sha256 matched the manifest's record:
    what the caller loads from them is what was verified (no second read a swapped file could answer).
    Writable memory, so tensors can be views of it (``runtime/weights.py``) instead of a second copy.
    ``aligned``: a memoryview whose first byte is 64-byte aligned (torch's CPU allocator), so a tensor the
    exporter placed at an aligned offset (``exporter/weights_file.py``) is an aligned tensor."""
    path, problems = safe_path(root, rel, f"manifest.json:files/{rel}")
    if path is None:  # validate_core already refused such a path; kept for a core changed since
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in problems))
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            # the aligned buffer's pages are faulted in by torch's threads first (``zero_``): the read's one thread
            # faulted them at 0.2-1 GB/s on this project's VM, two threads at 1.1-1.3 GB/s, and then the read of a
            # cached 2.4 GB file takes 0.5 s (fresh loads of the Qwen3-0.6B-shaped FP32 core: 6.2 s against 6.8 s,
            # the means of four alternated runs)
            data = memoryview(torch.empty(size, dtype=torch.uint8).zero_().numpy()) if aligned else bytearray(size)
            found = _read_hashing(file, memoryview(data))
            if found is None or file.read(1):
                raise OSError(f"{rel} changed size while it was read")
    except OSError as exc:
        raise CoreLoadError(f"{root}: cannot read {rel}: {exc.strerror or exc}") from None
    expected = manifest["files"].get(rel)
    if found != expected:
        raise CoreLoadError(f"{root} is not a valid core:\n  "
                            f"{Violation('FILE-HASH', rel, f'expected sha256 {expected}, found {found}')}")
    return data


def _read_hashing(file, data: memoryview, chunk: int = READ_CHUNK) -> str | None:
    """Fill ``data`` from ``file`` and return its sha256 (None when the file ends early). Chunk by chunk, each
    chunk hashed on a worker thread while the next is read (both release the GIL), in order."""
    digest = hashlib.sha256()
    if len(data) <= chunk:
        if file.readinto(data) != len(data):
            return None
        digest.update(data)
        return digest.hexdigest()
    with ThreadPoolExecutor(1, thread_name_prefix="ignition-hash") as pool:
        pending, offset = None, 0
        while offset < len(data):
            count = file.readinto(data[offset:offset + chunk])
            if pending is not None:
                pending.result()
            if not count:
                return None
            pending = pool.submit(digest.update, data[offset:offset + count])
            offset += count
        pending.result()
    return digest.hexdigest()


def tokenizer_file(manifest: dict) -> str | None:
    return f"{manifest['tokenizer'].rstrip('/')}/tokenizer.json" if manifest.get("tokenizer") else None


def load_tokenizer(root: Path, manifest: dict):
    """The core's tokenizer, built from the bytes of tokenizer.json read once and hashed (``read_verified``)."""
    rel = tokenizer_file(manifest)
    if rel is None or rel not in manifest["files"]:
        return None
    from tokenizers import Tokenizer
    data = read_verified(root, rel, manifest)
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # UnicodeDecodeError; tokenizers raises a bare Exception for a malformed file
        raise CoreLoadError(f"{root}: {rel} does not load as a tokenizer: {str(exc)[:200]}") from None
    reach, size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1), manifest["vocab_size"]
    if reach >= size:  # GEOM-TOKENIZER again, on the bytes that are used
        found = Violation("GEOM-TOKENIZER", rel, f"token ids must stay below manifest.json:vocab_size = {size}; "
                                                 f"the tokenizer's reach {reach}")
        raise CoreLoadError(f"{root} is not a valid core:\n  {found}")
    return tokenizer


def check_loaded_weights(root: Path, manifest: dict, catalog: dict, weights: dict[str, torch.Tensor],
                          weights_file: str) -> None:
    """WEIGHT-DECL, GEOM-VOCAB-TENSOR and the attention rows (GEOM-MODEL) again, on the tensors loaded from the verified bytes (validate-core
    read the file's header from another read)."""
    from ignition.validate.geometry import check_attention_weights, check_vocab_weights
    from ignition.validate.parallel import rank_view

    header = {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights.items()}
    found = [Violation("WEIGHT-DECL", f"variant {variant['name']}: weight {decl['name']}",
                       f"expected {decl['dtype']} {decl['shape']} in {weights_file}, found {header.get(decl['name'])}")
             for variant in catalog["variants"] for decl in variant["arguments"]
             if decl["role"] == "weight" and header.get(decl["name"]) != (decl["dtype"], decl["shape"])]
    found += check_vocab_weights(rank_view(manifest, "weights"), header, weights_file)
    found += check_attention_weights(manifest, header, weights_file)
    if found:
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in found[:5]))


def weights_offsets(data: bytes) -> dict[str, tuple[int, int]]:
    """Each tensor's (offset, length) in the verified weights bytes: what ONNX-WEIGHTS compares against."""
    from ignition.catalog.onnx_layout import offsets_of_header

    (header_bytes,) = struct.unpack("<Q", data[:8])
    return offsets_of_header(bytes(data[8:8 + header_bytes]))


@contextmanager
def private_copy(data: bytes, name: str):
    """``data`` in a file only this process created and only this user can reach: a fresh ``mkdtemp``
    directory (mode 0700) and a file opened with O_CREAT|O_EXCL|O_NOFOLLOW (0600). A loader that needs a
    path loads the bytes it verified from there, never the core's file a writer could swap meanwhile;
    the copy is removed on exit."""
    directory = tempfile.mkdtemp(prefix="ignition-load-")
    try:
        path = os.path.join(directory, os.path.basename(name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        yield Path(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
