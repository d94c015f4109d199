"""Core digest, Ed25519 signatures, and the loader's rule that native code needs trust."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from typer.testing import CliRunner

from _payloads import shared_library
from conftest import CoreCopy
from ignition.cli import app
from ignition.catalog.hashing import core_digest
from ignition.catalog.signatures import SigningError, load_trusted_key
from ignition.exporter.signing import sign_core
from ignition.runtime.core import CoreLoadError, load_core
from ignition.validate.core import validate_core
from ignition.validate.program_reader import ProgramModule

runner = CliRunner()


def write_keys(directory, name="key"):
    key = Ed25519PrivateKey.generate()
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def signed_core(keys, tmp_path_factory):
    out = tmp_path_factory.mktemp("signed") / "core"
    result = runner.invoke(app, ["export-core", "--recipe", "toy", "--out", str(out), "--capacities", "1",
                                 "--chunk-limit", "8", "--sign-key", str(keys[0])])
    assert result.exit_code == 0, result.output
    digest = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert f"digest sha256:{digest} (signed)" in result.output
    return out


@pytest.fixture
def signed_copy(signed_core, tmp_path) -> CoreCopy:
    shutil.copytree(signed_core, tmp_path / "core")
    return CoreCopy(tmp_path / "core")


def rules(report) -> set[str]:
    return {v.rule for v in report.violations}


def test_digest_is_the_sha256_of_the_canonical_manifest(toy_core):
    report = validate_core(toy_core, check_graphs=False)
    assert report.digest == hashlib.sha256((toy_core / "manifest.json").read_bytes()).hexdigest()
    assert report.digest == core_digest(json.loads((toy_core / "manifest.json").read_text()))
    assert validate_core(toy_core, check_graphs=False, expect_digest="SHA256:" + report.digest.upper()).ok
    assert report.signed_by is None and not report.trusted


def test_expect_digest(core_copy):
    digest = validate_core(core_copy.root, check_graphs=False).digest
    core_copy.edit("manifest.json", lambda m: m["model"].update(architecture="renamed"))  # valid, but not the core we expect
    assert validate_core(core_copy.root, check_graphs=False).ok
    report = validate_core(core_copy.root, check_graphs=False, expect_digest=digest)
    assert rules(report) == {"CORE-DIGEST"} and digest in report.violations[0].message


def test_signed_core_verifies(signed_core, keys):
    document = json.loads((signed_core / "signature.json").read_text())
    assert document["format"] == "ignition-signature/1" and document["algorithm"] == "ed25519"
    report = validate_core(signed_core, trusted_key=keys[1])
    assert report.ok and report.trusted and report.signed_by == document["key_id"]
    assert document["digest"] == report.digest
    unverified = validate_core(signed_core)  # no key: checked against its embedded key, not trusted
    assert unverified.ok and unverified.signed_by == document["key_id"] and not unverified.trusted


def test_signature_rules(signed_copy, keys, tmp_path, toy_core):
    _, other = write_keys(tmp_path, "other")
    assert rules(validate_core(signed_copy.root, check_graphs=False, trusted_key=other)) == {"SIGNATURE"}
    assert rules(validate_core(toy_core, check_graphs=False, trusted_key=keys[1])) == {"SIGNATURE"}  # unsigned
    signature = signed_copy.root / "signature.json"
    document = json.loads(signature.read_text())
    forged = dict(document, signature=("0" if document["signature"][0] != "0" else "1") + document["signature"][1:])
    signature.write_text(json.dumps(forged))
    report = validate_core(signed_copy.root, check_graphs=False)  # fails even without a trusted key
    assert rules(report) == {"SIGNATURE"} and "does not verify" in report.violations[0].message
    signature.write_text(json.dumps(document))
    signed_copy.edit("manifest.json", lambda m: m["model"].update(architecture="renamed"))  # the signed digest changes
    report = validate_core(signed_copy.root, check_graphs=False, trusted_key=keys[1])
    assert rules(report) == {"SIGNATURE"} and "signs digest" in report.violations[0].message
    signature.write_text('{"format": "ignition-signature/1"}')
    assert rules(validate_core(signed_copy.root, check_graphs=False)) == {"SIGNATURE"}


def test_signature_is_excluded_from_the_file_list_only(signed_copy):
    assert "signature.json" not in signed_copy.load("manifest.json")["files"]
    (signed_copy.root / "signature.json.bak").write_text("{}")
    assert rules(validate_core(signed_copy.root, check_graphs=False)) == {"FILE-EXTRA"}


def test_bad_key_files_are_usage_errors(keys, tmp_path, toy_core):
    with pytest.raises(SigningError, match="expected a PEM public key"):
        load_trusted_key(keys[0])  # a private key is not a trusted key
    for args in (["validate-core", str(toy_core), "--trusted-key", str(tmp_path / "absent.pem")],
                 ["run", str(toy_core), "--prompt-ids", "1", "--trusted-key", str(keys[0])],
                 ["export-core", "--recipe", "toy", "--out", str(tmp_path / "x"), "--sign-key", str(keys[1])]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "x").exists()


def test_cli_digest_and_trust(signed_core, keys, toy_core):
    digest = validate_core(signed_core, check_graphs=False).digest
    result = runner.invoke(app, ["validate-core", str(signed_core), "--expect-digest", digest,
                                 "--trusted-key", str(keys[1])])
    assert result.exit_code == 0 and "(trusted key)" in result.output, result.output
    result = runner.invoke(app, ["validate-core", str(signed_core), "--expect-digest", "0" * 64, "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["digest"] == digest
    assert "CORE-DIGEST" in result.stdout
    assert runner.invoke(app, ["validate-core", str(signed_core), "--expect-digest", "abc"]).exit_code == 2
    summary = json.loads(runner.invoke(app, ["inspect-core", str(signed_core), "--json"]).stdout)
    assert summary["digest"] == digest and summary["signed_by"].startswith("sha256:")
    for command in (["run", str(toy_core), "--prompt-ids", "1,2"], ["serve", str(toy_core)]):
        result = runner.invoke(app, [*command, "--trusted-key", str(keys[1])])  # unsigned: refused before serving
        assert result.exit_code == 1 and "SIGNATURE" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["run", str(signed_core), "--prompt-ids", "1,2", "--max-tokens", "2",
                                 "--trusted-key", str(keys[1]), "--json"])
    assert result.exit_code == 0, result.output


def _plant_package(copy: CoreCopy, library) -> None:
    """A compiled package whose library writes the canary when dlopened, named by the catalog, rehashed."""
    from _payloads import rewrite
    package = "graphs/decode.c1.aoti.pt2"
    data = rewrite((copy.root / "graphs/decode.c1.pt2").read_bytes(), lambda m: (m.clear(), m.update({
        "archive_format": b"pt2", "archive_version": b"0",
        "data/aotinductor/model/model.wrapper.so": library.read_bytes(),
        "data/aotinductor/model/model.wrapper_metadata.json": b'{"AOTI_DEVICE_KEY": "cpu"}'})))
    (copy.root / package).write_bytes(data)
    copy.rehash(package)
    copy.edit("catalog.json", lambda c: copy.variant(c, "decode.c1").update(packages={"inductor": package}))


def test_swapped_so_with_rehash_needs_trust(signed_copy, keys, tmp_path):
    """A planted compiled package validates (its bytes match the rehashed manifest) but never runs unless
    trusted: not during validation, not in the default loader, not against a signature it broke."""
    canary = tmp_path / "canary"
    library = shared_library(canary, tmp_path / "planted.so")
    if library is None:
        pytest.skip("needs a C compiler to build the planted library")
    _plant_package(signed_copy, library)
    assert rules(validate_core(signed_copy.root)) == {"SIGNATURE"}  # the rehash changed the signed digest
    with pytest.raises(CoreLoadError, match="SIGNATURE"):
        load_core(signed_copy.root, trusted_key=keys[1])
    (signed_copy.root / "signature.json").unlink()
    assert validate_core(signed_copy.root).ok
    with pytest.warns(UserWarning, match="not loading the compiled packages of decode.c1"):
        loaded = load_core(signed_copy.root)
    assert isinstance(loaded.variants["decode.c1"].runner, ProgramModule)  # the portable program, not the package
    with pytest.warns(UserWarning, match="not loading the compiled packages"):  # the CLI says so too
        result = runner.invoke(app, ["run", str(signed_copy.root), "--prompt-ids", "1,2", "--max-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert not canary.exists()

    sign_core(signed_copy.root, _private(keys[0]))  # now the holder of the key vouches for the package
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planted library is no real package: the loader falls back
        load_core(signed_copy.root, trusted_key=keys[1])
    assert canary.exists()  # a signature is trust: the package was dlopened (the test's positive control)
    canary.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_core(signed_copy.root, trust_compiled=True)
    assert canary.exists()


def _private(path):
    from ignition.exporter.signing import load_signing_key
    return load_signing_key(path)
