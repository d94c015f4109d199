"""Corpus: every file of a small signed core truncated, bit-flipped and swapped with rehash, plus planted payloads.

Rehash means the manifest's sha256 of the edited file is recomputed, as an attacker would, so
only deeper checks can object. Every case runs the CLI (``validate-core --json`` with the
expected digest and the trusted key) and asserts: no traceback, exit 1 with known rule ids and
no VALIDATOR-ERROR, the pinned provenance (CORE-DIGEST or SIGNATURE) refuses it, and where
the damage is structural a deep rule refuses it too. A canary file that any planted payload
would write must never appear. Offsets are sampled deterministically, not every byte.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from typer.testing import CliRunner

from _payloads import EXPECTED_RULES, pt2_payloads, rewrite, shared_library
from conftest import CoreCopy
from ignition.catalog.model import BufferDecl
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.exporter.signing import sign_core
from ignition.recipes.base import ExportOptions
from ignition.catalog.rules import RULES

runner = CliRunner()
PROVENANCE = {"CORE-DIGEST", "SIGNATURE"}
FILES = ["catalog.json", "graphs/decode.c1.pt2", "graphs/prefill.t8.pt2", "manifest.json", "signature.json",
         "weights.safetensors"]


class Corpus:
    def __init__(self, root: Path, digest: str, trusted_key: Path, canaries: Path):
        self.root, self.digest, self.trusted_key, self.canaries = root, digest, trusted_key, canaries


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    base = tmp_path_factory.mktemp("corpus")
    root = base / "core"
    export_core(ExportOptions(recipe="toy", capacities=(1,), chunk_limit=8), root)
    key = Ed25519PrivateKey.generate()
    document = sign_core(root, key)
    (base / "trusted.pem").write_bytes(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == FILES
    (base / "canaries").mkdir()
    return Corpus(root, document["digest"], base / "trusted.pem", base / "canaries")


@pytest.fixture
def case(corpus, tmp_path):
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(corpus.root, copy.root)
    yield copy
    assert not any(corpus.canaries.iterdir()), "a planted payload executed"


def rehash(copy: CoreCopy, *names: str) -> None:
    if "manifest.json" in names:
        return  # an edited manifest is itself the attack; nothing to recompute
    listed = copy.load("manifest.json")["files"]
    for name in names:
        if name in listed:  # signature.json is not listed: nothing to recompute
            copy.rehash(name)


def refused(corpus: Corpus, copy: CoreCopy, deep: bool) -> set[str]:
    """Run validate-core as a user would; return the rule ids it reported. ``deep``: a rule other than the
    pinned provenance must object too (the damage is structural, not only a changed hash)."""
    result = runner.invoke(app, ["validate-core", str(copy.root), "--json", "--expect-digest", corpus.digest,
                                 "--trusted-key", str(corpus.trusted_key)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    found = {v["rule"] for v in json.loads(result.stdout)["violations"]}
    assert found <= set(RULES) and "VALIDATOR-ERROR" not in found, found
    if _manifest_parses(copy):  # else there is no digest to pin, and JSON-PARSE refuses the core
        assert found & PROVENANCE, f"the pinned digest and signature accepted an edited core: {found}"
    else:
        assert "JSON-PARSE" in found, found
    if deep:
        assert found - PROVENANCE, f"only the pinned digest or signature caught it: {found}"
    return found


def _manifest_parses(copy: CoreCopy) -> bool:
    try:
        return isinstance(json.loads((copy.root / "manifest.json").read_bytes()), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_truncation(corpus, case, name, fraction):
    path = case.root / name
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * fraction)])
    rehash(case, name)
    refused(corpus, case, deep=name != "signature.json")  # signature.json is checked by SIGNATURE alone


def _member_data_offsets(path: Path, count: int, rng: random.Random) -> list[int]:
    """Offsets inside the stored bytes of models/model.json (the zip's CRC-32 covers them)."""
    data = path.read_bytes()
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("models/model.json"))
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    return [start + rng.randrange(info.file_size) for _ in range(count)]


def _flips() -> list[tuple[str, int, bool]]:
    """(file, seed, inside CRC-covered member data) cases."""
    return [(name, seed, inside) for name in FILES
            for seed, inside in ([(1, False), (2, False), (3, True), (4, True)] if name.endswith(".pt2") else [(1, False), (2, False)])]


@pytest.mark.parametrize("name,seed,inside", _flips())
def test_bit_flip_with_rehash(corpus, case, name, seed, inside):
    path = case.root / name
    rng = random.Random(f"{name}:{seed}")
    offset = _member_data_offsets(path, 1, rng)[0] if inside else rng.randrange(path.stat().st_size)
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    rehash(case, name)
    refused(corpus, case, deep=inside)


@pytest.mark.parametrize("first,second", list(itertools.combinations(FILES, 2)))
def test_swapped_files_with_rehash(corpus, case, first, second):
    a, b = case.root / first, case.root / second
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)
    rehash(case, first, second)
    refused(corpus, case, deep=True)


def _inputs(copy: CoreCopy) -> dict:
    entry = copy.variant(copy.load("catalog.json"), "decode.c1")
    return {a["name"]: BufferDecl.from_json(a).empty() for a in entry["arguments"]}


def _run(corpus: Corpus, copy: CoreCopy, *extra: str):
    result = runner.invoke(app, ["run", str(copy.root), "--prompt-ids", "1,2", "--max-tokens", "1", *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


@pytest.mark.parametrize("payload", sorted(EXPECTED_RULES))
def test_planted_payload_never_runs(corpus, case, payload):
    graph = "graphs/decode.c1.pt2"
    canary = corpus.canaries / payload
    planted = rewrite((case.root / graph).read_bytes(), pt2_payloads(canary, _inputs(case))[payload])
    (case.root / graph).write_bytes(planted)
    rehash(case, graph)
    assert EXPECTED_RULES[payload] <= refused(corpus, case, deep=True)
    (case.root / "signature.json").unlink()  # nor does it run for a user who pins nothing
    result = _run(corpus, case)
    assert result.exit_code == 1 and "PT2-" in result.output, result.output


def test_swapped_so_with_rehash_never_runs(corpus, case, tmp_path):
    canary = corpus.canaries / "so"
    library = shared_library(canary, tmp_path / "planted.so")
    if library is None:
        pytest.skip("needs a C compiler to build the planted library")
    (case.root / "graphs/prefill.t8.pt2").write_bytes(library.read_bytes())  # a raw library as a graph
    package = "graphs/decode.c1.aoti.pt2"  # and a compiled package the catalog names
    (case.root / package).write_bytes(rewrite((case.root / "graphs/decode.c1.pt2").read_bytes(), lambda m: (
        m.clear(), m.update({"archive_format": b"pt2", "archive_version": b"0",
                             "data/aotinductor/model/model.wrapper.so": library.read_bytes()}))))
    rehash(case, "graphs/prefill.t8.pt2")
    case.rehash(package)
    case.edit("catalog.json", lambda c: case.variant(c, "decode.c1").update(packages={"inductor": package}))
    assert "GRAPH-LOAD" in refused(corpus, case, deep=True)
    assert _run(corpus, case, "--trusted-key", str(corpus.trusted_key)).exit_code == 1
    shutil.copy(corpus.root / "graphs/prefill.t8.pt2", case.root / "graphs/prefill.t8.pt2")
    rehash(case, "graphs/prefill.t8.pt2")
    (case.root / "signature.json").unlink()
    with pytest.warns(UserWarning, match="not loading the compiled packages of decode.c1"):
        result = _run(corpus, case)  # valid now, but unsigned and untrusted: the .pt2 runs, the package never loads
    assert result.exit_code == 0, result.output
