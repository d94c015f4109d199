"""Create a tiny random Llama checkpoint in Hugging Face format, with make_tiny_qwen3.py's BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py: seeded weights with O(1) logits, an untied LM
head, and files written by transformers' own ``save_pretrained``.

    python examples/make_tiny_llama.py build/tiny-llama
    ignition export-core build/tiny-llama --recipe llama --out build/llama-core
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = 2) -> Path:
    """Write the tiny Llama (config.json, model.safetensors, tokenizer files) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    make_tiny_qwen3.seeded(LlamaForCausalLM(config), seed).to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    make_tiny_qwen3.main(make_checkpoint, __doc__)
