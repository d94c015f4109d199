"""Test helpers: tiny HF decoder checkpoints and a by-hand replay of an exported core's graphs.

``CoreReplay`` does what a runtime does, with nothing but the core's files: it reads the
manifest and catalog, allocates the declared state and outputs, binds every argument by its
declaration and calls ``torch.export.load(graph).module()(buffers)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from ignition.catalog.abi import PackedPosition, Record, decode_packed_position, decode_record, has_payload
from ignition.catalog.contract import NATURAL_K

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}


@dataclass(frozen=True, slots=True)
class TinyCase:
    family: str  # qwen3 | llama | qwen3_moe | deepseek_v3 (also the recipe name)
    dtype: torch.dtype
    tie: bool
    vocab_size: int
    max_shard_size: str | None = None
    rope: dict | None = None
    max_position_embeddings: int = 64  # the HF config's; the exported context is --max-seq-len
    kv_heads: int = 2  # of the 4 query heads (dense families); 4 lets --tensor-parallel 4 split them


_TINY_MOE_COMMON = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, num_experts_per_tok=2)
TINY_MOE: dict[str, tuple[type, Callable[[TinyCase], object]]] = {
    # a dense first layer, then an MoE layer with 4 experts: every shard rule of the family in two layers
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda case: Qwen3MoeConfig(
        vocab_size=case.vocab_size, tie_word_embeddings=case.tie, num_key_value_heads=2, head_dim=16, num_experts=4,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], **_TINY_MOE_COMMON)),
    # low-rank queries (q_a/q_b), a dense first layer, group-limited routing with a shared expert, yarn RoPE
    "deepseek_v3": (DeepseekV3ForCausalLM, lambda case: DeepseekV3Config(
        vocab_size=case.vocab_size, tie_word_embeddings=case.tie, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, n_group=2,
        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                               "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                                               "beta_fast": 32, "beta_slow": 1}, **_TINY_MOE_COMMON)),
}
"""The MoE families' tiny configs (examples/make_tiny_moe.py's, smaller: 2 layers, 4 experts)."""


def build_hf_moe_model(case: TinyCase) -> torch.nn.Module:
    """Seeded tiny Qwen3-MoE / DeepSeek-V3 with O(1) logits and a routing-steering score-correction bias."""
    model_class, make_config = TINY_MOE[case.family]
    torch.manual_seed(0)
    model = model_class(make_config(case))
    with torch.no_grad():  # expert tensors may be [experts, out, in]: scale by the last dim
        for parameter in model.parameters():
            parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter) if parameter.dim() == 1
                            else torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF initialises it to zero
                buffer.copy_(0.5 * torch.randn_like(buffer))
    return model.to(case.dtype)


def build_hf_model(case: TinyCase) -> torch.nn.Module:
    """Seeded tiny HF model (GQA: 4 query heads, 2 KV heads) with O(1) logits."""
    if case.family in TINY_MOE:
        return build_hf_moe_model(case)
    torch.manual_seed(0)
    common = dict(vocab_size=case.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=case.kv_heads, max_position_embeddings=case.max_position_embeddings,
                  tie_word_embeddings=case.tie, rope_parameters=dict(case.rope) if case.rope else None)
    if case.family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    return model.to(case.dtype)


def save_checkpoint(case: TinyCase, directory: Path, reload: bool = True) -> torch.nn.Module | None:
    """Write the case with ``save_pretrained``; return transformers' own reload of it (eager attention), or
    None without ``reload``."""
    extra = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    build_hf_model(case).save_pretrained(directory, **extra)
    if not reload:
        return None
    if case.family in TINY_MOE:
        return TINY_MOE[case.family][0].from_pretrained(directory, dtype=case.dtype, attn_implementation="eager",
                                                        experts_implementation="eager").eval()
    hf_class = Qwen3ForCausalLM if case.family == "qwen3" else LlamaForCausalLM
    hf = hf_class.from_pretrained(directory, dtype=case.dtype, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf


def fp32_qwen3_core(root: Path) -> Path:
    """A tiny untied FP32 Qwen3 exported under ``root`` (capacities 1 and 2, 8-row prompt chunks, max_seq_len 64,
    prompt logprobs): its core's path, for the CPU's native kernels against ATen's."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    save_checkpoint(TinyCase("qwen3", torch.float32, tie=False, vocab_size=150), root / "checkpoint", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "checkpoint", capacities=(1, 2), chunk_limit=8,
                              max_seq_len=64, prompt_logprobs=True), root / "core")
    return root / "core"


def bf16_cores_with_fp32_reference(root: Path) -> tuple[Path, Path, list[list[int]]]:
    """A tiny tied Qwen3 in BF16 and the same BF16 values in FP32, each exported (capacities 1 and 4, prompt
    logprobs) under ``root``: (BF16 core, FP32 core, four 14-token prompts), for BF16 fidelity against the FP32
    reference."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    model = build_hf_model(TinyCase("qwen3", torch.bfloat16, True, 300))
    model.save_pretrained(root / "bf16")
    model.float().save_pretrained(root / "fp32")  # the BF16 values, in FP32: the reference
    for dtype in ("bf16", "fp32"):
        export_core(ExportOptions(recipe="qwen3", checkpoint=root / dtype, capacities=(1, 4), chunk_limit=16,
                                  max_seq_len=64, prompt_logprobs=True), root / f"core-{dtype}")
    prompts = [[(7 * i + 13 * j) % 300 for j in range(14)] for i in range(4)]
    return root / "core-bf16", root / "core-fp32", prompts


def prompt_scores(core, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt token's logprob after the first, from ``core`` (FP64, prompt order)."""
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    results = Engine(core).generate([Request(p, max_tokens=1, prompt_logprobs=0) for p in prompts])
    return torch.tensor([entry["logprob"] for r in results for entry in r.prompt_entries[1:]], dtype=torch.float64)


INPUT_DEFAULTS = {"active_lanes": 1, "token_budget": 1 << 20, "eos_token_ids": -1, "forced_token_ids": -1,
                  "temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "logprob_requested": 1}
"""Inputs not given to ``CoreReplay.run``: greedy, no penalties, logprobs requested, no stop."""


@dataclass(slots=True)
class Emitted:
    token: int
    record: Record
    packed: PackedPosition | None  # None when the record has no payload


_PROGRAMS: dict[Path, torch.nn.Module] = {}


@dataclass(slots=True)
class CoreReplay:
    core: Path
    manifest: dict = field(init=False)
    variants: dict = field(init=False)
    weights: dict = field(init=False)
    state: dict = field(init=False)
    frame: int = 0

    def __post_init__(self):
        self.manifest = json.loads((self.core / "manifest.json").read_text())
        catalog = json.loads((self.core / self.manifest["catalog"]).read_text())
        self.variants = {v["name"]: v for v in catalog["variants"]}
        self.weights = load_file(str(self.core / self.manifest["weights"]))
        self.reset_state()

    def reset_state(self) -> None:
        self.state = {s["name"]: torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"])) for s in self.manifest["state"]}

    def program(self, name: str):
        path = self.core / self.variants[name]["graph"]
        if path not in _PROGRAMS:  # loading is the slow part; a loaded module keeps no state between calls
            _PROGRAMS[path] = torch.export.load(str(path)).module()
        return _PROGRAMS[path]

    def run(self, name: str, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Bind every declared argument (inputs broadcast from scalars or lists) and call the graph."""
        buffers = {}
        for arg in self.variants[name]["arguments"]:
            arg_name, role = arg["name"], arg["role"]
            if role == "weight":
                buffers[arg_name] = self.weights[arg_name]
            elif role == "state":
                buffers[arg_name] = self.state[arg_name]
            else:
                tensor = torch.zeros(arg["shape"], dtype=getattr(torch, arg["dtype"]))
                if role == "input" and arg_name == "block_tables" and arg_name not in inputs:
                    tensor[...] = torch.arange(tensor.numel()).view(tensor.shape)  # the slot layout: s's blocks in a row
                elif role == "input":
                    tensor[...] = torch.as_tensor(inputs.pop(arg_name, INPUT_DEFAULTS.get(arg_name, 0)))
                buffers[arg_name] = tensor
        if inputs:
            raise KeyError(f"{name} declares no inputs {sorted(inputs)}")
        (tokens,) = self.program(name)(buffers)
        return tokens, buffers

    def emitted(self, buffers: dict, lane: int) -> Emitted:
        frame = int(buffers["frame_index"][0])
        record = decode_record(buffers["completion_records"][frame, lane].numpy())
        packed = None
        if has_payload(record, 0, bool(buffers["logprob_requested"][lane])):
            packed = decode_packed_position(buffers["completion_logprobs"][frame, lane, 0].numpy(), NATURAL_K)
        return Emitted(record.emitted[0] if record.emitted else -1, record, packed)

    def next_frame(self) -> int:
        self.frame ^= 1
        return self.frame

    def prefill(self, prompt: list[int], slot: int, **inputs) -> Emitted:
        """All chunks of ``prompt``; the last one emits. Returns the emitted token of the last chunk."""
        name = next(n for n, v in self.variants.items() if v["operation"] == 1)
        chunk = self.manifest["chunk_limit"]
        for start in range(0, len(prompt), chunk):
            rows = prompt[start:start + chunk]
            last = start + chunk >= len(prompt)
            _, buffers = self.run(name, chunk_input_ids=rows + [0] * (chunk - len(rows)), chunk_start=start,
                                  chunk_length=len(rows), chunk_emits=int(last), slot_ids=slot,
                                  frame_index=self.next_frame(), **inputs)
        return self.emitted(buffers, 0)

    def decode(self, capacity: int, **inputs) -> list[Emitted]:
        _, buffers = self.run(f"decode.c{capacity}", frame_index=self.next_frame(), **inputs)
        return [self.emitted(buffers, lane) for lane in range(capacity)]
