"""A BF16 or FP16 graph's batched products (attention's ``bmm``) on FP32 copies where the machine times that faster
(``runtime/backends/batched_products.py``, ``GemmPlan.batched_path``)."""

from __future__ import annotations

import json

import pytest
import torch

from ignition.runtime.backends import batched_products, gemm_calibration
from ignition.runtime.backends.batched_products import WIDENED, rewrite, widened_bmm
from ignition.runtime.backends.gemm_calibration import ATEN, GemmPlan, machine_key
from ignition.validate.graph_json import FACTS, TensorFacts


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch):
    monkeypatch.setattr(gemm_calibration, "quiet", lambda: True)


def _ulps(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|value - reference| in units of the BF16 spacing at the reference."""
    spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(reference.abs().clamp_min(1e-30))))
    return (value.double() - reference).abs() / spacing


@pytest.mark.parametrize("first, second", [((8, 2, 128), (8, 128, 300)), ((8, 2, 300), (8, 300, 128)),
                                           ((3, 5, 7), (3, 7, 11))])
def test_the_widened_product_rounds_the_fp32_sum_once_as_close_as_atens(first, second):
    generator = torch.Generator().manual_seed(sum(first) + sum(second))
    a, b = (torch.randn(shape, generator=generator).bfloat16() for shape in (first, second))
    exact = torch.bmm(a.double(), b.double())
    widened, aten = widened_bmm(a, b), torch.bmm(a, b)
    assert widened.dtype == torch.bfloat16 and widened.shape == aten.shape
    assert _ulps(widened, exact).max() <= 0.5 + 1e-3  # rounded once: within half a BF16 ulp of the exact sum
    assert (widened.float() - exact.float()).abs().mean() <= (aten.float() - exact.float()).abs().mean() * 1.02
    assert (widened.float() != aten.float()).float().mean() < 0.01  # only the order of an FP32 sum differs


def _graph(dtype: torch.dtype, window="s7"):
    graph = torch.fx.Graph()
    q, k = graph.placeholder("q"), graph.placeholder("k")
    q.meta[FACTS] = TensorFacts(dtype, (8, 2, 128))
    k.meta[FACTS] = TensorFacts(dtype, (8, 128, window))
    scores = graph.call_function(batched_products.BMM, (q, k))
    graph.output(scores)
    return graph, scores


class _Plan:
    def __init__(self, path):
        self.path, self.asked = path, []

    def batched_path(self, first, second, dtype):
        self.asked.append((first, second, dtype))
        return self.path


def test_the_rewrite_follows_the_plan_for_bf16_and_fp16_operands_only():
    graph, scores = _graph(torch.bfloat16)
    plan = _Plan(WIDENED)
    assert rewrite(graph, plan) == 1 and scores.target is widened_bmm
    assert plan.asked == [((8, 2, 128), (8, 128, "s7"), torch.bfloat16)]
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    a, b = torch.randn(8, 2, 128).bfloat16(), torch.randn(8, 128, 5).bfloat16()
    assert torch.equal(module(a, b), widened_bmm(a, b))
    graph, scores = _graph(torch.float16)
    assert rewrite(graph, _Plan(ATEN)) == 0 and scores.target is batched_products.BMM
    graph, scores = _graph(torch.float32)
    plan = _Plan(WIDENED)
    assert rewrite(graph, plan) == 0 and scores.target is batched_products.BMM and plan.asked == []


def test_the_plan_times_a_shape_once_caches_it_and_forced_modes_time_nothing(tmp_path, monkeypatch):
    calls = []

    def timed(first, second, dtype):
        calls.append((first, second, dtype))
        return {"batched": {WIDENED: 1e-4, ATEN: 3e-4}}
    monkeypatch.setattr(gemm_calibration, "time_batched", timed)
    cache = tmp_path / "gemm.json"
    plan = GemmPlan("calibrate", cache=cache)
    assert plan.batched_path((8, 2, 128), (8, 128, "s3"), torch.bfloat16) == WIDENED
    assert plan.batched_path((8, 2, 128), (8, 128, "s9"), torch.bfloat16) == WIDENED  # one window extent as timed
    assert calls == [((8, 2, 128), (8, 128, gemm_calibration.WINDOW_PROBE), torch.bfloat16)]
    key = f"bmm bfloat16 8x2x128 @ 8x128x{gemm_calibration.WINDOW_PROBE}"
    assert json.loads(cache.read_text())["machines"][machine_key()][key]["choice"] == WIDENED
    assert GemmPlan("calibrate", cache=cache).batched_path((8, 2, 128), (8, 128, "s1"), torch.bfloat16) == WIDENED
    assert len(calls) == 1  # the next load reads the cache
    for mode in ("aten", "packed", "blocked"):
        assert GemmPlan(mode, cache=cache).batched_path((4, 2, 64), (4, 64, 9), torch.bfloat16) == ATEN
    assert GemmPlan("calibrate", cache=cache).batched_path((4, 2, 64), (4, 64, 9), torch.float32) == ATEN
    assert len(calls) == 1


def test_the_timing_runs_both_forms_on_this_machine():
    timings = gemm_calibration.time_batched((4, 2, 64), (4, 64, 32), torch.bfloat16)
    assert set(timings["batched"]) == {WIDENED, ATEN} and all(s > 0 for s in timings["batched"].values())


def test_a_bf16_core_with_widened_attention_strays_from_fp32_no_further_than_with_atens(tmp_path_factory,
                                                                                        monkeypatch):
    """BF16 fidelity of a whole core: its prompt logprobs' deviation from the same weights' FP32 core, every
    attention product widened (on any machine), is no larger than with ``torch.bmm`` in BF16 (2% on the mean, one
    BF16 ulp of the largest logprob at worst); the linears on ``aten.linear`` both ways."""
    from ignition.runtime.core import load_core
    from tests._decoder_cores import bf16_cores_with_fp32_reference, prompt_scores

    bf16, fp32, prompts = bf16_cores_with_fp32_reference(tmp_path_factory.mktemp("widened_bf16"))

    def scores(core) -> torch.Tensor:
        return prompt_scores(core, prompts)

    def widened(core) -> int:
        return sum(n.target is widened_bmm for v in core.variants.values() for n in v.runner.graph_module.graph.nodes)

    reference = scores(load_core(fp32, pack_linears=False))
    monkeypatch.setattr(GemmPlan, "path", lambda self, shape, dtype, layouts=(), blocked=False: ATEN)
    monkeypatch.setattr(GemmPlan, "batched_path", lambda self, first, second, dtype: ATEN)
    bf16_core = load_core(bf16)
    assert widened(bf16_core) == 0
    theirs = (scores(bf16_core) - reference).abs()
    monkeypatch.setattr(GemmPlan, "batched_path", lambda self, first, second, dtype: WIDENED)
    widened_core = load_core(bf16)
    assert widened(widened_core) >= 2 * len(widened_core.variants)  # scores and mix, in every variant
    ours = (scores(widened_core) - reference).abs()
    assert float(ours.mean()) <= 1.02 * float(theirs.mean()), (float(ours.mean()), float(theirs.mean()))
    assert float(ours.max()) <= float(theirs.max()) + float(reference.abs().max()) * 2.0 ** -7
