"""Shared fixtures: one exported toy core per session, copied for tests that mutate it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from ignition.exporter.export import export_core
from ignition.catalog.hashing import dump_json, sha256_file
from ignition.recipes.base import ExportOptions


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers on two cores) each worker's torch gets one
    thread, so the workers do not oversubscribe the cores; a plain ``pytest`` keeps torch's default. The GEMM
    calibration cache goes to a folder of the run's own."""
    import os
    import tempfile

    # the GEMM calibration cache (runtime/backends/gemm_calibration.py) of this run, never the user's
    os.environ.setdefault("IGNITION_CACHE_DIR", tempfile.mkdtemp(prefix="ignition-test-cache-"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


SHARED_CORES: dict[Path, str] = {}
"""Every shared core this process handed out -> its ``core_fingerprint`` then (``shared_cores_stay_unchanged``)."""


def core_fingerprint(root: Path) -> str:
    """sha256 over the relative path and the bytes of every file under ``root``: any file added, removed, renamed
    or rewritten changes it, a rehashed manifest included."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@pytest.fixture(scope="session", autouse=True)
def shared_cores_stay_unchanged():
    """After every other fixture of the test run is torn down, each shared core this process handed out holds the
    bytes it held then: a test or fixture that edits a core must edit a copy (``core_copy``), or every test that
    runs after it, in this worker or another, reads the edited core."""
    yield
    changed = sorted(str(root) for root, fingerprint in SHARED_CORES.items() if core_fingerprint(root) != fingerprint)
    assert not changed, f"shared cores changed in place by a test or fixture: {changed} (edit a copy: core_copy)"


def shared_core(tmp_path_factory, name: str, export) -> Path:
    """The directory ``name`` that ``export(directory)`` fills, made once per run: under pytest-xdist the workers
    share it (the first to take its lock builds it; an export publishes its core whole, by one rename), so a
    session-scoped core is exported once, not once per worker. The tests only read it: one that edits a core copies it
    (``shared_cores_stay_unchanged`` checks at the end of the test run)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's directory, the parent of every worker's own
    out = root / "shared-cores" / name
    out.parent.mkdir(exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not out.exists():
            export(out)
        SHARED_CORES.setdefault(out, core_fingerprint(out))
    return out


@pytest.fixture(scope="session")
def toy_core(tmp_path_factory) -> Path:
    return shared_core(tmp_path_factory, "toy", lambda out: export_core(
        ExportOptions(recipe="toy", capacities=(1, 4)), out))


@pytest.fixture(scope="session")
def toy_core_no_logprobs(tmp_path_factory) -> Path:
    """A core without the logprob buffers (K=0): the benchmark-only records-only build, not on the CLI."""
    return shared_core(tmp_path_factory, "toy-nolp", lambda out: export_core(
        ExportOptions(recipe="toy", capacities=(1, 4), logprobs=False), out))


MOE_RECIPES = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="session")
def moe_cores(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """recipe -> (checkpoint, core) of examples/make_tiny_moe.py's FP32 checkpoints (3 layers, 8 routed experts):
    decode capacity 2, 8-row chunks, 64 positions, prompt scoring (test_moe_recipes.py, test_device_scan.py)."""
    import importlib.util

    def export(root: Path) -> None:
        spec = importlib.util.spec_from_file_location(
            "make_tiny_moe", Path(__file__).resolve().parents[1] / "examples" / "make_tiny_moe.py")
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        staging = root.with_name(root.name + ".partial")  # the pair appears whole, by one rename
        shutil.rmtree(staging, ignore_errors=True)
        for recipe in MOE_RECIPES:
            checkpoint = example.make_checkpoint(staging / recipe / "ckpt", recipe)
            export_core(ExportOptions(recipe=recipe, checkpoint=checkpoint, capacities=(2,), chunk_limit=8,
                                      max_seq_len=64, prompt_logprobs=True), staging / recipe / "core")
        staging.rename(root)

    root = shared_core(tmp_path_factory, "moe", export)
    return {recipe: (root / recipe / "ckpt", root / recipe / "core") for recipe in MOE_RECIPES}


class CoreCopy:
    """A writable copy of a core with helpers that keep the file hashes honest."""

    def __init__(self, root: Path):
        self.root = root

    def load(self, name: str) -> dict:
        return json.loads((self.root / name).read_text())

    def save(self, name: str, data: dict, rehash: bool = True) -> None:
        (self.root / name).write_bytes(dump_json(data))
        if rehash and name != "manifest.json":
            self.rehash(name)

    def rehash(self, rel: str) -> None:
        manifest = self.load("manifest.json")
        manifest["files"][rel] = sha256_file(self.root / rel)
        self.save("manifest.json", manifest)

    def edit(self, name: str, fn) -> None:
        data = self.load(name)
        fn(data)
        self.save(name, data)

    def variant(self, catalog: dict, name: str) -> dict:
        return next(v for v in catalog["variants"] if v["name"] == name)


@pytest.fixture
def core_copy(toy_core, tmp_path) -> CoreCopy:
    dest = tmp_path / "core"
    shutil.copytree(toy_core, dest)
    return CoreCopy(dest)


@pytest.fixture(scope="session")
def toy_onnx_core(tmp_path_factory) -> Path:
    """A toy core with ONNX graphs and prompt scoring: decode.c4, prefill.t64, scored.t64."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    return shared_core(tmp_path_factory, "toy-onnx", lambda out: export_core(
        ExportOptions(recipe="toy", capacities=(4,), chunk_limit=64, prompt_logprobs=True, onnx=True), out))


# -- live servers of the HTTP tests (one of each per session) --------------------------------------
@pytest.fixture(scope="session")
def serving_cores(tmp_path_factory):
    """Toy cores with trained tokenizers: A byte-level BPE with prompt scoring and a chat template, B byte
    fallback without a template (test_server.py, test_serve_*.py)."""
    from _serving_tokenizers import byte_fallback_tokenizer, byte_level_tokenizer, write_tokenizer_dir

    def export(root: Path) -> None:
        staging = root.with_name(root.name + ".partial")  # the pair appears whole, by one rename
        shutil.rmtree(staging, ignore_errors=True)
        export_core(ExportOptions(recipe="toy", capacities=(1, 4), prompt_logprobs=True,
                                  tokenizer=write_tokenizer_dir(byte_level_tokenizer(), staging / "tok-a")),
                    staging / "a")
        export_core(ExportOptions(recipe="toy", capacities=(1, 4),
                                  tokenizer=write_tokenizer_dir(byte_fallback_tokenizer(), staging / "tok-b", None)),
                    staging / "b")
        staging.rename(root)

    root = shared_core(tmp_path_factory, "serving", export)
    return root / "a", root / "b"


@pytest.fixture(scope="session")
def served(serving_cores):
    from _served import Served
    from _serving_tokenizers import byte_level_tokenizer

    server = Served(serving_cores[0], byte_level_tokenizer())
    yield server
    server.close()


@pytest.fixture(scope="session")
def served_eos(serving_cores, tmp_path_factory):
    """A copy of core B with an EOS: the third token the greedy chain from token 7 produces (core B itself, which
    other tests serve, keeps its manifest)."""
    from safetensors.torch import load_file

    from _served import VOCAB, Served
    from _serving_tokenizers import byte_fallback_tokenizer
    from ignition.recipes.toy import batch_invariant_logits

    core = tmp_path_factory.mktemp("served-eos") / "b"
    shutil.copytree(serving_cores[1], core)
    weights = load_file(str(core / "weights.safetensors"))
    successor = batch_invariant_logits(weights["embedding.weight"], weights["lm_head.weight"])[:, :VOCAB].argmax(1)
    chain = [int(successor[7])]
    for _ in range(2):
        chain.append(int(successor[chain[-1]]))
    assert chain[2] not in chain[:2]
    manifest = json.loads((core / "manifest.json").read_text())
    manifest["eos_token_id"] = chain[2]
    (core / "manifest.json").write_bytes(dump_json(manifest))
    server = Served(core, byte_fallback_tokenizer())
    yield server
    server.close()


@pytest.fixture(scope="session")
def served_plain(toy_core_no_logprobs):
    from _served import Served

    server = Served(toy_core_no_logprobs)
    yield server
    server.close()
