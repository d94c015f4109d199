"""Verified bytes: every core file the loader uses is read once, hashed against the manifest, checked and
used from those bytes (``read_verified``); what validate-core checked on its own read of a file is checked
again on the bytes that are used (weights declarations, vocabulary rows, tokenizer ids)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import struct
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from collections.abc import Mapping
from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.runtime.weights import StreamSink, WeightsFormatError, read_tensors
from ignition.validate.files import OPEN_NO_WAIT, safe_path
from ignition.validate.report import Violation


READ_CHUNK = 64 << 20
"""Bytes read between two hash updates of a large core file (``read_verified``)."""
DROP_CACHE_BYTES = 16 << 20
"""A reader that drops the file's page cache (``HashingReader``) does it this many read bytes at a time."""


class CoreLoadError(Exception):
    """The core is invalid or cannot be loaded; the message lists every finding."""


class CoreRunError(CoreLoadError):
    """A core's graph failed while it ran: an index out of range, or an allocation the machine cannot meet. The
    core is at fault, not Ignition; the message names the variant."""


class LoadOptionError(CoreLoadError):
    """The caller's load options cannot work here (an unknown runtime, a device this machine lacks): a usage
    error, whatever the core holds."""


def read_verified(root: Path, rel: str, files: Mapping[str, str]) -> bytearray:
    """The bytes of the core file ``rel``, read once, after their sha256 matched the manifest's record:
    what the caller loads from them is what was verified (no second read a swapped file could answer)."""
    with _opened(root, rel) as (file, size):
        data = bytearray(size)
        reader = HashingReader(file, size)
        try:
            for offset in range(0, size, READ_CHUNK):
                reader.read_into(memoryview(data)[offset:offset + READ_CHUNK])
            found = reader.hexdigest()
        finally:
            reader.close()
    _compare(root, rel, files, found)
    return data


def read_verified_weights(root: Path, rel: str, files: Mapping[str, str], sink: StreamSink | None = None,
                          drop_cache: bool = False) -> tuple[dict[str, torch.Tensor], bytes]:
    """``runtime/weights.read_tensors`` of the core's weights file ``rel``, read once: (its tensors, its length and
    header bytes), returned after the sha256 of every byte read matched the manifest's record (the tensors ``sink``
    streamed were packed from those bytes). A file whose header cannot be read is hashed to its end, so that a
    changed file is named as one (FILE-HASH) rather than by what its header lacks. ``drop_cache``: the file's page
    cache is dropped as it is read (``HashingReader``)."""
    with _opened(root, rel) as (file, size):
        reader = HashingReader(file, size, drop_cache)
        try:
            try:
                tensors, header = read_tensors(reader, size, sink)
            except WeightsFormatError as exc:
                reader.drain()
                _compare(root, rel, files, reader.hexdigest())
                raise CoreLoadError(f"{root}: {rel}: {exc}") from None
            found = reader.hexdigest()
        finally:
            reader.close()
    _compare(root, rel, files, found)
    return tensors, header


@contextmanager
def _opened(root: Path, rel: str):
    """(the open file, its size); an OSError while it is read becomes a CoreLoadError naming the file."""
    path, problems = safe_path(root, rel, f"manifest.json:files/{rel}")
    if path is None:  # validate_core already refused such a path; kept for a core changed since
        raise CoreLoadError(f"{root} is not a valid core:\n" + "\n".join(f"  {v}" for v in problems))
    try:
        with os.fdopen(os.open(path, OPEN_NO_WAIT), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):  # a FIFO or device swapped in since validation: never waited on
                raise CoreLoadError(f"{root} is not a valid core:\n  "
                                    f"{Violation('FILE-REGULAR', rel, 'expected a regular file')}")
            os.set_blocking(file.fileno(), True)
            yield file, info.st_size
    except OSError as exc:
        raise CoreLoadError(f"{root}: cannot read {rel}: {exc.strerror or exc}") from None


def _compare(root: Path, rel: str, files: Mapping[str, str], found: str) -> None:
    """``found`` against the sha256 the manifest lists for ``rel`` (``Manifest.files``)."""
    expected = files.get(rel)
    if found != expected:
        raise CoreLoadError(f"{root} is not a valid core:\n  "
                            f"{Violation('FILE-HASH', rel, f'expected sha256 {expected}, found {found}')}")


class HashingReader:
    """A file read front to back into the buffers the caller names, every byte hashed (sha256) in order on a worker
    thread while the next read runs (file reads and sha256 release the GIL).

    ``drop_cache``: the pages of the file that are read are dropped from the page cache as the read goes
    (``posix_fadvise(DONTNEED)``, ``DROP_CACHE_BYTES`` at a time; where the call exists). The reader's copy is the
    one that is used, so the cached one is a second copy of the same bytes, and the memory it frees is what the
    reader's next buffers get.

    NOTE: on this project's VM that matters more than the read: memory the guest handed back to the host faults in
    at 3-5 s a GiB, and a fresh process that loads the Qwen3-0.6B-shaped core touches 2.9 GiB. With the host in that
    state (a 512 MiB probe after each load faulted at 3.1-5.6 s/GiB), three loads that dropped the cache took 2.9,
    4.2 (the file read back from disk) and 2.9 s, three that kept it 8.7, 4.1 and 7.8 s (an ad-hoc script,
    alternated). The cost is that the next load of the core reads its weights from disk."""

    def __init__(self, file, size: int, drop_cache: bool = False):
        self.file, self.size, self.offset = file, size, 0
        self._digest = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ignition-hash")
        self._dropped = 0 if drop_cache and hasattr(os, "posix_fadvise") else None  # cache dropped below this

    def read_into(self, view: memoryview) -> Future:
        """Fill ``view`` with the next bytes (OSError when the file ends first); the future is done once they are
        hashed, after which the caller may reuse ``view``."""
        count = 0
        while count < len(view):
            read = self.file.readinto(view[count:])
            if not read:
                raise OSError(f"the file ends at byte {self.offset + count}, before the {self.size} it had "
                              "when it was opened")
            count += read
        self.offset += count
        if self._dropped is not None and (self.offset - self._dropped >= DROP_CACHE_BYTES or self.offset == self.size):
            self._drop_cache()
        return self._hasher.submit(self._digest.update, view)

    def _drop_cache(self) -> None:
        try:
            os.posix_fadvise(self.file.fileno(), self._dropped, self.offset - self._dropped, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, io.UnsupportedOperation):  # not a file the kernel caches (a pipe, a BytesIO)
            self._dropped = None
            return
        self._dropped = self.offset

    def drain(self) -> None:
        """Read and hash the rest of the file."""
        remaining = self.size - self.offset
        while remaining > 0:
            self.read_into(memoryview(bytearray(min(remaining, READ_CHUNK)))).result()
            remaining = self.size - self.offset

    def hexdigest(self) -> str:
        """The sha256 of the whole file, once every read is hashed; OSError when it was not read to its end or
        has grown meanwhile."""
        self._hasher.submit(lambda: None).result()
        if self.offset != self.size or self.file.read(1):
            raise OSError("the file changed size while it was read")
        return self._digest.hexdigest()

    def close(self) -> None:
        self._hasher.shutdown()


def load_tokenizer(root: Path, spec: Manifest):
    """The core's tokenizer, built from the bytes of tokenizer.json read once and hashed (``read_verified``)."""
    rel = spec.tokenizer_file
    if rel is None or rel not in spec.files:
        return None
    from tokenizers import Tokenizer
    data = read_verified(root, rel, spec.files)
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # UnicodeDecodeError; tokenizers raises a bare Exception for a malformed file
        raise CoreLoadError(f"{root}: {rel} does not load as a tokenizer: {str(exc)[:200]}") from None
    reach, size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1), spec.vocab_size
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
    """Each tensor's (offset, length) in the verified weights file, from its first bytes (``data``: the length and
    the header, ``read_verified_weights``): what ONNX-WEIGHTS compares against."""
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
