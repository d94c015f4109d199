"""Create a tiny random DeepSeek V4 checkpoint in Hugging Face format, with make_tiny_qwen3.py's BPE tokenizer.

Deterministic and offline, like make_tiny_qwen3.py: seeded weights with O(1) logits and files written by
transformers' own ``save_pretrained``. Every attention kind of the architecture is present: a pure sliding-window
layer, compressed sparse attention (CSA, compression rate 4, a lightning indexer keeping fewer entries than a long
prompt has) and heavily compressed attention (HCA, rate 8 here), all with a window (``--window``, 8 by default)
smaller than a test prompt; hash-routed MoE layers before top-k routed ones, ``sqrtsoftplus`` scoring, a shared
expert, hyper-connections of 2 streams. By default it has no multi-token-prediction layer
(``num_nextn_predict_layers`` 0); ``--mtp-layers 1`` adds one as DeepSeek's release names it (``mtp.0.*``, a
sliding-window block with top-k MoE, listed after the decoder's layers in ``compress_ratios``, with its own
``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm`` and ``hc_head_*``): transformers builds the block as one
more decoder layer, which is then renamed (transformers itself ignores ``mtp.*`` tensors).

    python examples/make_tiny_deepseek_v4.py build/tiny-deepseek-v4 [--mtp-layers 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.utils import logging as hf_logging

_SPEC = importlib.util.spec_from_file_location("make_tiny_qwen3", Path(__file__).with_name("make_tiny_qwen3.py"))
make_tiny_qwen3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_qwen3)

LAYER_TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
               "compressed_sparse_attention"]
MLP_LAYER_TYPES = ["hash_moe", "hash_moe", "moe", "moe"]
COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
RATIO_OF_TYPE = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
"""A layer type's entry in a release config's ``compress_ratios`` (its type code, whatever ``compress_rates`` says)."""
MTP_LAYER_TYPE, MTP_MLP_TYPE = "sliding_attention", "moe"  # DeepSeek-V4-Flash's MTP layer: ratio 0, top-k routed


def tiny_config(vocab_size: int, eos_token_id: int, window: int = 8, index_topk: int = 3,
                index_heads: int = 8, layers: int = 4, extra_layers: int = 0) -> DeepseekV4Config:
    """The tiny architecture: 4 layers of width 64, every attention and MoE kind of DeepSeek V4 (the first 3
    layers have them all too); ``extra_layers`` more of the MTP layer's kind (the blocks the MTP layers become)."""
    layer_types = LAYER_TYPES[:layers] + [MTP_LAYER_TYPE] * extra_layers
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers + extra_layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=layer_types, mlp_layer_types=MLP_LAYER_TYPES[:layers] + [MTP_MLP_TYPE] * extra_layers,
        compress_rates=dict(COMPRESS_RATES),
        hc_mult=2, hc_sinkhorn_iters=5, sliding_window=window, o_groups=2, o_lora_rank=16, index_n_heads=index_heads,
        index_head_dim=16, index_topk=index_topk, num_nextn_predict_layers=0, max_position_embeddings=1024,
        rope_theta=10_000.0, compress_rope_theta=160_000.0, swiglu_limit=10.0, tie_word_embeddings=False,
        eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=eos_token_id)


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, window: int = 8,
                    index_topk: int = 3, index_heads: int = 8, layers: int = 4, mtp_layers: int = 0) -> Path:
    """Write the tiny DeepSeek V4 (config.json, model.safetensors, tokenizer files) into ``out``."""
    tokenizer = make_tiny_qwen3.build_tokenizer()
    vocab_size = -(-len(tokenizer) // make_tiny_qwen3.VOCAB_MULTIPLE) * make_tiny_qwen3.VOCAB_MULTIPLE
    config = tiny_config(vocab_size, tokenizer.eos_token_id, window, index_topk, index_heads, layers, mtp_layers)
    write_checkpoint(config, out, dtype, seed, tokenizer)
    if mtp_layers:
        _as_mtp_layers(out, layers, mtp_layers, dtype, torch.Generator().manual_seed(seed + 2))
    return out


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


def _as_mtp_layers(out: Path, layers: int, mtp_layers: int, dtype: torch.dtype, generator: torch.Generator) -> None:
    """Rename the blocks past ``layers`` to ``mtp.{k}.*``, add each MTP layer's own tensors (seeded like
    ``make_tiny_qwen3.seeded``) and rewrite config.json: ``layers`` decoder layers, ``num_nextn_predict_layers``
    and ``compress_ratios`` listing the MTP layers after them."""
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    hidden, streams = config["hidden_size"], config["hc_mult"]
    for k in range(mtp_layers):
        block = f"model.layers.{layers + k}."
        for name in [name for name in tensors if name.startswith(block)]:
            tensors[f"mtp.{k}." + name.removeprefix(block)] = tensors.pop(name)
        own = {"e_proj.weight": (hidden, hidden), "h_proj.weight": (hidden, hidden), "enorm.weight": (hidden,),
               "hnorm.weight": (hidden,), "norm.weight": (hidden,), "hc_head_fn": (streams, streams * hidden),
               "hc_head_base": (streams,), "hc_head_scale": (1,)}
        for name, shape in own.items():
            noise = torch.randn(shape, generator=generator)
            tensors[f"mtp.{k}.{name}"] = (1.0 + 0.1 * noise if len(shape) == 1 else noise / shape[1] ** 0.5).to(dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    types = config["layer_types"]
    config.update(num_hidden_layers=layers, layer_types=types[:layers], mlp_layer_types=config["mlp_layer_types"][:layers],
                  num_nextn_predict_layers=mtp_layers, compress_ratios=[RATIO_OF_TYPE[kind] for kind in types])
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=8, help="sliding_window of every attention layer")
    parser.add_argument("--index-topk", type=int, default=3, help="compressed entries the CSA indexer keeps")
    parser.add_argument("--index-heads", type=int, default=8,
                        help="indexer heads (8: an entry scores exactly 0, a tie, with odds 1 in 256)")
    parser.add_argument("--mtp-layers", type=int, default=0, help="multi-token-prediction layers (mtp.{k}.*)")
    args = parser.parse_args()
    path = make_checkpoint(args.out, getattr(torch, args.dtype), args.seed, args.window, args.index_topk,
                           args.index_heads, mtp_layers=args.mtp_layers)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
