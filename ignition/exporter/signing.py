"""Core digest and Ed25519 signatures (the ``cryptography`` library).

The **core digest** is the sha256 of the canonical manifest JSON (``dump_json``: sorted keys,
two-space indent, trailing newline). The manifest lists every other file's sha256, so the
digest covers the whole core; for a core written by Ignition it equals ``sha256sum
manifest.json``. A signature is ``signature.json`` beside the manifest (never listed in it,
since it signs it): the Ed25519 signature of ``b"ignition-core-digest:" + digest`` (ASCII hex),
with the signer's raw public key and its id, ``sha256:`` + sha256 of the raw key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ignition.catalog.model import MANIFEST_FILE, SIGNATURE_FILE
from ignition.exporter.writer import dump_json

SIGNATURE_FORMAT = "ignition-signature/1"
SIGNED_PREFIX = b"ignition-core-digest:"


class SigningError(ValueError):
    """A key file cannot be used; the message names the file and what was expected."""


def core_digest(manifest: dict) -> str:
    """sha256 (hex) of the canonical JSON of a parsed manifest; ValueError when it has no canonical form."""
    return hashlib.sha256(dump_json(manifest)).hexdigest()


def signed_message(digest: str) -> bytes:
    return SIGNED_PREFIX + digest.encode("ascii")


def _raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public_key) -> str:
    return "sha256:" + hashlib.sha256(_raw_public(public_key)).hexdigest()


def _read_pem(path: str | Path, kind: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SigningError(f"{path}: cannot read the {kind} ({exc.strerror or exc})") from None


def load_signing_key(path: str | Path):
    """An Ed25519 private key from an unencrypted PEM file (``openssl genpkey -algorithm ed25519``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    data = _read_pem(path, "signing key")
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path}: expected an unencrypted PEM private key, found unreadable data ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path}: expected an Ed25519 private key, found {type(key).__name__}")
    return key


def load_trusted_key(path: str | Path):
    """An Ed25519 public key from a PEM file (``openssl pkey -in key.pem -pubout``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    data = _read_pem(path, "trusted key")
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path}: expected a PEM public key, found unreadable data ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{path}: expected an Ed25519 public key, found {type(key).__name__}")
    return key


def signature_document(digest: str, private_key) -> dict:
    public = private_key.public_key()
    return {"format": SIGNATURE_FORMAT, "algorithm": "ed25519", "digest": digest, "key_id": key_id(public),
            "public_key": _raw_public(public).hex(), "signature": private_key.sign(signed_message(digest)).hex()}


def sign_core(root: str | Path, private_key) -> dict:
    """Write ``signature.json`` for the core at ``root`` (its manifest as it is now); returns the document."""
    root = Path(root)
    document = signature_document(core_digest(json.loads((root / MANIFEST_FILE).read_bytes())), private_key)
    (root / SIGNATURE_FILE).write_bytes(dump_json(document))
    return document


def verify(document: dict, digest: str, trusted_key=None) -> str | None:
    """Why a schema-valid signature document does not vouch for ``digest`` (None when it does).

    Without ``trusted_key`` the signature is checked against its own embedded key: that proves the
    file is intact, not who signed it.
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if document["digest"] != digest:
        return f"signs digest {document['digest']}, but the core's digest is {digest}"
    embedded = Ed25519PublicKey.from_public_bytes(bytes.fromhex(document["public_key"]))
    if key_id(embedded) != document["key_id"]:
        return f"key_id {document['key_id']} is not the id of the embedded public key ({key_id(embedded)})"
    if trusted_key is not None and _raw_public(trusted_key) != _raw_public(embedded):
        return f"signed by {document['key_id']}, expected the trusted key {key_id(trusted_key)}"
    try:
        embedded.verify(bytes.fromhex(document["signature"]), signed_message(digest))
    except InvalidSignature:
        return f"the Ed25519 signature does not verify for digest {digest} and key {document['key_id']}"
    return None
