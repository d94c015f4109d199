"""Malformed checkpoints and impossible options: a clear error naming the culprit, and nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from _decoder_cores import TinyCase, build_hf_model
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.checkpoint import CheckpointError

BROKEN_TENSOR = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("good") / "checkpoint"
    build_hf_model(TinyCase("qwen3", torch.float32, tie=True, vocab_size=64)).save_pretrained(directory)
    return directory


def broken_copy(good: Path, target: Path, *, weights=None, config=None, raw=None) -> Path:
    """Copy of the good checkpoint with ``weights(tensors)``, ``config(dict)`` or ``raw(bytes) -> bytes`` applied."""
    shutil.copytree(good, target)
    if weights is not None:
        tensors = load_file(target / "model.safetensors")
        weights(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        config(data)
        (target / "config.json").write_text(json.dumps(data))
    if raw is not None:
        (target / "model.safetensors").write_bytes(raw((target / "model.safetensors").read_bytes()))
    return target


def set_architecture(name):
    return lambda config: config.update(architectures=[name])


CASES = {
    "missing_tensor": (dict(weights=lambda t: t.pop(BROKEN_TENSOR)), CheckpointError,
                       [f"missing tensor {BROKEN_TENSOR!r}", "expected shape [64, 32]"]),
    "wrong_shape": (dict(weights=lambda t: t.update({BROKEN_TENSOR: torch.zeros(64, 31)})), CheckpointError,
                    [f"tensor {BROKEN_TENSOR!r} has the wrong shape", "expected [64, 32], found [64, 31]"]),
    "unknown_architecture": (dict(config=set_architecture("MistralForCausalLM")), CheckpointError,
                             ["unsupported architecture", "'MistralForCausalLM'"]),
    "truncated_safetensors": (dict(raw=lambda data: data[:len(data) // 2]), CheckpointError,
                              ["model.safetensors: must be a complete safetensors file"]),
    "wrong_recipe": (dict(config=set_architecture("LlamaForCausalLM")), RecipeError,
                     ["recipe qwen3 expects architectures[0] in ['Qwen3ForCausalLM']", "use --recipe llama"]),
    "no_config": (dict(config=lambda c: c.clear()), CheckpointError, ["field 'architectures'"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_checkpoint_fails_clearly_and_leaves_nothing(good_checkpoint, tmp_path, name: str) -> None:
    edits, error, fragments = CASES[name]
    checkpoint = broken_copy(good_checkpoint, tmp_path / "checkpoint", **edits)
    out = tmp_path / "cores" / "core"
    with pytest.raises(error) as raised:
        export_core(ExportOptions(recipe="qwen3", checkpoint=checkpoint, capacities=(1,), chunk_limit=8,
                                  max_seq_len=32), out)
    for fragment in fragments:
        assert fragment in str(raised.value)
    assert not out.exists() and not any(out.parent.glob(f".{out.name}*"))


@pytest.mark.parametrize(("options", "fragment"), [
    (dict(max_seq_len=128), "--max-seq-len 128 exceeds the checkpoint's max_position_embeddings 64"),
    (dict(chunk_limit=64, max_seq_len=32), "--chunk-limit 64 exceeds --max-seq-len 32"),
    (dict(capacities=(1, 4), num_slots=2), "decode capacity 4 exceeds num_slots 2"),
    (dict(checkpoint=None), "recipe qwen3: a Hugging Face checkpoint directory is required"),
])
def test_impossible_options_are_rejected(good_checkpoint, tmp_path, options: dict, fragment: str) -> None:
    arguments = dict(recipe="qwen3", checkpoint=good_checkpoint, capacities=(1,), chunk_limit=8, max_seq_len=32)
    with pytest.raises(RecipeError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        export_core(ExportOptions(**(arguments | options)), tmp_path / "core")
    assert not (tmp_path / "core").exists()


@pytest.mark.parametrize("name", ["missing_tensor", "truncated_safetensors", "unknown_architecture"])
def test_cli_reports_malformed_checkpoint_without_traceback(good_checkpoint, tmp_path, name: str) -> None:
    edits, _, fragments = CASES[name]
    checkpoint = broken_copy(good_checkpoint, tmp_path / "checkpoint", **edits)
    out = tmp_path / "core"
    result = CliRunner().invoke(app, ["export-core", str(checkpoint), "--recipe", "qwen3", "--out", str(out),
                                      "--chunk-limit", "8", "--max-seq-len", "32"])
    assert result.exit_code == 1, result.output
    squash = lambda text: "".join(text.split())  # noqa: E731  (rich wraps long paths mid-word)
    assert "export failed" in result.output and squash(fragments[0]) in squash(result.output)
    assert "Traceback" not in result.output and not out.exists()
