"""Issue 50, the core side: nodes only torch.export.load refused, unbounded allocations, files outside the core.

Each hostile core here is refused by validate-core and by load_core (``ignition run``'s load) with the same rule
id, whether or not torch.export.load would have failed; no test waits on a FIFO or reads /dev/zero.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from _payloads import _model_json, rewrite
from ignition.runtime.core import CoreLoadError, load_core, read_manifest, without_autograd
from ignition.validate.core import validate_core

GRAPH = "graphs/decode.c1.pt2"


def rules(report) -> set[str]:
    return {v.rule for v in report.violations}


def _plant(core_copy, *nodes: dict, values: dict | None = None) -> None:
    """Prepend ``nodes`` (and their ``tensor_values``) to the decode graph's program and rehash it; ``FIRST_INPUT``
    in a node names the graph's first input."""
    def change(document):
        graph = document["graph_module"]["graph"]
        first_input = graph["inputs"][0]["as_tensor"]["name"]
        graph["nodes"][:0] = json.loads(json.dumps(list(nodes)).replace("FIRST_INPUT", first_input))
        graph["tensor_values"].update(values or {})
    path = core_copy.root / GRAPH
    path.write_bytes(rewrite(path.read_bytes(), _model_json(change)))
    core_copy.rehash(GRAPH)


def _refused_alike(root, rule: str) -> None:
    report = validate_core(root)
    assert rule in rules(report), report.violations
    with pytest.raises(CoreLoadError, match=rule):
        load_core(root)


def _node(target: str, inputs: list, outputs: list, name: str) -> dict:
    return {"target": target, "inputs": inputs, "outputs": outputs, "name": name, "metadata": {},
            "is_hop_single_tensor_return": None}


# -- finding 1: exact overloads, bounded shape arithmetic -----------------------------------------------
@pytest.mark.parametrize("attribute", ["__init__", "__setattr__"])
def test_an_attribute_of_an_allowed_packet_is_no_operator(core_copy, attribute):
    _plant(core_copy, _node(f"torch.ops.aten.slice_scatter.{attribute}", [], [], "planted"))
    _refused_alike(core_copy.root, "GRAPH-OPERATOR")


def test_an_unlisted_overload_of_an_allowed_packet_is_refused():
    from ignition.catalog.operators import operator_refusal, resolve_operator

    for target in ("torch.ops.aten.add.str", "torch.ops.aten.mul.left_t", "torch.ops.aten.slice_scatter.__init__"):
        assert "not one the recipes emit" in operator_refusal(target) and resolve_operator(target) is None
    found = resolve_operator("torch.ops.aten.add.Tensor")
    assert found is torch.ops.aten.add.Tensor and isinstance(found, torch._ops.OpOverload)
    assert resolve_operator("torch.ops.higher_order.cond") is torch.ops.higher_order.cond


def test_shape_arithmetic_takes_no_string_and_no_huge_literal(core_copy):
    planted = _node("_operator.mul", [{"name": "a", "arg": {"as_string": "A"}, "kind": 1},
                                      {"name": "b", "arg": {"as_int": 2**33}, "kind": 1}],
                    [{"as_sym_int": {"as_name": "planted_mul"}}], "planted_mul")
    _plant(core_copy, planted)
    report = validate_core(core_copy.root)
    assert rules(report) == {"PT2-PROGRAM"}, report.violations
    assert "'as_string': 'A'" in report.violations[0].message and "8589934592" in report.violations[1].message
    with pytest.raises(CoreLoadError, match="PT2-PROGRAM"):
        load_core(core_copy.root)


# -- finding 2: allocations bounded by the declared geometry; failures at run time are the core's ------------
def test_a_literal_allocation_beyond_the_geometry_is_refused(core_copy):
    planted = _node("torch.ops.aten.new_full.default",
                    [{"name": "self", "arg": {"as_tensor": {"name": "FIRST_INPUT"}}, "kind": 1},
                     {"name": "size", "arg": {"as_ints": [10**13]}, "kind": 1},
                     {"name": "fill_value", "arg": {"as_float": 1.0}, "kind": 1}],
                    [{"as_tensor": {"name": "planted_full"}}], "planted_full")
    meta = {"dtype": 7, "sizes": [{"as_int": 10**13}], "requires_grad": False, "device": {"type": "cpu", "index": None},
            "strides": [{"as_int": 1}], "storage_offset": {"as_int": 0}, "layout": 7}
    _plant(core_copy, planted, values={"planted_full": meta})
    report = validate_core(core_copy.root)  # torch.export.load reads it: the bound refuses it
    assert rules(report) == {"GRAPH-ALLOCATION"}, report.violations
    assert "10,000,000,000,000 elements" in report.violations[0].message
    with pytest.raises(CoreLoadError, match="GRAPH-ALLOCATION"):
        load_core(core_copy.root)


def test_a_constant_of_shape_bomb_in_an_onnx_graph_is_refused(toy_onnx_core, tmp_path):
    import shutil

    import onnx
    from onnx import helper

    from conftest import CoreCopy

    shutil.copytree(toy_onnx_core, tmp_path / "core")
    copy, graph = CoreCopy(tmp_path / "core"), "graphs/decode.c4.onnx"
    model = onnx.load(str(copy.root / graph), load_external_data=False)
    shape = helper.make_tensor("planted_shape", onnx.TensorProto.INT64, [1], [10**13])
    model.graph.node.insert(0, helper.make_node("Constant", [], ["planted_shape_value"], value=shape))
    model.graph.node.insert(1, helper.make_node("ConstantOfShape", ["planted_shape_value"], ["planted_bomb"],
                                                name="planted_bomb"))
    (copy.root / graph).write_bytes(model.SerializeToString())
    copy.rehash(graph)
    report = validate_core(copy.root)
    assert rules(report) == {"GRAPH-ALLOCATION"}, report.violations
    assert "node planted_bomb" in report.violations[0].where
    with pytest.raises(CoreLoadError, match="GRAPH-ALLOCATION"):
        load_core(copy.root, runtime="onnxruntime")


def test_an_honest_core_allocates_within_its_bound(toy_core):
    from ignition.validate.allocations import allocation_bound

    catalog = json.loads((toy_core / "catalog.json").read_text())
    assert all(allocation_bound(v) > 0 for v in catalog["variants"])
    assert validate_core(toy_core, torch_load=False).ok


def test_an_index_or_allocation_failure_in_a_graph_is_a_core_error():
    from ignition.runtime.verified import CoreRunError

    def index_error(buffers):
        return torch.zeros(3).index_select(0, torch.tensor([7]))

    def no_memory(buffers):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")

    for inner in (index_error, no_memory):
        with pytest.raises(CoreRunError, match="variant decode.c1: the core's graph failed"):
            without_autograd(inner, "decode.c1")({})

    def a_bug(buffers):
        raise RuntimeError("something else")
    with pytest.raises(RuntimeError, match="something else"):
        without_autograd(a_bug, "decode.c1")({})


# -- finding 7: GRAPH-MUTATION through list-returning views ----------------------------------------------
def test_a_write_through_unbind_and_getitem_reaches_the_placeholder():
    import operator

    from ignition.validate.graphs import _mutated_placeholders

    for view, args in ((torch.ops.aten.unbind.int, (0,)), (torch.ops.aten.split.Tensor, (1,)),
                       (torch.ops.aten.split_with_sizes.default, ([1, 1],))):
        graph = torch.fx.Graph()
        embed = graph.placeholder("embed")
        pieces = graph.call_function(view, (embed, *args))
        first = graph.call_function(operator.getitem, (pieces, 0))
        graph.call_function(torch.ops.aten.fill_.Scalar, (first, 0.0))
        graph.output(None)
        assert _mutated_placeholders(graph) == {"embed"}, view


# -- finding 3: core files read only as regular, listed files --------------------------------------------
def _finishes(call, seconds: float = 60.0):
    """``call()``'s result, or a failure when it has not returned in ``seconds`` (a FIFO read blocks forever)."""
    done: list = []

    def target():
        try:
            done.append((call(), None))
        except Exception as exc:  # raised again in the test's own thread
            done.append((None, exc))
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert done, f"{call} did not return in {seconds} s"
    if done[0][1] is not None:
        raise done[0][1]
    return done[0][0]


@pytest.fixture(scope="module")
def tokenized_core(tmp_path_factory):
    from tokenizers import Tokenizer, models

    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    source = tmp_path_factory.mktemp("tok")
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(source / "tokenizer.json"))
    core = tmp_path_factory.mktemp("tokcore") / "core"
    export_core(ExportOptions(recipe="toy", capacities=(1,), tokenizer=source), core)
    return core


@pytest.fixture
def tokenized_copy(tokenized_core, tmp_path):
    import shutil

    shutil.copytree(tokenized_core, tmp_path / "core")
    return tmp_path / "core"


def test_unlisted_fifos_and_device_links_in_the_tokenizer_are_never_read(tokenized_copy):
    os.mkfifo(tokenized_copy / "tokenizer/planted.json")
    os.symlink("/dev/zero", tokenized_copy / "tokenizer/zero.json")
    report = _finishes(lambda: validate_core(tokenized_copy, torch_load=False))
    assert {(v.rule, v.where) for v in report.violations} == {
        ("FILE-EXTRA", "tokenizer/planted.json"), ("FILE-EXTRA", "tokenizer/zero.json")}


def test_a_listed_tokenizer_file_that_is_a_fifo_or_a_link_is_refused(tokenized_copy):
    path = tokenized_copy / "tokenizer/tokenizer.json"
    path.unlink()
    os.mkfifo(path)
    report = _finishes(lambda: validate_core(tokenized_copy, torch_load=False))
    assert "FILE-REGULAR" in rules(report), report.violations
    path.unlink()
    os.symlink("/dev/zero", path)
    report = _finishes(lambda: validate_core(tokenized_copy, torch_load=False))
    assert rules(report) & {"FILE-REGULAR", "FILE-PATH"}, report.violations  # /dev/zero is outside the core


def test_a_manifest_fifo_neither_hangs_run_nor_validate(core_copy):
    manifest = core_copy.root / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    assert _finishes(lambda: read_manifest(core_copy.root)) is None
    assert "CORE-MISSING" in rules(_finishes(lambda: validate_core(core_copy.root)))

    def load():
        try:
            load_core(core_copy.root)
        except CoreLoadError as exc:
            return str(exc)
    assert "CORE-MISSING" in _finishes(load)


def test_a_device_as_trusted_key_is_a_usage_error(tmp_path):
    from ignition.catalog.signatures import SigningError, load_trusted_key

    with pytest.raises(SigningError, match="PEM file of at most"):
        _finishes(lambda: load_trusted_key("/dev/zero"))
    fifo = tmp_path / "key.pem"
    os.mkfifo(fifo)
    with pytest.raises(SigningError, match="PEM file of at most"):
        _finishes(lambda: load_trusted_key(fifo))


# -- exit codes: a core's failing graph exits 1, a device as --trusted-key 2 (docs/api.md) -----------------
def test_run_on_a_core_whose_graph_indexes_out_of_range_exits_1(core_copy):
    """``select`` of row 10**6 of the graph's first input: an IndexError raised by the core's own graph."""
    from test_cli_inputs import RUN, invoke

    planted = _node("torch.ops.aten.select.int", [{"name": "self", "arg": {"as_tensor": {"name": "FIRST_INPUT"}},
                                                   "kind": 1},
                                                  {"name": "dim", "arg": {"as_int": 0}, "kind": 1},
                                                  {"name": "index", "arg": {"as_int": 10**6}, "kind": 1}],
                    [{"as_tensor": {"name": "planted_row"}}], "planted_row")
    meta = {"dtype": 7, "sizes": [], "requires_grad": False, "device": {"type": "cpu", "index": None},
            "strides": [], "storage_offset": {"as_int": 0}, "layout": 7}
    _plant(core_copy, planted, values={"planted_row": meta})
    for graph in [v["graph"] for v in core_copy.load("catalog.json")["variants"] if v["graph"] != GRAPH]:
        path = core_copy.root / graph  # every variant indexes out of range: whichever runs first fails
        path.write_bytes(rewrite(path.read_bytes(), _model_json(lambda d: (
            d["graph_module"]["graph"]["nodes"].insert(0, json.loads(json.dumps(planted).replace(
                "FIRST_INPUT", d["graph_module"]["graph"]["inputs"][0]["as_tensor"]["name"]))),
            d["graph_module"]["graph"]["tensor_values"].update(planted_row=meta)))))
        core_copy.rehash(graph)
    code, output = invoke(["run", str(core_copy.root)] + RUN)  # loading folds the weight-only node
    assert code == 1 and "cannot load core: variant decode.c1: the core's graph failed: IndexError" in output, output
    code, output = invoke(["run", str(core_copy.root), "--no-pack-linears"] + RUN)  # the replay runs it
    assert code == 1 and "core error: variant" in output and "the core's graph failed" in output, output


def test_a_device_as_trusted_key_exits_2(toy_core):
    from test_cli_inputs import invoke

    code, output = invoke(["validate-core", str(toy_core), "--trusted-key", "/dev/zero"])
    assert code == 2 and "PEM file of at most" in output, output
