"""Reading Hugging Face checkpoint directories: headers, shards, validation and malformed input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ignition.recipes.checkpoint import (
    ARCHITECTURES,
    CheckpointError,
    open_checkpoint,
    read_config,
)
from ignition.recipes.config import ModelConfig, expected_shapes, load_weights

TINY_QWEN3 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def save_tiny(directory: Path, *, family: str = "qwen3", tie: bool = False, dtype: torch.dtype = torch.float32,
              max_shard_size: str | None = None) -> Path:
    """Save a seeded tiny HF model (built by transformers itself) into ``directory``."""
    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3, tie_word_embeddings=tie))
    else:
        config = {key: value for key, value in TINY_QWEN3.items() if key != "head_dim"}
        model = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=tie))
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("sharded"), family="llama", dtype=torch.bfloat16, max_shard_size="20KB")


def rewritten(source: Path, target: Path, edit) -> Path:
    """Copy ``source`` (single-file checkpoint) to ``target`` with ``edit(state_dict)`` applied to the weights."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def validate_dir(directory: Path) -> None:
    cfg = ModelConfig.from_hf_config(read_config(directory))
    load_weights(open_checkpoint(directory), cfg)


def test_single_file_headers_are_listed_and_loaded_lazily(qwen3_dir: Path) -> None:
    checkpoint = open_checkpoint(qwen3_dir)
    cfg = ModelConfig.from_hf_config(read_config(qwen3_dir))
    assert set(checkpoint.names()) == set(expected_shapes(cfg))
    info = checkpoint.info("model.layers.1.self_attn.q_proj.weight")
    assert (info.file.name, info.dtype, info.shape) == ("model.safetensors", torch.float32, (64, 32))
    stored = load_file(qwen3_dir / "model.safetensors")["model.norm.weight"]
    assert torch.equal(checkpoint.load("model.norm.weight"), stored)
    checkpoint.validate(expected_shapes(cfg))


def test_sharded_bf16_checkpoint_reads_every_shard(sharded_dir: Path) -> None:
    checkpoint = open_checkpoint(sharded_dir)
    assert len(checkpoint.files()) > 1
    assert {info.dtype for info in checkpoint.tensors.values()} == {torch.bfloat16}
    cfg = ModelConfig.from_hf_config(read_config(sharded_dir))
    assert cfg.dtype == torch.bfloat16
    weights = load_weights(checkpoint, cfg, torch.float32)
    assert weights["layers.0.q_proj"].dtype == torch.float32
    assert "lm_head" in weights and weights["lm_head"] is not weights["embed"]


def test_tied_checkpoint_reuses_embedding_without_copy(tmp_path: Path) -> None:
    directory = save_tiny(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in open_checkpoint(directory)
    cfg = ModelConfig.from_hf_config(read_config(directory))
    assert "lm_head.weight" not in expected_shapes(cfg)
    weights = load_weights(open_checkpoint(directory), cfg)
    assert weights["lm_head"] is weights["embed"]


def test_tied_checkpoint_may_still_carry_lm_head(tmp_path: Path) -> None:
    directory = save_tiny(tmp_path / "tied", tie=True)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, directory / "model.safetensors")
    validate_dir(directory)


def test_rotary_inv_freq_buffers_are_ignored(qwen3_dir: Path, tmp_path: Path) -> None:
    def add_buffer(tensors):
        tensors["model.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    validate_dir(rewritten(qwen3_dir, tmp_path / "ckpt", add_buffer))


def test_missing_tensor_is_named(qwen3_dir: Path, tmp_path: Path) -> None:
    directory = rewritten(qwen3_dir, tmp_path / "ckpt", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as error:
        validate_dir(directory)
    assert "[64, 32]" in str(error.value) and "1 problem" in str(error.value)


def test_untied_checkpoint_without_lm_head_is_missing_a_tensor(qwen3_dir: Path, tmp_path: Path) -> None:
    directory = rewritten(qwen3_dir, tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight'"):
        validate_dir(directory)


def test_wrong_shape_names_file_tensor_expected_and_found(qwen3_dir: Path, tmp_path: Path) -> None:
    def reshape(tensors):
        tensors["model.layers.0.self_attn.k_norm.weight"] = torch.ones(8)

    with pytest.raises(CheckpointError) as error:
        validate_dir(rewritten(qwen3_dir, tmp_path / "ckpt", reshape))
    message = str(error.value)
    assert "model.safetensors: tensor 'model.layers.0.self_attn.k_norm.weight' has the wrong shape" in message
    assert "expected [16], found [8]" in message


def test_extra_tensor_is_named(qwen3_dir: Path, tmp_path: Path) -> None:
    def add(tensors):
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(64, 32)

    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        validate_dir(rewritten(qwen3_dir, tmp_path / "ckpt", add))


def test_every_problem_is_reported_in_one_error(qwen3_dir: Path, tmp_path: Path) -> None:
    def break_three_ways(tensors):
        tensors.pop("model.norm.weight")
        tensors["model.embed_tokens.weight"] = torch.zeros(95, 32)
        tensors["model.extra.weight"] = torch.zeros(1)

    with pytest.raises(CheckpointError) as error:
        validate_dir(rewritten(qwen3_dir, tmp_path / "ckpt", break_three_ways))
    message = str(error.value)
    assert "3 problem(s)" in message
    for fragment in ("'model.norm.weight'", "'model.embed_tokens.weight'", "expected [96, 32], found [95, 32]",
                     "'model.extra.weight'"):
        assert fragment in message


def test_unknown_architecture_lists_supported_ones(qwen3_dir: Path, tmp_path: Path) -> None:
    directory = rewritten(qwen3_dir, tmp_path / "ckpt", lambda t: None)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_hf_config(read_config(directory))
    message = str(error.value)
    assert "'GPT2LMHeadModel'" in message and "architectures[0]" in message
    assert all(name in message for name in ARCHITECTURES)


def test_missing_or_invalid_config_json(qwen3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json.*found nothing"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: must be valid UTF-8 JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"top level must be a JSON object; found list"):
        read_config(tmp_path)


def test_truncated_safetensors_file_is_named(qwen3_dir: Path, tmp_path: Path) -> None:
    directory = rewritten(qwen3_dir, tmp_path / "ckpt", lambda t: None)
    weights_file = directory / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: must be a complete safetensors file"):
        open_checkpoint(directory)


def test_corrupt_safetensors_header_is_named(qwen3_dir: Path, tmp_path: Path) -> None:
    directory = rewritten(qwen3_dir, tmp_path / "ckpt", lambda t: None)
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated or corrupt"):
        open_checkpoint(directory)


def test_missing_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, directory)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as error:
        open_checkpoint(directory)
    message = str(error.value)
    assert "model.safetensors.index.json" in message and f"shard '{shard.name}'" in message


def test_index_naming_tensor_absent_from_its_shard(sharded_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, directory)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.9.ghost.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'{shard}' that the shard does not contain.*ghost"):
        open_checkpoint(directory)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    found = r"found only \['config\.json', 'pytorch_model\.bin'\]"
    with pytest.raises(CheckpointError, match=r"model\.safetensors or .*" + found):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"must be a directory"):
        open_checkpoint(tmp_path / "absent")


def test_load_of_unknown_tensor_is_named(qwen3_dir: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tensor 'nope' was requested.*model\.safetensors"):
        open_checkpoint(qwen3_dir).load("nope")
