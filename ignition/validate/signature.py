"""Provenance rules: the core digest against an expected one (CORE-DIGEST), and signature.json (SIGNATURE)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ignition.catalog.model import MANIFEST_FILE, SIGNATURE_FILE
from ignition.catalog.hashing import is_canonical
from ignition.catalog.signatures import key_id, verify
from ignition.validate.files import read_core_file, safe_path
from ignition.validate.report import Violation
from ignition.validate.schema import schema_violations

_MAX_SIGNATURE_BYTES = 64 << 10


@dataclass(slots=True)
class Provenance:
    digest: str | None = None  # sha256 of the manifest's bytes (its canonical JSON)
    signed_by: str | None = None  # key id of a signature.json that verifies (against the trusted key, if given)
    trusted: bool = False  # the signature verified against the caller's trusted key
    violations: list[Violation] = field(default_factory=list)


def check_provenance(root: Path, data: bytes, manifest, expect_digest: str | None, trusted_key) -> Provenance:
    """The digest of the manifest's exact bytes ``data`` (parsed as ``manifest``), which must be its canonical
    JSON (MANIFEST-CANONICAL), against ``expect_digest`` and the signature."""
    found = Provenance(digest=hashlib.sha256(data).hexdigest())
    if not is_canonical(data, manifest):
        found.violations.append(Violation("MANIFEST-CANONICAL", MANIFEST_FILE, (
            "expected the canonical JSON export-core writes (sorted keys, each once, two-space indentation, "
            "', ' and ': ' separators, a final newline): the digest and signature cover these exact bytes, "
            "so no other spelling of the manifest is accepted")))
    if expect_digest is not None and found.digest != expect_digest:
        found.violations.append(Violation("CORE-DIGEST", MANIFEST_FILE,
                                          f"expected digest {expect_digest}, found {found.digest}"))
    found.violations += _signature(root, found, trusted_key)
    return found


def _signature(root: Path, found: Provenance, trusted_key) -> list[Violation]:
    path, problems = safe_path(root, SIGNATURE_FILE, "core")
    if problems:
        return [Violation("SIGNATURE", SIGNATURE_FILE, problems[0].message)]
    if not path.exists() and not path.is_symlink():
        if trusted_key is None:
            return []  # unsigned cores are valid; only a trusted key demands a signature
        return [Violation("SIGNATURE", SIGNATURE_FILE,
                          f"expected a signature by the trusted key {key_id(trusted_key)}, found an unsigned core")]
    data, _ = read_core_file(root, SIGNATURE_FILE, "core", _MAX_SIGNATURE_BYTES)  # regular, never a FIFO
    if data is None:
        return [Violation("SIGNATURE", SIGNATURE_FILE, f"expected a JSON file under {_MAX_SIGNATURE_BYTES} bytes")]
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return [Violation("SIGNATURE", SIGNATURE_FILE, f"expected UTF-8 JSON, found {type(exc).__name__}: {exc}")]
    shape = schema_violations(document, "signature.schema.json", SIGNATURE_FILE)
    if shape:
        return [Violation("SIGNATURE", v.where, v.message) for v in shape]
    try:
        problem = verify(document, found.digest, trusted_key)
    except ValueError as exc:  # an embedded key that is not a curve point
        problem = f"the embedded public key is unusable: {exc}"
    if problem is not None:
        return [Violation("SIGNATURE", SIGNATURE_FILE, problem)]
    found.signed_by, found.trusted = document["key_id"], trusted_key is not None
    return []
