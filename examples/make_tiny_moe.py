"""Create a tiny random Qwen3-MoE or DeepSeek-V3 checkpoint in Hugging Face format, with a BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py (whose tokenizer it reuses): seeded weights,
written by transformers' own ``save_pretrained``, per-expert tensors as real checkpoints store them.
The configs exercise every routing feature: Qwen3-MoE has a dense ``mlp_only_layers`` layer and
renormalised top-k; DeepSeek-V3 has low-rank queries, yarn RoPE with mscale, a dense first layer,
group-limited routing with a non-zero ``e_score_correction_bias`` and a shared expert.

    python examples/make_tiny_moe.py build/tiny-qwen3-moe --family qwen3_moe
    python examples/make_tiny_moe.py build/tiny-deepseek-v3 --family deepseek_v3
    ignition export-core build/tiny-deepseek-v3 --recipe deepseek_v3 --out build/dsv3-core --prompt-logprobs
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

COMMON = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=128, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda vocab, eos: Qwen3MoeConfig(
        vocab_size=vocab, num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        eos_token_id=eos, bos_token_id=eos, **COMMON)),
    "deepseek_v3": (DeepseekV3ForCausalLM, lambda vocab, eos: DeepseekV3Config(
        vocab_size=vocab, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32,
                         "beta_slow": 1},
        eos_token_id=eos, bos_token_id=eos, **COMMON)),
}


def build_model(family: str, vocab_size: int, eos_token_id: int, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    model_class, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(make_config(vocab_size, eos_token_id))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) logits; expert tensors are [experts, out, in], so scale by the last dim
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.1 * noise)
            else:
                parameter.copy_(noise / parameter.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF initialises it to zero; make it steer the choice
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    return model.to(dtype)


def make_checkpoint(out: Path, family: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Write the tiny checkpoint (config.json, model.safetensors, tokenizer files) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = make_tiny_qwen3.build_tokenizer()
    multiple = make_tiny_qwen3.VOCAB_MULTIPLE
    vocab_size = -(-len(tokenizer) // multiple) * multiple
    build_model(family, vocab_size, tokenizer.eos_token_id, dtype, seed).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = make_checkpoint(args.out, args.family, getattr(torch, args.dtype), args.seed)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
