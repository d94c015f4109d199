"""Atomic, deterministic core directories: write into a private temporary directory, hash
every file, validate, then rename into place. A killed export leaves only the temporary
directory, which never validates (its manifest is written last)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dump_json(data) -> bytes:
    """Canonical JSON: sorted keys, fixed indentation, trailing newline."""
    return (json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def staging_dir(out: Path) -> Path:
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def hash_tree(root: Path, exclude: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every file below root, keyed by its POSIX path relative to root."""
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in exclude:
            files[rel] = sha256_file(path)
    return files


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory to ``out``; an existing core is replaced only with overwrite."""
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
        retired = out.parent / f".{out.name}.retired-{os.getpid()}"
        os.rename(out, retired)
        os.rename(staging, out)
        shutil.rmtree(retired)
    else:
        os.rename(staging, out)
