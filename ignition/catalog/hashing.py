"""Deterministic core files: canonical JSON, the sha256 of every file, and the core digest.

The exporter writes with these and the validator checks with them, so both read one
definition. The **core digest** is the sha256 of the manifest's bytes, which must be its canonical
JSON (``dump_json``: sorted keys, no repeated key, fixed separators), so the bytes a signature covers
are the only reading of the manifest; the manifest lists every other file's sha256, so the digest
covers the whole core."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path


NOT_A_REGULAR_FILE = "not a regular file"
"""What ``sha256_file`` returns for a FIFO, device or directory: no digest ever equals it."""


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex); ``NOT_A_REGULAR_FILE`` for anything else, which is never read or waited on."""
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return NOT_A_REGULAR_FILE
        os.set_blocking(f.fileno(), True)
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dump_json(data) -> bytes:
    """Canonical JSON: sorted keys, fixed indentation, trailing newline."""
    return (json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def hash_tree(root: Path, exclude: tuple[str, ...], known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file below root, keyed by its POSIX path relative to root; ``known`` gives the digests of
    files whose writer hashed them as it wrote them (``save_aligned``), which are not read again."""
    known = known or {}
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in exclude:
            files[rel] = known[rel] if rel in known else sha256_file(path)
    return files


def core_digest(manifest: dict) -> str:
    """sha256 (hex) of the canonical JSON of a parsed manifest (the digest of the manifest file a writer
    writes with ``dump_json``); ValueError when it has no canonical form."""
    return hashlib.sha256(dump_json(manifest)).hexdigest()


def is_canonical(data: bytes, document) -> bool:
    """Whether ``data`` (which parsed as ``document``) is exactly its canonical JSON, ``dump_json(document)``."""
    try:
        return dump_json(document) == data
    except (TypeError, ValueError):  # NaN or infinities have no canonical JSON
        return False
