"""File rules: safe relative paths, existence, sha256, nothing unlisted, weights as declared."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Collection, Mapping
from pathlib import Path, PurePosixPath

from safetensors import safe_open

from ignition.catalog.model import MANIFEST_FILE, SIGNATURE_FILE
from ignition.catalog.hashing import sha256_file
from ignition.validate.report import Violation

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F64": "float64"}


def safe_path(root: Path, rel: str, where: str) -> tuple[Path | None, list[Violation]]:
    """Resolve a core-relative path; refuse absolute paths, '..', backslashes and escapes."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or ".." in pure.parts or "\\" in rel or rel.startswith("~"):
        return None, [Violation("FILE-PATH", where, f"expected a relative path inside the core, found {rel!r}")]
    path = root / pure
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return None, [Violation("FILE-PATH", where, f"{rel!r} resolves outside the core")]
    return path, []


METADATA_MAX_BYTES = 256 * 2**20
"""The largest JSON file of a core Ignition reads (a manifest, catalog, kernel table or tokenizer file; the
largest real tokenizer.json is about 35 MB)."""
GRAPH_MAX_BYTES = 16 * 2**30
"""The largest graph file (.pt2 or .onnx) Ignition reads whole."""
OPEN_NO_WAIT = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
"""Flags that open a core file without following a final symbolic link and without waiting on a FIFO."""


def read_core_file(root: Path, rel: str, where: str, cap: int,
                   listed: Collection[str] | None = None) -> tuple[bytes | None, list[Violation]]:
    """(the bytes of the core file ``rel``, []) or (None, why not): a safe relative path (FILE-PATH), listed in the
    manifest when ``listed`` is given (FILE-UNLISTED), and a regular file of at most ``cap`` bytes (FILE-REGULAR),
    checked on the open descriptor before a byte is read. Opened without following a final symbolic link and
    without blocking, so a FIFO, a device or a link to one is refused, never waited on or read without end."""
    path, problems = safe_path(root, rel, where)
    if path is None:
        return None, problems
    if listed is not None and rel not in listed:
        return None, [Violation("FILE-UNLISTED", rel, f"named by {where} but has no sha256 in manifest.json")]
    try:
        descriptor = os.open(path, OPEN_NO_WAIT)
    except FileNotFoundError:
        return None, [Violation("FILE-MISSING", rel, f"named by {where} but absent")]
    except OSError as exc:  # ELOOP: a symbolic link; EACCES, ...
        kind = "a symbolic link" if path.is_symlink() else (exc.strerror or str(exc))
        return None, [Violation("FILE-REGULAR", rel, f"expected a regular file, found {kind}")]
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            return None, [Violation("FILE-REGULAR", rel, f"expected a regular file, found {_kind(info.st_mode)}")]
        if info.st_size > cap:
            return None, [Violation("FILE-REGULAR", rel, f"expected at most {cap:,} bytes, found {info.st_size:,}")]
        os.set_blocking(descriptor, True)
        data = file.read(cap + 1)
    if len(data) > cap:
        return None, [Violation("FILE-REGULAR", rel, f"expected at most {cap:,} bytes, found more (it grew)")]
    return data, []


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "no regular file"


def check_files(root: Path, listed: dict[str, str], named: dict[str, str],
                hashed_by_caller: Collection[str] = (), read: Mapping[str, bytes] | None = None,
                digested: Mapping[str, str] | None = None) -> list[Violation]:
    """``listed``: manifest files (path -> sha256); ``named``: path -> who names it. ``hashed_by_caller``:
    files checked for presence only, because the caller (a loader) hashes the very bytes it then loads.
    ``read``: files the caller already read and parsed (the catalog, the kernel table), hashed from those
    bytes, so what was checked is what the digest covers. ``digested``: files whose sha256 the caller took of the
    bytes it wrote or read and checked (export-core: the weights it wrote, the graphs it read ahead), compared
    with the manifest's instead of reading the file again."""
    read, digested = read or {}, digested or {}
    found = []
    for rel, digest in sorted(listed.items()):
        path, problems = safe_path(root, rel, f"manifest.json:files/{rel}")
        found += problems
        if path is None:
            continue
        if rel in read:
            actual = hashlib.sha256(read[rel]).hexdigest()
        elif not path.is_file():
            found.append(Violation("FILE-MISSING", rel, "listed in manifest.json but absent"))
            continue
        elif rel in hashed_by_caller:
            continue
        elif rel in digested:
            actual = digested[rel]
        else:
            actual = sha256_file(path)
        if actual != digest:
            found.append(Violation("FILE-HASH", rel, f"expected sha256 {digest}, found {actual}"))
    for rel, who in sorted(named.items()):
        path, problems = safe_path(root, rel, who)
        found += problems
        if path is not None and rel not in listed:
            found.append(Violation("FILE-UNLISTED", rel, f"named by {who} but has no sha256 in manifest.json"))
            if not path.is_file():
                found.append(Violation("FILE-MISSING", rel, f"named by {who} but absent"))
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if (path.is_symlink() or not path.is_dir()) and rel not in (MANIFEST_FILE, SIGNATURE_FILE) and rel not in listed:
            found.append(Violation("FILE-EXTRA", rel, "file in the core that manifest.json does not list"))
    return found


def check_weights(path: Path, variants: list[dict]) -> list[Violation]:
    """Weight arguments exist in the safetensors file with the declared dtype and shape."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {}
            for name in f.keys():
                sl = f.get_slice(name)
                header[name] = (_SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
    except Exception as exc:  # safetensors raises several exception types for corrupt headers
        return [Violation("WEIGHT-DECL", path.name, f"not a readable safetensors file: {exc}")]
    found = []
    for variant in variants:
        for decl in variant["arguments"]:
            if decl["role"] != "weight":
                continue
            stored = header.get(decl["name"])
            if stored != (decl["dtype"], decl["shape"]):
                found.append(Violation("WEIGHT-DECL", f"variant {variant['name']}: weight {decl['name']}",
                                       f"expected {decl['dtype']} {decl['shape']} in {path.name}, found {stored}"))
    return found
