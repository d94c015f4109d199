"""validate-core on ONNX graphs: every malformed graph is rejected with an ONNX-* rule id.

Mutants are checked with the ONNX rules directly (``check_onnx``, what validate-core runs after
the file and .pt2 rules); one goes through the ``validate-core`` command end to end.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from typer.testing import CliRunner  # noqa: E402

from ignition.cli import app  # noqa: E402
from ignition.validate.onnx_graphs import check_onnx  # noqa: E402
from ignition.catalog.rules import RULES  # noqa: E402
from tests.conftest import CoreCopy  # noqa: E402

GRAPH = "graphs/decode.c4.onnx"


@pytest.fixture
def onnx_copy(toy_onnx_core, tmp_path) -> CoreCopy:
    shutil.copytree(toy_onnx_core, tmp_path / "core")
    return CoreCopy(tmp_path / "core")


def onnx_rules(copy: CoreCopy) -> set[str]:
    manifest = copy.load("manifest.json")
    found = check_onnx(copy.root, manifest, copy.load(manifest["catalog"])["variants"], broken=set())
    assert all(v.rule in RULES for v in found), found
    return {v.rule for v in found}


def mutate(copy: CoreCopy, fn, graph: str = GRAPH) -> None:
    model = onnx.load(str(copy.root / graph), load_external_data=False)
    fn(model)
    (copy.root / graph).write_bytes(model.SerializeToString())
    copy.rehash(graph)


def test_exported_graphs_pass(onnx_copy):
    assert onnx_rules(onnx_copy) == set()


def test_truncated_graph(onnx_copy):
    data = (onnx_copy.root / GRAPH).read_bytes()
    (onnx_copy.root / GRAPH).write_bytes(data[:len(data) // 3])
    assert "ONNX-LOAD" in onnx_rules(onnx_copy)


def test_not_a_graph(onnx_copy):
    (onnx_copy.root / GRAPH).write_bytes(b"PK\x03\x04 definitely not protobuf")
    assert "ONNX-LOAD" in onnx_rules(onnx_copy)


def test_wrong_input_dtype(onnx_copy):
    def fn(model):
        value = next(v for v in model.graph.input if v.name == "logprob_requested")
        value.type.tensor_type.elem_type = onnx.TensorProto.INT64
    mutate(onnx_copy, fn)
    assert "ONNX-INPUTS" in onnx_rules(onnx_copy)


def test_missing_output(onnx_copy):
    def fn(model):
        kept = [v for v in model.graph.output if v.name != "completion_logprobs.out"]
        del model.graph.output[:]
        model.graph.output.extend(kept)
    mutate(onnx_copy, fn)
    assert "ONNX-OUTPUTS" in onnx_rules(onnx_copy)


def test_wrong_output_shape(onnx_copy):
    def fn(model):
        value = next(v for v in model.graph.output if v.name == "completion_records.out")
        value.type.tensor_type.shape.dim[0].dim_value = 3
    mutate(onnx_copy, fn)
    assert "ONNX-OUTPUTS" in onnx_rules(onnx_copy)


def test_weight_offset_and_embedded_weight(onnx_copy):
    def shift(model):
        tensor = next(t for t in model.graph.initializer if t.name == "lm_head.weight")
        next(e for e in tensor.external_data if e.key == "offset").value = "8"
    mutate(onnx_copy, shift)
    assert "ONNX-WEIGHTS" in onnx_rules(onnx_copy)

    def embed(model):
        tensor = next(t for t in model.graph.initializer if t.name == "embedding.weight")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = bytes(4 * 256 * 32)
    mutate(onnx_copy, embed, "graphs/prefill.t64.onnx")
    assert "ONNX-WEIGHTS" in onnx_rules(onnx_copy)


def test_old_opset_and_custom_domain(onnx_copy):
    def old(model):
        model.opset_import[0].version = 17
    mutate(onnx_copy, old)
    assert "ONNX-OPSET" in onnx_rules(onnx_copy)

    def custom(model):
        model.graph.node.append(onnx.helper.make_node("Fused", ["positions"], ["unused"], domain="com.example"))
    mutate(onnx_copy, custom, "graphs/prefill.t64.onnx")
    assert "ONNX-OPSET" in onnx_rules(onnx_copy)


def test_late_read_of_a_written_buffer(onnx_copy):
    """A node reading completion_records outside the producer's ancestry could see the in-place update."""
    def fn(model):
        model.graph.node.append(onnx.helper.make_node("Neg", ["completion_records"], ["late_read"]))
    mutate(onnx_copy, fn)
    assert "ONNX-INPLACE" in onnx_rules(onnx_copy)


def test_onnx_and_pt2_pair_one_to_one(onnx_copy):
    def drop(catalog):
        del onnx_copy.variant(catalog, "prefill.t64")["packages"]
    onnx_copy.edit("catalog.json", drop)
    assert "ONNX-PAIRING" in onnx_rules(onnx_copy)

    def rename(catalog):
        onnx_copy.variant(catalog, "decode.c4")["packages"]["onnx"] = "graphs/other.onnx"
    onnx_copy.edit("catalog.json", rename)
    assert "ONNX-PAIRING" in onnx_rules(onnx_copy)


def test_validate_core_command_names_the_rule(onnx_copy):
    mutate(onnx_copy, lambda model: model.graph.output.pop())
    result = CliRunner().invoke(app, ["validate-core", str(onnx_copy.root), "--json"])
    assert result.exit_code == 1
    findings = json.loads(result.stdout)["violations"]
    assert {f["rule"] for f in findings} == {"ONNX-OUTPUTS"}, findings


def test_unlisted_onnx_file_is_refused(toy_core, tmp_path):
    """An .onnx the manifest does not list is an unknown file like any other (FILE-EXTRA)."""
    shutil.copytree(toy_core, tmp_path / "core")
    (tmp_path / "core" / "graphs" / "decode.c1.onnx").write_bytes(b"")
    result = CliRunner().invoke(app, ["validate-core", str(tmp_path / "core"), "--json"])
    assert result.exit_code == 1 and "FILE-EXTRA" in {f["rule"] for f in json.loads(result.stdout)["violations"]}


def test_late_read_through_an_alias(onnx_copy):
    """Reading a Reshape of the written input counts too: onnxruntime may run the Reshape as an alias."""
    def fn(model):
        shape = onnx.helper.make_tensor("flat_shape", onnx.TensorProto.INT64, [1], [-1])
        model.graph.initializer.append(shape)
        model.graph.node.extend([onnx.helper.make_node("Reshape", ["completion_logprobs", "flat_shape"], ["flat"]),
                                 onnx.helper.make_node("Neg", ["flat"], ["late_read"])])
    mutate(onnx_copy, fn)
    assert "ONNX-INPLACE" in onnx_rules(onnx_copy)
