"""Create a tiny random Gemma 3 text checkpoint in Hugging Face format, with make_tiny_qwen3.py's BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py: seeded weights with O(1) logits and files written by
transformers' own ``save_pretrained``. Sliding-window layers (a window of ``--window`` positions, 8 by default)
beside a global one, two RoPE bases, a query pre-attention scalar other than head_dim.

    python examples/make_tiny_gemma3.py build/tiny-gemma3
    ignition export-core build/tiny-gemma3 --recipe gemma3 --out build/gemma3-core
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = 2,
                    window: int = 8) -> Path:
    """Write the tiny Gemma 3 (config.json, model.safetensors, tokenizer files) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=1024,
        layer_types=LAYER_TYPES, sliding_window=window, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = make_tiny_qwen3.seeded(Gemma3ForCausalLM(config), seed)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: small w, as trained checkpoints have
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.sub_(1.0)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--window", type=int, default=8, help="sliding_window of the sliding layers")
    args = parser.parse_args()
    path = make_checkpoint(args.out, getattr(torch, args.dtype), args.seed, args.kv_heads, args.window)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
