"""A corpus of hostile cores: each is live or would mislead, and each is refused by its rule.

Files written by the graph (``aten.from_file``), a manifest whose bytes say something its digest
does not cover (duplicate keys, another spelling), a vocabulary edit, ONNX graphs that break the
ONNX rules or are swapped while loading, and a tokenizer swapped while loading. Nothing may be
written, and the loader must refuse exactly what validate-core refuses.
"""

from __future__ import annotations

import json
import shutil

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tokenizers import Tokenizer, models

from _payloads import file_write, rewrite
from conftest import CoreCopy
from ignition.exporter.export import export_core
from ignition.exporter.signing import sign_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import CoreLoadError, load_core
from ignition.validate.core import validate_core
from test_pt2_archive import example_inputs, plain_torch_load

GRAPH = "graphs/decode.c1.pt2"
ORIGINAL = "print('the original module')\n"


def rules(report) -> set[str]:
    return {v.rule for v in report.violations}


# -- graphs that write files --------------------------------------------------------------------
def test_from_file_graph_is_live_and_refused_everywhere(core_copy, tmp_path):
    victim = tmp_path / "victim.py"
    victim.write_text(ORIGINAL)
    planted = rewrite((core_copy.root / GRAPH).read_bytes(), file_write(victim, 8))
    plain_torch_load(planted, example_inputs(core_copy.root))
    assert victim.read_text() != ORIGINAL, "the payload is not live: the test would prove nothing"
    victim.write_text(ORIGINAL)

    (core_copy.root / GRAPH).write_bytes(planted)
    core_copy.rehash(GRAPH)
    report = validate_core(core_copy.root)
    assert rules(report) == {"GRAPH-OPERATOR"}, report.violations
    assert "aten.from_file" in report.violations[0].message
    with pytest.raises(CoreLoadError, match="GRAPH-OPERATOR"):
        load_core(core_copy.root)
    assert victim.read_text() == ORIGINAL


def test_exported_operators_are_listed_and_none_is_refused_by_name():
    from ignition.catalog.operators import ALLOWED_OPERATORS, operator_refusal, refused_by_name

    assert not [packet for packet in ALLOWED_OPERATORS if refused_by_name(packet)]
    for target in ("torch.ops.aten.from_file.default", "torch.ops.aten.save.default", "torch.ops.aten._load.default",
                   "torch.ops.aten.set_.source_Storage", "torch.ops.aten._print.default"):
        assert "outside the graph" in operator_refusal(target)
    assert "not one the recipes emit" in operator_refusal("torch.ops.aten.bernoulli_.float")
    for target in ("torch.ops.aten.scaled_dot_product_attention.default", "torch.ops.aten.index_put_.default",
                   "torch.ops.aten.narrow.default", "torch.ops.aten.slice.Tensor", "torch.ops.aten.copy_.default"):
        assert operator_refusal(target) is None


def test_an_operator_passed_as_an_argument_is_checked_too():
    from ignition.validate.program_json import program_violations

    node = {"target": "torch.ops.higher_order.auto_functionalized", "outputs": [],
            "inputs": [{"name": "_op", "arg": {"as_operator": "torch.ops.aten.from_file.default"}, "kind": 1}]}
    document = {"graph_module": {"graph": {"inputs": [], "nodes": [node]}}}
    assert {v.rule for v in program_violations(document, "model.json")} == {"GRAPH-OPERATOR"}


# -- the manifest's bytes -----------------------------------------------------------------------
def test_duplicate_keys_placed_first_are_refused(core_copy):
    data = (core_copy.root / "manifest.json").read_bytes()
    (core_copy.root / "manifest.json").write_bytes(data.replace(b"{\n", b'{\n  "recipe": "llama",\n', 1))
    report = validate_core(core_copy.root)
    assert rules(report) == {"JSON-PARSE"} and "duplicate keys ['recipe']" in report.violations[0].message
    with pytest.raises(CoreLoadError, match="JSON-PARSE"):
        load_core(core_copy.root)


def test_another_spelling_of_a_signed_manifest_is_refused(core_copy):
    key = Ed25519PrivateKey.generate()
    sign_core(core_copy.root, key)
    assert validate_core(core_copy.root, trusted_key=key.public_key()).trusted
    manifest = core_copy.load("manifest.json")  # same content, other bytes: no canonical reading
    (core_copy.root / "manifest.json").write_text(json.dumps(manifest, separators=(",", ":")))
    report = validate_core(core_copy.root, trusted_key=key.public_key())
    assert rules(report) == {"MANIFEST-CANONICAL", "SIGNATURE"} and not report.trusted


# -- geometry -----------------------------------------------------------------------------------
def test_vocab_size_edit_is_refused_by_the_graphs(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(vocab_size=m["vocab_size"] - 40))
    report = validate_core(core_copy.root)
    assert rules(report) == {"GEOM-VOCAB-GRAPH"}, report.violations
    assert "vocab_size 250; manifest.json says 210" in report.violations[0].message
    with pytest.raises(CoreLoadError, match="GEOM-VOCAB-GRAPH"):
        load_core(core_copy.root)


# -- ONNX graphs at load ------------------------------------------------------------------------
@pytest.fixture
def onnx_copy(toy_onnx_core, tmp_path) -> CoreCopy:
    shutil.copytree(toy_onnx_core, tmp_path / "core")
    return CoreCopy(tmp_path / "core")


def test_loading_runs_the_onnx_rules(onnx_copy):
    import onnx

    graph = "graphs/decode.c4.onnx"
    model = onnx.load(str(onnx_copy.root / graph), load_external_data=False)
    model.graph.output.pop()  # ONNX-OUTPUTS: the last written buffer is no output any more
    (onnx_copy.root / graph).write_bytes(model.SerializeToString())
    onnx_copy.rehash(graph)
    assert "ONNX-OUTPUTS" in rules(validate_core(onnx_copy.root))
    with pytest.raises(CoreLoadError, match="ONNX-OUTPUTS"):
        load_core(onnx_copy.root, runtime="onnxruntime")


def swap_at(stage: str, path, content: bytes):
    """A progress callback that replaces ``path`` when load_core starts ``stage``."""
    def progress(started: str, item: str) -> None:
        if started == stage:
            path.write_bytes(content)
    return progress


def test_onnx_graph_swapped_during_load_is_refused(onnx_copy):
    graph = onnx_copy.root / "graphs/decode.c4.onnx"
    other = (onnx_copy.root / "graphs/prefill.t64.onnx").read_bytes()  # a valid graph, not this one
    original = graph.read_bytes()
    for stage in ("weights", "graphs"):
        with pytest.raises(CoreLoadError, match="FILE-HASH"):
            load_core(onnx_copy.root, runtime="onnxruntime", progress=swap_at(stage, graph, other))
        graph.write_bytes(original)
    assert load_core(onnx_copy.root, runtime="onnxruntime").backend == "onnx"


# -- the tokenizer ------------------------------------------------------------------------------
def test_tokenizer_swapped_during_load_is_refused(tmp_path):
    source = tmp_path / "tok"
    source.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(source / "tokenizer.json"))
    core = tmp_path / "core"
    export_core(ExportOptions(recipe="toy", capacities=(1,), tokenizer=source), core)
    assert load_core(core).tokenizer.encode("w3").ids == [3]
    swapped = Tokenizer(models.WordLevel({f"w{i}": 9 - i for i in range(10)}, unk_token="w0")).to_str().encode()
    for stage in ("check", "weights", "tokenizer"):
        original = (core / "tokenizer/tokenizer.json").read_bytes()
        with pytest.raises(CoreLoadError, match="FILE-HASH|TOKENIZER"):
            load_core(core, progress=swap_at(stage, core / "tokenizer/tokenizer.json", swapped))
        (core / "tokenizer/tokenizer.json").write_bytes(original)


# -- bytes checked are bytes used ---------------------------------------------------------------
def test_a_metadata_file_is_hashed_from_the_bytes_that_were_parsed(core_copy):
    from ignition.validate.files import check_files

    manifest = core_copy.load("manifest.json")
    assert check_files(core_copy.root, manifest["files"], {}, read={"catalog.json": b"{}"})[0].rule == "FILE-HASH"


def test_weights_that_differ_from_what_the_validator_saw_are_refused(core_copy):
    """The manifest lists the hash of other weights (one truncated tensor); the validator is shown the
    declared ones and the loader, reading after the check, gets the listed ones: their hash matches, their
    shape does not."""
    from safetensors.torch import load, save

    path = core_copy.root / "weights.safetensors"
    honest = path.read_bytes()
    tensors = load(honest)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:8].clone()
    listed = save(tensors)
    path.write_bytes(listed)
    core_copy.rehash("weights.safetensors")
    path.write_bytes(honest)
    with pytest.raises(CoreLoadError, match="WEIGHT-DECL.*lm_head.weight"):
        load_core(core_copy.root, progress=swap_at("weights", path, listed))

