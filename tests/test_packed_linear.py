"""runtime/backends/packed_linear.py: on the CPU, every linear on a large FP32 weight, and on a large BF16 one where
the packed product keeps ``aten.linear``'s bits, runs on that weight packed once for oneDNN; the packs are shared
across variants, the raw copies no graph reads are released, and the numbers are the unpacked core's up to FP32
summation order (BF16: the same bits). The tiny cores' weights are under ``PACK_MIN_ELEMENTS``, so the
tests that pack them lower it; ``tests/test_decode_copies.py`` replays a real-width core at the default."""

from __future__ import annotations

import json
import mmap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ignition.catalog.enums import Role
from ignition.runtime.backends import blocked_linear, direct_calls, packed_linear
from ignition.runtime.backends.gemm_calibration import ATEN, PACK_LAYOUTS, GemmPlan, packed_path
from ignition.runtime.backends.packed_linear import PACKED_TARGET, packing_available
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.host_memory import release_pages
from ignition.runtime.options import LoadOptions
from ignition.runtime.requests import Request

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linear")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def decoder_core(request, tmp_path_factory):
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("packed")
    save_checkpoint(TinyCase("qwen3", request.param, True, 300), root / "ckpt")  # tied: the LM head is the embedding
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=16,
                              max_seq_len=64), root / "core")
    return root / "core"


def _linears(core) -> dict[str, list]:
    """Variant -> the targets of its linear calls (aten's or oneDNN's; the row-parallel leaves are ``_leaves``)."""
    return {name: [str(direct_calls.overload(n)) for n in v.runner.graph_module.graph.nodes
                   if n.op == "call_function" and isinstance(direct_calls.overload(n), torch._ops.OpOverload)
                   and "linear" in str(direct_calls.overload(n))] for name, v in core.variants.items()}


def _words(results) -> list[tuple[list[int], torch.Tensor]]:
    return [([e.id for e in r.entries], torch.tensor([e.logprob for e in r.entries])) for r in results]


def _requests() -> list[Request]:
    return [Request([i + 1, 7, 9, 11 + i], max_tokens=6, logprobs=5, ignore_eos=True) for i in range(5)]


@pytest.fixture
def pack_tiny(monkeypatch):
    """The tiny cores' weights packed as a real model's are where the packed product is allowed: under no size
    floor, and as ``gemm="packed"`` forces, whatever this CPU's calibration would pick for their tiny shapes."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(GemmPlan, "path", lambda self, shape, dtype, layouts=PACK_LAYOUTS, blocked=False:
                        packed_path(max(layouts)) if self.mode != ATEN and layouts else ATEN)


def _dtype(core) -> str:
    return core.manifest["model"]["dtype"]


def test_small_weights_keep_atens_linear(decoder_core):
    core = load_core(decoder_core)  # every weight under PACK_MIN_ELEMENTS
    assert all(set(targets) == {"aten.linear.default"} for targets in _linears(core).values())
    assert not any(tensor.is_mkldnn for tensor in core.weights.values())


def test_bf16_weights_are_packed_only_where_the_packed_product_keeps_atens_bits(decoder_core, pack_tiny, monkeypatch):
    if _dtype(load_core(decoder_core, pack_linears=False)) != "bfloat16":
        pytest.skip("FP32 weights are packed wherever oneDNN is")
    packed = any(target == PACKED_TARGET for targets in _linears(load_core(decoder_core)).values()
                 for target in targets)
    assert packed is bool(packed_linear.pack_layouts(torch.bfloat16))
    assert packed_linear.pack_layouts(torch.bfloat16) == tuple(
        layout for layout in PACK_LAYOUTS if packed_linear.keeps_bits(torch.bfloat16, layout))
    monkeypatch.setattr(packed_linear, "keeps_bits", lambda dtype, layout: False)  # kernels that round otherwise
    assert all(set(targets) == {"aten.linear.default"} for targets in _linears(load_core(decoder_core)).values())


@pytest.mark.parametrize("order", ["fp32 matmul", "reversed", "strided"])
def test_the_bit_probe_fails_a_product_summed_in_another_order(monkeypatch, order):
    """``keeps_bits`` against ``aten.linear`` replaced by the same BF16 product summed in another FP32 order: the
    probe must notice (the orders that packing would bring are of this kind)."""
    plain = torch.nn.functional.linear
    other = {"fp32 matmul": lambda x, w: x.float() @ w.float().t(),
             "reversed": lambda x, w: x.float().flip(1) @ w.float().flip(1).t(),
             "strided": lambda x, w: sum(x.float()[:, i::4] @ w.float()[:, i::4].t() for i in range(4))}[order]
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: (other(x, w) + (0 if b is None else b.float())).to(x.dtype))
    assert not any(packed_linear.keeps_bits.__wrapped__(torch.bfloat16, layout) for layout in PACK_LAYOUTS)
    monkeypatch.setattr(torch.nn.functional, "linear", plain)
    assert packed_linear.keeps_bits.__wrapped__(torch.bfloat16) is packed_linear.keeps_bits(torch.bfloat16)


def test_the_bit_probe_says_no_where_onednn_cannot_pack_the_dtype(monkeypatch):
    def unsupported(weight, rows_hint):  # what oneDNN raises on a CPU without BF16 instructions
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw, avx512vl and "
                           "avx512dq")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", unsupported)
    assert packed_linear.keeps_bits.__wrapped__(torch.bfloat16) is False


def test_every_weight_linear_runs_packed_and_each_weight_is_packed_once(decoder_core, pack_tiny):
    packed, plain = load_core(decoder_core), load_core(decoder_core, pack_linears=False)
    if not packed_linear.packs_dtype(getattr(torch, _dtype(packed))):
        pytest.skip("this machine's packed BF16 product rounds otherwise than aten.linear: BF16 weights not packed")
    for name, targets in _linears(plain).items():
        assert targets and set(targets) == {"aten.linear.default"}, name
        assert _linears(packed)[name] == [PACKED_TARGET] * len(targets), name
    constants = {}
    for variant in packed.variants.values():
        for attribute, tensor in variant.runner.graph_module.named_buffers():
            if attribute.startswith("_packed_"):
                assert tensor.is_mkldnn or tensor.dim() == 3  # oneDNN's, or a row-parallel weight's blocked pack
                assert constants.setdefault(attribute, tensor) is tensor  # one pack, every variant's graph
    released = {name for name, tensor in packed.weights.items() if tensor.is_mkldnn or tensor.dim() == 3}
    assert len(released) == len(constants) - 1  # the tied embedding is packed for the LM head, kept raw
    embedding = next(name for name in packed.weights if "embed" in name)
    assert not packed.weights[embedding].is_mkldnn
    torch.testing.assert_close(packed.weights[embedding], plain.weights[embedding], rtol=0, atol=0)
    for variant in packed.variants.values():  # the graphs get the packed tensor for a released weight's argument
        for arg in variant.arguments:
            if arg.role is Role.WEIGHT:
                assert variant.buffers[arg.name] is packed.weights[arg.name]


def test_packed_and_plain_cores_agree(decoder_core, pack_tiny):
    packed = _words(Engine(load_core(decoder_core)).generate(_requests()))
    plain = _words(Engine(load_core(decoder_core, pack_linears=False)).generate(_requests()))
    exact = _dtype(load_core(decoder_core, pack_linears=False)) == "bfloat16"  # packed only where the bits agree
    for (ids, logprobs), (plain_ids, plain_logprobs) in zip(packed, plain):
        assert ids == plain_ids  # FP32 logits differ in summation order only
        torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=0 if exact else 2e-5)


def test_the_choice_is_made_once_and_travels_to_worker_ranks():
    assert LoadOptions.create("cpu").pack_linears is True
    options = LoadOptions.create("cpu", pack_linears=False)
    assert LoadOptions.from_json(options.to_json()).pack_linears is False


def test_release_pages_returns_whole_inner_pages_and_keeps_the_neighbours():
    page = mmap.PAGESIZE
    buffer = torch.ones(64 * page, dtype=torch.uint8)
    start = (-buffer.data_ptr()) % page + page // 2  # half a page in: the edges share pages with neighbours
    view = buffer[start:start + 8 * page]
    assert release_pages(view) == 7 * page
    inner = (-view.data_ptr()) % page
    assert int(view[inner:inner + 7 * page].sum()) == 0  # released pages read as zeros
    assert bool((view[:inner] == 1).all()) and bool((view[inner + 7 * page:] == 1).all())
    assert bool((buffer[:start] == 1).all()) and bool((buffer[start + 8 * page:] == 1).all())


def test_run_and_serve_take_the_choice_from_the_command_line(toy_core, monkeypatch):
    from typer.testing import CliRunner

    import ignition.cli as cli
    from ignition.cli import loading

    assert loading.load_options("cpu", False, False, None, pack_linears=False).pack_linears is False
    assert loading.load_options("cpu", False, False, None).pack_linears is True
    seen = []
    real_load = loading.load
    monkeypatch.setattr(loading, "load", lambda core, options: seen.append(options) or real_load(core, options))
    result = CliRunner().invoke(cli.app, ["run", str(toy_core), "--prompt-ids", "1,2", "--max-tokens", "1",
                                          "--device", "cpu", "--no-pack-linears"])
    assert result.exit_code == 0, result.output
    assert [options.pack_linears for options in seen] == [False]


def test_the_tied_lm_head_reads_the_packed_copy_at_every_row_count(decoder_core, pack_tiny):
    """The tied embedding stays raw for the lookup, and every LM-head product, one row included, reads its packed
    copy: one row reads the blocked layout faster than the plain one (``benchmarks.row_layouts``: 10.3 ms against
    16.8 FP32, 8.7 against 21.2 BF16 on the Zen 5 machine)."""
    core = load_core(decoder_core)
    if not packed_linear.packs_dtype(getattr(torch, _dtype(core))):
        pytest.skip("this machine's packed BF16 product rounds otherwise than aten.linear: BF16 weights not packed")
    embedding = next(name for name in core.weights if "embed" in name)
    for name, variant in core.variants.items():
        graph = variant.runner.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        weight = placeholders[variant.runner.names.index(embedding)]
        assert weight.users, name  # the lookup
        assert not any(str(user.target) == PACKED_TARGET for user in weight.users), name
        heads = [n for n in graph.nodes if n.op == "call_function" and str(n.target) == PACKED_TARGET
                 and n.args[1].op == "get_attr"
                 and getattr(variant.runner.graph_module, n.args[1].target).shape == core.weights[embedding].shape]
        assert heads, name

def _program(build) -> "StaticProgram":
    """A one-weight program (``w``, an FP32 [4, 6] weight argument) whose body ``build(graph, w)`` writes."""
    from torch.utils import _pytree as pytree

    from ignition.validate.program_reader import StaticProgram

    graph = torch.fx.Graph()
    weight = graph.placeholder("w")
    graph.output(build(graph, weight))
    return StaticProgram(root=torch.nn.Module(), graph=graph, argument_names=["w"], user_inputs=["w"],
                         user_outputs=["out"], bounds={}, out_spec=pytree.tree_flatten(torch.zeros(1))[1])


def test_weight_only_nodes_become_constants_computed_once():
    from ignition.catalog.model import BufferDecl
    from ignition.runtime.backends.weight_constants import WeightConstants

    aten = torch.ops.aten
    decl = BufferDecl("w", "float32", [4, 6], Role.WEIGHT)
    weight = torch.randn(4, 6)
    constants, programs = WeightConstants(), []
    for _ in range(2):  # two graphs with the same expression share one constant
        program = _program(lambda graph, w: graph.call_function(aten.mul.Tensor, (graph.call_function(
            aten.permute.default, (graph.call_function(aten.view.default, (w, [2, 2, 6])), [2, 0, 1])), 2.0)))
        assert constants.rewrite(program, {next(iter(program.graph.nodes)): "w"}, {"w": decl}) == 2
        programs.append(program)
    constants.finish({"w": weight})
    for program in programs:
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert targets == ["aten.mul.Tensor"]
        assert torch.equal(program.module()({"w": weight}), weight.view(2, 2, 6).permute(2, 0, 1) * 2)
    first, second = (p.graph_module._weight_constant_0 for p in programs)
    assert first is second and first.data_ptr() == weight.data_ptr()  # a view of the weight, not a copy


def test_a_graph_that_writes_a_weight_only_node_is_left_as_it_is():
    from ignition.catalog.model import BufferDecl
    from ignition.runtime.backends.weight_constants import WeightConstants

    aten = torch.ops.aten
    program = _program(lambda graph, w: graph.call_function(
        aten.add_.Tensor, (graph.call_function(aten.view.default, (w, [24])), 1.0)))
    constants = WeightConstants()
    assert constants.rewrite(program, {next(iter(program.graph.nodes)): "w"},
                             {"w": BufferDecl("w", "float32", [4, 6], Role.WEIGHT)}) == 0
    assert [str(n.target) for n in program.graph.nodes if n.op == "call_function"] == \
        ["aten.view.default", "aten.add_.Tensor"]


def test_loaded_graphs_compute_nothing_from_weights_alone_and_keep_their_numbers(decoder_core, monkeypatch):
    from ignition.runtime.backends.weight_constants import FOLDED_TARGETS, WeightConstants

    folded = load_core(decoder_core)
    weights = {name for v in folded.variants.values() for name, decl in zip(v.buffers, v.arguments)
               if decl.role is Role.WEIGHT}
    constants = 0
    for variant in folded.variants.values():
        graph = variant.runner.graph_module.graph
        placeholders = {n for n, name in zip((n for n in graph.nodes if n.op == "placeholder"), variant.buffers)
                        if name in weights}
        assert not [n for n in graph.nodes if n.op == "call_function" and direct_calls.overload(n) in FOLDED_TARGETS
                    and n.all_input_nodes and set(n.all_input_nodes) <= placeholders], variant.name
        constants += sum(1 for n in graph.nodes if n.op == "get_attr" and n.target.startswith("_weight_constant_"))
    assert constants > 0  # qwen3's q/k norm scales, at least
    monkeypatch.setattr(WeightConstants, "rewrite", lambda *args: 0)
    plain = load_core(decoder_core)
    for (ids, logprobs), (plain_ids, plain_logprobs) in zip(_words(Engine(folded).generate(_requests())),
                                                             _words(Engine(plain).generate(_requests())), strict=True):
        assert ids == plain_ids and torch.equal(logprobs, plain_logprobs)  # the same operators on the same values


def _linear_program(raw_read: bool, packed: bool = True) -> "StaticProgram":
    """A program over ``x`` [2, 6] and the weight ``w`` [4, 6]: ``linear(x, w)`` when ``packed``, plus ``w``'s sum
    (the weight read raw) when ``raw_read``."""
    from torch.utils import _pytree as pytree

    from ignition.validate.program_reader import StaticProgram

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    out = graph.call_function(aten.linear.default, (x, w)) if packed else graph.call_function(aten.mul.Tensor, (x, 1.0))
    if raw_read:
        out = graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.sum.default, (w,))))
    graph.output((out,))
    return StaticProgram(root=torch.nn.Module(), graph=graph, argument_names=["x", "w"], user_inputs=["x", "w"],
                         user_outputs=["out"], bounds={}, out_spec=pytree.tree_flatten((torch.zeros(1),))[1])


def _decls():
    from ignition.catalog.model import BufferDecl

    return [BufferDecl("x", "float32", [2, 6], Role.INPUT), BufferDecl("w", "float32", [4, 6], Role.WEIGHT)]


def _entry():
    from ignition.runtime.weights import TensorEntry

    return TensorEntry("w", torch.float32, (4, 6), 0, 96)


@pytest.mark.parametrize("later_raw", [False, True], ids=["packed only", "a later graph reads it raw"])
def test_a_weight_the_first_graph_reads_only_packed_streams_and_a_later_raw_read_gets_its_exact_bytes(later_raw):
    packs = packed_linear.LinearPacks(min_elements=0, gemm=GemmPlan("packed"))
    first, second = _linear_program(raw_read=False), _linear_program(raw_read=later_raw)
    packs.rewrite(first, _decls())
    weight, x = torch.randn(4, 6), torch.randn(2, 6)
    assert packs.streams(_entry())
    scratch = weight.clone()
    packs.pack(_entry(), scratch).result()
    scratch.fill_(float("nan"))  # the reader reuses its scratch once the pack is done
    packs.rewrite(second, _decls())
    weights = packs.streamed_weights()
    assert weights["w"].is_mkldnn
    packs.start(weights)
    assert weights["w"].is_mkldnn is not later_raw
    if later_raw:  # the reorder undone, bit for bit
        assert torch.equal(weights["w"], weight) and weights["w"].is_contiguous()
    packs.finish(weights, [])
    for program in (first, second):
        expected = torch.nn.functional.linear(x, weight) + (weight.sum() if program is second and later_raw else 0)
        torch.testing.assert_close(program.module()({"x": x, "w": weights["w"]})[0], expected, rtol=1e-6, atol=1e-6)


def test_a_weight_the_first_graph_reads_raw_is_read_raw_and_packed_from_there():
    packs = packed_linear.LinearPacks(min_elements=0, gemm=GemmPlan("packed"))
    packs.rewrite(_linear_program(raw_read=True), _decls())  # the tied embedding's case: packed and looked up
    assert not packs.streams(_entry())
    weight = torch.randn(4, 6)
    packs.read(_entry(), weight)
    assert "w" in packs.reorders and not packs.streamed  # packed from its own memory at once
    packs.start({"w": weight})
    packs.finish(weights := {"w": weight}, [])
    assert weights["w"] is weight  # a graph reads it raw: it stays


def test_a_weight_only_a_later_graph_multiplies_by_is_packed_from_its_raw_copy_after_the_graphs():
    packs = packed_linear.LinearPacks(min_elements=0, gemm=GemmPlan("packed"))
    packs.rewrite(_linear_program(raw_read=False, packed=False), _decls())  # the first graph does not read w
    assert not packs.streams(_entry())
    weight = torch.randn(4, 6)
    packs.read(_entry(), weight)
    assert not packs.reorders
    packs.rewrite(second := _linear_program(raw_read=False), _decls())
    weights = {"w": weight.clone()}
    packs.start(weights)
    assert packs.finish(weights, []) == ["w"] and weights["w"].is_mkldnn
    x = torch.randn(2, 6)
    torch.testing.assert_close(second.module()({"x": x, "w": weights["w"]})[0], torch.nn.functional.linear(x, weight),
                               rtol=1e-6, atol=1e-6)


def test_the_reader_does_not_wait_when_no_graph_says_what_to_pack():
    """``decline`` (a backend that packs nothing, or a graph that failed to load) lets a waiting reader go on raw."""
    packs = packed_linear.LinearPacks(min_elements=0, gemm=GemmPlan("packed"))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(packs.streams, _entry())
        packs.decline()
        assert waiting.result(timeout=10) is False
    packs.rewrite(_linear_program(raw_read=False), _decls())  # a graph after the decline changes nothing read
    assert not packs.streams(_entry())


def test_streamed_loads_keep_no_raw_copy_of_a_projection(decoder_core, pack_tiny, monkeypatch):
    """A loaded core's projections were packed from scratch as the file was read: no raw copy of them exists, and
    the tied embedding, which the lookup reads, was read raw."""
    if not packed_linear.packs_dtype(getattr(torch, _dtype(load_core(decoder_core, pack_linears=False)))):
        pytest.skip("this machine's packed BF16 product rounds otherwise than aten.linear: BF16 weights not packed")
    seen = []
    real_init = packed_linear.LinearPacks.__init__
    monkeypatch.setattr(packed_linear.LinearPacks, "__init__",
                        lambda self, *a, **k: (real_init(self, *a, **k), seen.append(self))[0])
    core = load_core(decoder_core)
    (packs,) = seen
    released = {name for name, tensor in core.weights.items() if tensor.is_mkldnn or tensor.dim() == 3}
    assert released and set(packs.streamed) == released  # oneDNN's packs and the row-parallel weights' blocked ones
    embedding = next(name for name in core.weights if "embed" in name)
    assert embedding in packs.reorders and embedding not in packs.streamed


def _leaves(core) -> dict[str, tuple[int, int]]:
    """Variant -> (its calls of the blocked leaves, summed or not, its ``bmm`` calls on a weight's leaves: a view of
    the weight folded into a constant, ``weight_constants.py``)."""
    counts = {}
    for name, variant in core.variants.items():
        nodes = [n for n in variant.runner.graph_module.graph.nodes if n.op == "call_function"]
        counts[name] = (sum(n.target in (blocked_linear.graph_leaves, blocked_linear.graph_row_linear) for n in nodes),
                        sum(n.target is torch.ops.aten.bmm.default and n.args[1].op == "get_attr" for n in nodes))
    return counts


@pytest.mark.skipif(blocked_linear.unavailable() is not None, reason="the blocked product cannot be built here")
def test_row_parallel_leaves_run_on_the_blocked_product_whatever_their_size(decoder_core):
    """o_proj's and down_proj's reduction leaves (``row_linear``: one ``bmm`` over views of the weight) run as
    ``ignition::blocked_leaves`` on the blocked pack of the weight at every size (a tensor-parallel rank's shard must
    get the single rank's leaves), the raw weights released; the logprobs are the unrewritten core's to FP32 order.
    ``--gemm packed`` keeps the batched product."""
    plain = load_core(decoder_core, pack_linears=False)
    if _dtype(plain) != "float32":
        pytest.skip("row_linear splits FP32 weights only")
    layers = plain.manifest["model"]["num_layers"]
    core = load_core(decoder_core)  # every weight under PACK_MIN_ELEMENTS: only the leaves are rewritten
    assert set(_leaves(core).values()) == {(2 * layers, 0)}
    for name, tensor in core.weights.items():
        if name.endswith(("o_proj", "down_proj")):
            assert tensor.shape == (-(-plain.weights[name].shape[0] // 16), plain.weights[name].shape[1], 16), name
            assert torch.equal(blocked_linear.unpack(tensor, plain.weights[name].shape[0]), plain.weights[name])
    for (ids, logprobs), (plain_ids, plain_logprobs) in zip(_words(Engine(core).generate(_requests())),
                                                            _words(Engine(plain).generate(_requests())), strict=True):
        assert ids == plain_ids
        torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=2e-5)
    assert set(_leaves(load_core(decoder_core, gemm="packed")).values()) == {(0, 2 * layers)}


def test_the_packed_graphs_call_bindings_that_dispatch_as_their_overloads(decoder_core):
    """Qwen3 in FP32 and BF16 with its linears packed: the rewrite onto torch's Python bindings
    (runtime/backends/direct_calls.py) keeps every operator call and every bit of each variant."""
    from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads

    core = load_core(decoder_core)
    Engine(core).generate(_requests())
    assert assert_direct_calls_dispatch_as_overloads(core) > 0
