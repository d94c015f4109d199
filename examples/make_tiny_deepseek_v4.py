"""Create a tiny random DeepSeek V4 checkpoint in Hugging Face format, with make_tiny_qwen3.py's BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py: seeded weights with O(1) logits and files written by
transformers' own ``save_pretrained``. Every attention kind of the architecture is present: a pure sliding-window
layer, compressed sparse attention (CSA, compression rate 4, a lightning indexer keeping fewer entries than a long
prompt has) and heavily compressed attention (HCA, rate 8 here), all with a window (``--window``, 8 by default)
smaller than a test prompt; hash-routed MoE layers before top-k routed ones, ``sqrtsoftplus`` scoring, a shared
expert, hyper-connections of 2 streams. transformers does not instantiate the multi-token-prediction layers, so
the checkpoint has none (``num_nextn_predict_layers`` 0).

    python examples/make_tiny_deepseek_v4.py build/tiny-deepseek-v4
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

LAYER_TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
               "compressed_sparse_attention"]
MLP_LAYER_TYPES = ["hash_moe", "hash_moe", "moe", "moe"]
COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def tiny_config(vocab_size: int, eos_token_id: int, window: int = 8, index_topk: int = 3,
                index_heads: int = 8, layers: int = 4) -> DeepseekV4Config:
    """The tiny architecture: 4 layers of width 64, every attention and MoE kind of DeepSeek V4 (the first 3
    layers have them all too)."""
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=LAYER_TYPES[:layers], mlp_layer_types=MLP_LAYER_TYPES[:layers], compress_rates=dict(COMPRESS_RATES),
        hc_mult=2, hc_sinkhorn_iters=5, sliding_window=window, o_groups=2, o_lora_rank=16, index_n_heads=index_heads,
        index_head_dim=16, index_topk=index_topk, num_nextn_predict_layers=0, max_position_embeddings=1024,
        rope_theta=10_000.0, compress_rope_theta=160_000.0, swiglu_limit=10.0, tie_word_embeddings=False,
        eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=eos_token_id)


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, window: int = 8,
                    index_topk: int = 3, index_heads: int = 8, layers: int = 4) -> Path:
    """Write the tiny DeepSeek V4 (config.json, model.safetensors, tokenizer files) into ``out``."""
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    config = tiny_config(vocab_size, tokenizer.eos_token_id, window, index_topk, index_heads, layers)
    return write_checkpoint(config, out, dtype, seed, tokenizer)


def write_checkpoint(config: DeepseekV4Config, out: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                     tokenizer=None) -> Path:
    """A seeded random ``DeepseekV4ForCausalLM`` of ``config`` (O(1) logits, a random token -> experts table on the
    hash layers, small score corrections on the others) written into ``out`` by ``save_pretrained``, with
    ``tokenizer`` (default: make_tiny_qwen3.py's) beside it."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = tokenizer if tokenizer is not None else make_tiny_qwen3.build_tokenizer()
    torch.manual_seed(seed)
    model = make_tiny_qwen3.seeded(DeepseekV4ForCausalLM(config), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the routing buffers: a random token -> experts table, small score corrections
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                experts = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)
                                       [:config.num_experts_per_tok] for _ in range(config.vocab_size)])
                gate.tid2eid.copy_(experts)
            else:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn(config.n_routed_experts, generator=generator))
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=8, help="sliding_window of every attention layer")
    parser.add_argument("--index-topk", type=int, default=3, help="compressed entries the CSA indexer keeps")
    parser.add_argument("--index-heads", type=int, default=8,
                        help="indexer heads (8: an entry scores exactly 0, a tie, with odds 1 in 256)")
    args = parser.parse_args()
    path = make_checkpoint(args.out, getattr(torch, args.dtype), args.seed, args.window, args.index_topk,
                           args.index_heads)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
