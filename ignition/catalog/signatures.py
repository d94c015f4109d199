"""The core signature format: what ``signature.json`` holds and how it is checked.

A signature is ``signature.json`` beside the manifest (never listed in it, since it signs it):
the Ed25519 signature (the ``cryptography`` library) of ``b"ignition-core-digest:" + digest``
(ASCII hex, the core digest of ``ignition.catalog.hashing``), with the signer's raw public key
and its id, ``sha256:`` + sha256 of the raw key. The exporter writes it
(``ignition.exporter.signing``); the validator and loader check it with ``verify``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SIGNATURE_FORMAT = "ignition-signature/1"
SIGNED_PREFIX = b"ignition-core-digest:"


class SigningError(ValueError):
    """A key file cannot be used; the message names the file and what was expected."""


def signed_message(digest: str) -> bytes:
    return SIGNED_PREFIX + digest.encode("ascii")


def raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public_key) -> str:
    return "sha256:" + hashlib.sha256(raw_public(public_key)).hexdigest()


_MAX_PEM_BYTES = 64 * 1024


def read_pem(path: str | Path, kind: str) -> bytes:
    """A PEM file's bytes: a regular file of at most 64 KiB (``/dev/zero`` or a FIFO is refused, never read)."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_PEM_BYTES:
                raise SigningError(f"{path}: expected the {kind} as a PEM file of at most {_MAX_PEM_BYTES} bytes")
            os.set_blocking(file.fileno(), True)
            return file.read(_MAX_PEM_BYTES)
    except OSError as exc:
        raise SigningError(f"{path}: cannot read the {kind} ({exc.strerror or exc})") from None


def load_trusted_key(path: str | Path):
    """An Ed25519 public key from a PEM file (``openssl pkey -in key.pem -pubout``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    data = read_pem(path, "trusted key")
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path}: expected a PEM public key, found unreadable data ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{path}: expected an Ed25519 public key, found {type(key).__name__}")
    return key


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
    if trusted_key is not None and raw_public(trusted_key) != raw_public(embedded):
        return f"signed by {document['key_id']}, expected the trusted key {key_id(trusted_key)}"
    try:
        embedded.verify(bytes.fromhex(document["signature"]), signed_message(digest))
    except InvalidSignature:
        return f"the Ed25519 signature does not verify for digest {digest} and key {document['key_id']}"
    return None
