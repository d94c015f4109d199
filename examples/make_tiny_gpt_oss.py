"""Create a tiny random GPT-OSS checkpoint in Hugging Face format, with make_tiny_qwen3.py's BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py: seeded weights with O(1) logits and files written by
transformers' own ``save_pretrained``. Sliding layers (a window of ``--window`` positions, 8 by default) alternate
with full ones, every head has a non-zero sink logit, RoPE is YaRN, the MLP is 4 routed experts (2 a token) with
biases and a clamped SwiGLU whose limit the random weights reach. ``--mxfp4`` also stores the experts as MXFP4 blocks
and scales (``quantization_config.quant_method = "mxfp4"``), the layout of the published GPT-OSS checkpoints.

    python examples/make_tiny_gpt_oss.py build/tiny-gpt-oss
    ignition export-core build/tiny-gpt-oss --recipe gpt_oss --out build/gpt-oss-core
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the positive codes 0-7; bit 3 is the sign
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = 2,
                    window: int = 8, layers: int = len(LAYER_TYPES)) -> Path:
    """Write the tiny GPT-OSS (config.json, model.safetensors, tokenizer files) into ``out``: the first ``layers``
    of ``LAYER_TYPES`` (2 keep a sliding and a full layer)."""
    if not 1 <= layers <= len(LAYER_TYPES):
        raise ValueError(f"layers must be 1 to {len(LAYER_TYPES)}, got {layers}")
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    config = GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=1024,
        layer_types=LAYER_TYPES[:layers], sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
        swiglu_limit=1.5, rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 256},
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = make_tiny_qwen3.seeded(GptOssForCausalLM(config), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    # seeded() scales the stacked experts [experts, in, out] by their fan-in already; it leaves 1-D tensors near 1,
    # so the biases and sinks are drawn again
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("router.bias", "sinks")):  # a sink logit near the scores', a router bias as large
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif name.endswith("bias"):  # small: biases added at every layer would otherwise drown the tokens
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [*prefix, rows, cols]`` (cols a multiple of 32) -> MXFP4 ``blocks [*prefix, cols, rows / 32, 16]``
    and ``scales [*prefix, cols, rows / 32]`` (uint8) in GPT-OSS's stored layout (the transpose of the BF16 one):
    each block's scale is the power of two that puts its largest magnitude at most 6, each value the nearest e2m1."""
    stored = weight.float().transpose(-2, -1)  # [*prefix, cols, rows]
    grouped = stored.reshape(*stored.shape[:-1], -1, 32)  # [*prefix, cols, G, 32]
    peak = grouped.abs().amax(-1).clamp(min=2.0 ** -100)
    exponents = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)  # [*prefix, cols, G]
    scaled = grouped / torch.pow(2.0, exponents).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1_VALUES).abs().argmin(-1)  # nearest code 0-7
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)  # [*prefix, cols, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble first
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)


def store_mxfp4(directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite ``directory``'s experts as MXFP4 pairs (and mark the config); returns the BF16-layout tensors the
    pairs stand for, dequantized exactly (what a correct reader must recover)."""
    tensors = load_file(directory / "model.safetensors")
    recovered = {}
    for name in [name for name in tensors if name.endswith(EXPERT_TENSORS)]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).long().flatten(-2)  # [*prefix, cols, G, 32]
        values = torch.where(codes >= 8, -E2M1_VALUES[codes % 8], E2M1_VALUES[codes % 8])
        values = values * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)
        recovered[name] = values.flatten(-2).transpose(-2, -1).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config_file.write_text(json.dumps(config, indent=2))
    return recovered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--window", type=int, default=8, help="sliding_window of the sliding layers")
    parser.add_argument("--mxfp4", action="store_true", help="store the experts as MXFP4 blocks and scales")
    args = parser.parse_args()
    path = make_checkpoint(args.out, getattr(torch, args.dtype), args.seed, args.kv_heads, args.window)
    if args.mxfp4:
        store_mxfp4(path)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
