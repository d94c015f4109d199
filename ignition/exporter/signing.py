"""Signing a core with an Ed25519 key (the ``cryptography`` library).

The format (``signature.json``, the signed message, key ids) and its verification live in
``ignition.catalog.signatures``; the core digest is ``ignition.catalog.hashing.core_digest``,
the sha256 of the canonical manifest JSON, which for a core written by Ignition equals
``sha256sum manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ignition.catalog.model import MANIFEST_FILE, SIGNATURE_FILE
from ignition.catalog.hashing import core_digest, dump_json
from ignition.catalog.signatures import SIGNATURE_FORMAT, SigningError, key_id, raw_public, read_pem, signed_message

def load_signing_key(path: str | Path):
    """An Ed25519 private key from an unencrypted PEM file (``openssl genpkey -algorithm ed25519``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    data = read_pem(path, "signing key")
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path}: expected an unencrypted PEM private key, found unreadable data ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path}: expected an Ed25519 private key, found {type(key).__name__}")
    return key


def signature_document(digest: str, private_key) -> dict:
    public = private_key.public_key()
    return {"format": SIGNATURE_FORMAT, "algorithm": "ed25519", "digest": digest, "key_id": key_id(public),
            "public_key": raw_public(public).hex(), "signature": private_key.sign(signed_message(digest)).hex()}


def sign_core(root: str | Path, private_key) -> dict:
    """Write ``signature.json`` for the core at ``root`` (its manifest as it is now); returns the document."""
    root = Path(root)
    document = signature_document(core_digest(json.loads((root / MANIFEST_FILE).read_bytes())), private_key)
    (root / SIGNATURE_FILE).write_bytes(dump_json(document))
    return document


