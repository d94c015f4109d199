"""examples/make_tiny_qwen3.py: deterministic offline checkpoint whose core ships a working tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from _decoder_cores import CoreReplay
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.serve.tokenize import load_tokenizer_files

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen3.py"


def load_example():
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def example_checkpoint(tmp_path_factory) -> Path:
    return load_example().make_checkpoint(tmp_path_factory.mktemp("example") / "tiny-qwen3")


def test_example_checkpoint_is_deterministic(example_checkpoint, tmp_path) -> None:
    again = load_example().make_checkpoint(tmp_path / "again")
    assert digests(again) == digests(example_checkpoint)
    config = json.loads((example_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] % 64 == 0


def test_example_core_ships_tokenizer_and_generates(example_checkpoint, tmp_path) -> None:
    out = tmp_path / "core"
    export_core(ExportOptions(recipe="qwen3", checkpoint=example_checkpoint, capacities=(1,), chunk_limit=16,
                              max_seq_len=64), out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == "tokenizer" and manifest["eos_token_id"] == 0
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    served = load_tokenizer_files(out / "tokenizer", tokenizer, manifest["vocab_size"])  # what `serve` would chat with
    assert served.chat_template_source == str(out / "tokenizer" / "chat_template.jinja")
    assert served.chat_template == load_example().CHAT_TEMPLATE
    prompt = tokenizer.encode("Hello world! The quick brown fox").ids
    assert tokenizer.decode(prompt) == "Hello world! The quick brown fox"
    replay = CoreReplay(out)
    first = replay.prefill(prompt, slot=0)
    assert 0 <= first.token < manifest["vocab_size"] and first.packed.chosen_id == first.token
    assert torch.isfinite(torch.tensor(first.packed.chosen_logprob))


def test_tokenizer_option_must_hold_a_tokenizer(example_checkpoint, tmp_path) -> None:
    with pytest.raises(RecipeError, match="expected tokenizer.json or tokenizer.model"):
        export_core(ExportOptions(recipe="qwen3", checkpoint=example_checkpoint, capacities=(1,), chunk_limit=16,
                                  max_seq_len=64, tokenizer=tmp_path), tmp_path / "core")
    assert not (tmp_path / "core").exists()
