"""Create a tiny random Qwen3 checkpoint in Hugging Face format, with a byte-level BPE tokenizer.

Deterministic and offline: the tokenizer is trained on a fixed text, the weights come from a
seeded generator, and both are written with transformers' own ``save_pretrained``. Running it
twice gives byte-identical files.

    python examples/make_tiny_qwen3.py build/tiny-qwen3
    ignition export-core build/tiny-qwen3 --recipe qwen3 --out build/qwen3-core
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 300  # 256 byte symbols + 3 specials + 41 merges
VOCAB_MULTIPLE = 64  # like real checkpoints, the embedding has spare rows past the tokenizer
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAINING_TEXT = """
Ignition exports a language model into a core: graphs, weights and a contract.
The runtime replays prefill and decode graphs, reads completion records and logprobs.
Hello world! The quick brown fox jumps over the lazy dog. 0123456789
A tiny model says tiny things, but it says them deterministically.
""" * 4


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build_model(vocab_size: int, eos_token_id: int, dtype: torch.dtype, seed: int,
                kv_heads: int = 2) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         tie_word_embeddings=True, eos_token_id=eos_token_id, bos_token_id=eos_token_id)
    torch.manual_seed(seed)
    return seeded(Qwen3ForCausalLM(config), seed).to(dtype)


def seeded(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with seeded weights that give O(1) logits (HF's 0.02-std init would be nearly uniform)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.1 * noise)
            else:
                parameter.copy_(noise / parameter.shape[1] ** 0.5)
    return model


def make_checkpoint(out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, kv_heads: int = 2) -> Path:
    """Write the tiny checkpoint (config.json, model.safetensors, tokenizer files) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    model = build_model(vocab_size, tokenizer.eos_token_id, dtype, seed, kv_heads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(make=make_checkpoint, description: str = __doc__) -> None:
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=2, choices=[1, 2, 4],
                        help="KV heads of the 4 query heads (4 lets --tensor-parallel 4 split them)")
    args = parser.parse_args()
    path = make(args.out, getattr(torch, args.dtype), args.seed, args.kv_heads)
    print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


if __name__ == "__main__":
    main()
