"""Routed experts: each expert runs only on the rows routed to it (``recipes/moe.py``'s sorted dispatch).

The oracle for the block is transformers' eager expert loop (gather an expert's rows, run it,
``index_add_`` the weighted result, experts ascending); for the whole decoder it is transformers
itself. An expert the router can never pick holds NaN weights: any form that multiplies an
unrouted expert's output by a zero weight (NaN * 0 = NaN) fails, the routed one must not.
"""

from __future__ import annotations

import pytest
import torch

from ignition.recipes.checkpoint import open_checkpoint, read_config
from ignition.recipes.deepseek_v3 import FAMILY as DEEPSEEK_V3
from ignition.recipes.layers import Rows, gated_mlp
from ignition.recipes.llama import FAMILIES
from ignition.recipes.moe import ROUTERS, MoeConfig, capacities, moe_block
from ignition.recipes.transformer import lm_head_logits
from ignition.recipes.weights import load_weights
from test_moe_recipes import TOL, load_example

DECODER_FAMILIES = {"qwen3_moe": FAMILIES["qwen3_moe"], "deepseek_v3": DEEPSEEK_V3}
NEVER = 7  # the expert the router is biased against, of the example's 8
VOCAB, CHUNK = 320, 8


def transformers_experts(weights, prefix: str, moe: MoeConfig, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' eager loop over the experts some row picked (``Qwen3MoeExperts.forward``)."""
    top_experts, top_weights = ROUTERS[moe.router](weights, prefix, moe, hidden)
    out = torch.zeros_like(hidden)
    for expert in range(moe.num_experts):
        rows, choice = torch.where(top_experts == expert)
        if rows.numel():
            name = f"{prefix}experts.{expert}."
            result = gated_mlp(hidden[rows], weights[name + "gate_proj"], weights[name + "up_proj"],
                               weights[name + "down_proj"])
            out.index_add_(0, rows, (result * top_weights[rows, choice, None]).to(out.dtype))
    return out


def skewed_block(experts: int = 16, hidden: int = 24, intermediate: int = 12):
    """One DeepSeek-style block whose score-correction bias makes expert 0 every row's pick, the next few
    common, the rest rare, and the last one impossible; the last expert's weights are NaN."""
    moe = MoeConfig(router="grouped_sigmoid_topk", num_experts=experts, experts_per_token=3,
                    intermediate_size=intermediate, sparse_layers=(0,), norm_topk_prob=True)
    generator = torch.Generator().manual_seed(4)
    bias = torch.cat([torch.tensor([9.0]), torch.linspace(1.5, -1.5, experts - 2), torch.tensor([-9.0])])
    weights = {"router": torch.randn(experts, hidden, generator=generator), "router_bias": bias}
    for expert in range(experts):
        for name, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                            ("down_proj", (hidden, intermediate))):
            weights[f"experts.{expert}.{name}"] = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    for name in ("gate_proj", "up_proj", "down_proj"):
        weights[f"experts.{experts - 1}.{name}"].fill_(float("nan"))
    return moe, weights, generator


def test_capacity_ladder() -> None:
    assert capacities(1) == (1,) and capacities(2) == (1, 2) and capacities(15) == (1, 15)
    assert capacities(31) == (1, 15, 31)
    assert capacities(32) == (1, 8, 16, 32) and capacities(130) == (1, 8, 16, 32, 65, 130)
    assert capacities(512) == (1, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("rows", [1, 3, 8, 40, 112])
def test_routed_block_matches_transformers_expert_loop(rows: int) -> None:
    """Every rung of the capacity ladder (segments of 1 row up to all rows) against the eager oracle."""
    moe, weights, generator = skewed_block()
    hidden = torch.randn(rows, 24, generator=generator)
    with torch.no_grad():
        counts = torch.bincount(ROUTERS[moe.router](weights, "", moe, hidden)[0].flatten(), minlength=16)
        ours, oracle = moe_block(weights, "", moe, hidden), transformers_experts(weights, "", moe, hidden)
    assert counts[0] == rows and counts[-1] == 0  # the bias works: expert 0 always, the NaN expert never
    ladder = (0,) + capacities(rows)
    used = {next(i for i, capacity in enumerate(ladder) if count <= capacity) for count in counts.tolist()}
    assert used == set(range(len(ladder))), (counts.tolist(), ladder)  # skipped experts and every rung ran
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, oracle, atol=1e-6, rtol=1e-6)


def plant_unpickable_nan_expert(hf, recipe: str) -> None:
    """Expert ``NEVER`` of every MoE layer gets NaN weights and a router that can never pick it.

    DeepSeek-V3: a -1e4 score-correction bias. Qwen3-MoE (no bias): its router row is zero (logit 0)
    and experts 0..5 come in pairs of opposite rows, so for any hidden state three of them score
    >= 0 (almost surely > 0) and the top 2 never include it.
    """
    with torch.no_grad():
        for layer in hf.model.layers:
            mlp = layer.mlp
            if not hasattr(mlp, "experts"):
                continue
            mlp.experts.gate_up_proj[NEVER] = float("nan")
            mlp.experts.down_proj[NEVER] = float("nan")
            if recipe == "deepseek_v3":
                mlp.gate.e_score_correction_bias[NEVER] = -1e4
            else:
                router = mlp.gate.weight
                router[1:6:2] = -router[0:6:2]
                router[NEVER] = 0.0


@pytest.mark.parametrize("recipe", ["qwen3_moe", "deepseek_v3"])
def test_an_expert_never_routed_to_never_touches_the_output(tmp_path, recipe: str) -> None:
    """NaN weights in an expert the router cannot pick: prefill and batched decode logits equal transformers'."""
    hf = load_example().build_model(recipe, VOCAB, 0, torch.float32, seed=3).eval()
    plant_unpickable_nan_expert(hf, recipe)
    hf.save_pretrained(tmp_path)
    family = DECODER_FAMILIES[recipe]
    cfg = family.parse(read_config(tmp_path), "config.json")
    weights = load_weights(open_checkpoint(tmp_path), cfg, family.weight_map)
    assert all(torch.isnan(weights[f"layers.{layer}.experts.{NEVER}.down_proj"]).all() for layer in cfg.moe_layers)
    caches = {name: torch.zeros(shape, dtype=cfg.dtype) for name, shape in cfg.cache_shapes(2, 32).items()}
    sequence = torch.randint(0, VOCAB, (CHUNK + 2,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        reference = hf(sequence[None]).logits[0]
        assert torch.isfinite(reference).all()  # transformers runs only picked experts: NEVER was never picked
        rows = Rows.prefill(CHUNK, torch.tensor([0]), torch.tensor([CHUNK]), torch.tensor([1]))
        logits = lm_head_logits(weights, cfg, family.decoder(weights, cfg, sequence[:CHUNK], rows, caches))
        torch.testing.assert_close(logits, reference[:CHUNK], atol=TOL, rtol=0)
        for position in (CHUNK, CHUNK + 1):  # lane 1 is inactive and routes a junk row
            rows = Rows.decode(torch.tensor([position, 0]), torch.tensor([1, 0]), torch.tensor([True, False]))
            input_ids = torch.tensor([int(sequence[position]), 3])
            logits = lm_head_logits(weights, cfg, family.decoder(weights, cfg, input_ids, rows, caches))
            torch.testing.assert_close(logits[0], reference[position], atol=TOL, rtol=0)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own pytree, as onnx_export filters it
def test_routed_block_converts_to_onnx_and_onnxruntime_agrees() -> None:
    """The static graph (sort, nested conds) survives torch.export and torch.onnx: ``--onnx`` cores keep MoE."""
    import onnxruntime

    moe, weights, generator = skewed_block(experts=6, hidden=16, intermediate=8)
    hidden = torch.randn(8, 16, generator=generator)  # rungs (1, 8): the skip, both rungs and their nesting

    class Block(torch.nn.Module):
        def forward(self, x):
            return moe_block(weights, "", moe, x)

    with torch.no_grad():
        expected = moe_block(weights, "", moe, hidden)
        program = torch.export.export(Block(), (hidden,), strict=False)
        converted = torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=False, verbose=False)
    session = onnxruntime.InferenceSession(converted.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: hidden.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-5, rtol=1e-5)
