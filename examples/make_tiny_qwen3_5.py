"""Create a tiny random Qwen3.5 text checkpoint in Hugging Face format, with a BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py (whose tokenizer and seeding it reuses): four layers, three of
them Gated DeltaNet linear attention and one gated full attention (transformers' default ``layer_types``: every
fourth layer full), with grouped linear heads (2 key heads, 4 value heads), key and value heads of different widths
and partial RoPE. The linear layers' decays are drawn so their recurrent states remember tens of tokens; the
zero-centered norms' weights are small, so their scales stay near 1.

    python examples/make_tiny_qwen3_5.py build/tiny-qwen3_5
    ignition export-core build/tiny-qwen3_5 --recipe qwen3_5 --out build/qwen3_5-core --prompt-logprobs
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

RMS_NORM_EPS = 1e-3
"""Every norm's epsilon (1e-6 in released checkpoints). A random linear layer's attended values can nearly cancel
(an RMS of 2e-5 where the median is 4e-2), and its gated RMSNorm then magnifies their FP32 rounding a thousandfold;
1e-3 keeps such heads small instead, while the residual stream's norms (RMS about 1) barely change."""

ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "q_norm.weight",
                 "k_norm.weight")
"""Norm weights transformers applies as ``1 + w``: drawn near 0, not near 1."""

FINAL_NORM_OFFSET = -0.5
"""The final norm scales by about 0.5: logits within about +-2.5, whose FP32 rounding (transformers' against an FP64
forward) stays near 3e-6, a third of the 1e-5 the parity tests allow."""

RESIDUAL_OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")
RESIDUAL_SCALE = 0.25
"""The projections that add to the residual stream are scaled down, so each layer's update is small against the
stream as in trained models: with full-size updates each layer tripled the FP32 rounding error it received, and the
logits' error against an FP64 forward reached 1e-5, transformers' own and ours alike."""


def build_model(vocab_size: int, eos_token_id: int, dtype: torch.dtype, seed: int,
                kv_heads: int = 2) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=RMS_NORM_EPS, tie_word_embeddings=True, eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    torch.manual_seed(seed)
    model = make_tiny_qwen3.seeded(Qwen3_5ForCausalLM(config), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(ZERO_CENTERED):
                offset = FINAL_NORM_OFFSET if name == "model.norm.weight" else 0.0
                parameter.copy_(offset + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("A_log"):  # decay rates in [0.05, 0.5): states that remember
                parameter.copy_((0.05 + 0.45 * torch.rand(parameter.shape, generator=generator)).log())
            elif name.endswith("dt_bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) - 1.0)
            elif name.endswith(RESIDUAL_OUTPUTS):
                parameter.mul_(RESIDUAL_SCALE)
    return model.to(dtype)


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = 2) -> Path:
    """Write the tiny checkpoint (config.json, model.safetensors, tokenizer files) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    build_model(vocab_size, tokenizer.eos_token_id, dtype, seed, kv_heads).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    make_tiny_qwen3.main(make_checkpoint, __doc__)
