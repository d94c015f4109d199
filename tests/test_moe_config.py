"""MoE configs and checkpoints: HF's layer rules, rejected values naming their field, a missing expert refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.checkpoint import CheckpointError
from ignition.recipes.config import ModelConfig
from ignition.recipes.deepseek_v3 import DeepseekV3Config
from ignition.recipes.registry import build_recipe

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_moe.py"
MISSING = "model.layers.2.mlp.experts.5.up_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("make_tiny_moe", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    root = tmp_path_factory.mktemp("moe-config")
    return {recipe: example.make_checkpoint(root / recipe, recipe) for recipe in ("qwen3_moe", "deepseek_v3")}


def config_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "config.json").read_text())


@pytest.mark.parametrize(("step", "mlp_only"), [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_qwen3_moe_sparse_layers_follow_transformers(step: int, mlp_only: list[int]) -> None:
    hf_config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                               num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                               num_experts=4, num_experts_per_tok=2, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    hf_config.architectures = ["Qwen3MoeForCausalLM"]
    hf = Qwen3MoeForCausalLM(hf_config)
    sparse = tuple(i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))
    cfg = ModelConfig.from_hf_config(hf_config.to_dict())
    assert cfg.moe_layers == sparse and cfg.dense_mlp_layers == tuple(i for i in range(4) if i not in sparse)


QWEN3_MOE_REJECTED = {
    "num_experts_per_tok": 9,  # more than the 8 experts
    "mlp_only_layers": [5],
    "decoder_sparse_step": 0,
    "hidden_act": "gelu",
    "use_sliding_window": True,
    "shared_expert_intermediate_size": 16,
}
DEEPSEEK_V3_REJECTED = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "n_group": 3,  # does not divide the 8 experts
    "topk_group": 5,  # more than n_group=4
    "num_experts_per_tok": 5,  # more than the 4 experts of topk_group=2 groups
    "num_key_value_heads": 2,
    "first_k_dense_replace": 4,
    "n_shared_experts": 0,
    "attention_bias": True,
    "moe_layer_freq": 2,
    "hidden_act": "relu",
    "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}
PARSERS = {"qwen3_moe": ModelConfig.from_hf_config, "deepseek_v3": DeepseekV3Config.from_hf_config}


@pytest.mark.parametrize(("recipe", "field", "value"),
                         [("qwen3_moe", f, v) for f, v in QWEN3_MOE_REJECTED.items()]
                         + [("deepseek_v3", f, v) for f, v in DEEPSEEK_V3_REJECTED.items()])
def test_unsupported_config_values_are_rejected_naming_the_field(checkpoints, recipe: str, field: str, value) -> None:
    config = config_of(checkpoints[recipe]) | {field: value}
    if field == "rope_parameters":
        config.pop("rope_scaling", None)
    with pytest.raises(CheckpointError) as raised:
        PARSERS[recipe](config, "config.json")
    named = "rope_type 'dynamic'" if field == "rope_parameters" else repr(field)  # the key inside rope_parameters
    assert str(raised.value).startswith("config.json: ") and named in str(raised.value), str(raised.value)


@pytest.mark.parametrize("recipe", ["qwen3_moe", "deepseek_v3"])
def test_missing_expert_tensor_is_refused_naming_it(checkpoints, tmp_path, recipe: str) -> None:
    broken = tmp_path / "checkpoint"
    shutil.copytree(checkpoints[recipe], broken)
    tensors = load_file(broken / "model.safetensors")
    expected_shape = list(tensors.pop(MISSING).shape)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "core"
    with pytest.raises(CheckpointError) as raised:
        export_core(ExportOptions(recipe=recipe, checkpoint=broken, capacities=(1,), chunk_limit=8, max_seq_len=32), out)
    assert f"missing tensor {MISSING!r}" in str(raised.value) and f"expected shape {expected_shape}" in str(raised.value)
    assert not out.exists()


def test_wrong_recipe_names_the_right_one(checkpoints) -> None:
    with pytest.raises(RecipeError, match=r"recipe qwen3_moe expects architectures\[0\] in \['Qwen3MoeForCausalLM'\]"
                                          r".*use --recipe deepseek_v3"):
        build_recipe(ExportOptions(recipe="qwen3_moe", checkpoint=checkpoints["deepseek_v3"], capacities=(1,),
                                   chunk_limit=8, max_seq_len=32))


def test_bfloat16_export_keeps_the_deepseek_router_in_fp32(checkpoints) -> None:
    """Like transformers' _keep_in_fp32_modules: router weight and score-correction bias stay fp32."""
    build = build_recipe(ExportOptions(recipe="deepseek_v3", checkpoint=checkpoints["deepseek_v3"], capacities=(1,),
                                       chunk_limit=8, max_seq_len=32, dtype="bfloat16"))
    fp32 = {name for name, tensor in build.weights.items() if tensor.dtype == torch.float32}
    assert fp32 == {f"layers.{layer}.{name}" for layer in (1, 2) for name in ("router", "router_bias")}
    assert {decl.dtype for decl in build.state[:2]} == {"bfloat16"}
