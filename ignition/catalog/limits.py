"""The range of every number a user gives Ignition, written once.

CLI options, export options and the fields of a generation request (``run`` and the HTTP API)
are checked against ``LIMITS``; docs/api.md renders the table. A range literal anywhere else
is a bug. Each range says why it is what it is: most follow from the dtype of the input buffer
the value is uploaded into (``catalog/buffers.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ignition.catalog.abi import MAX_RECORD_POSITIONS

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 32
"""Deepest nesting of a core's JSON files (the deepest real one nests 7 levels)."""


@dataclass(frozen=True, slots=True)
class Range:
    """A closed interval (``open_low`` excludes ``low``); ``high=None``: no upper bound but finite."""

    low: int | float
    high: int | float | None
    integer: bool
    why: str
    open_low: bool = False
    label: str | None = None  # how messages state the range: "{name} must {label}", e.g. "fit in int64"

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low}"
        return f"in {'(' if self.open_low else '['}{self.low}, {self.high}]"

    def problem(self, name: str, value) -> str | None:
        """None when ``value`` is in range, else a message naming the field, the range and the value."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be a number, got {value!r}"
        if self.integer and not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
        if not math.isfinite(value):
            return f"{name} must be a finite number {self}, got {value!r}"
        low_ok = value > self.low if self.open_low else value >= self.low
        if low_ok and (self.high is None or value <= self.high):
            return None
        if self.label:
            bound = self.label
        elif not low_ok:
            bound = f"be {'>' if self.open_low else '>='} {self.low}"
        else:
            bound = f"be <= {self.high}"
        return f"{name} must {bound}, got {value!r}"


LIMITS: dict[str, Range] = {
    # generation requests: `run` options and HTTP request fields
    "temperature": Range(0.0, None, False, "float32 input; below 1e-5 is greedy"),
    "top_p": Range(0.0, 1.0, False, "a probability mass; 1 is off", open_low=True),
    "min_p": Range(0.0, 1.0, False, "a fraction of the top probability; 0 is off"),
    "top_k": Range(0, INT32_MAX, True, "int32 input; 0 is off (the HTTP API also takes -1)"),
    "repetition_penalty": Range(0.0, None, False, "a divisor; 1 is off", open_low=True),
    "presence_penalty": Range(-2.0, 2.0, False, "OpenAI's range; 0 is off"),
    "frequency_penalty": Range(-2.0, 2.0, False, "OpenAI's range; 0 is off"),
    "seed": Range(INT64_MIN, INT64_MAX, True, "int64 input (Philox key)", label="fit in int64"),
    "max_tokens": Range(0, INT32_MAX, True, "int64 token_budget, capped at int32 like vLLM"),
    # export-core options
    "capacity": Range(1, 4096, True, "decode lanes of one variant; each lane needs its own slot"),
    "chunk_limit": Range(1, 1 << 20, True, "prompt rows of one prefill chunk"),
    "completion_token_capacity": Range(0, MAX_RECORD_POSITIONS, True, "T; 0 means 8; masks are 64-bit"),
    "max_seq_len": Range(1, INT32_MAX, True, "KV positions per slot; int32 token positions"),
    "num_slots": Range(1, 1 << 16, True, "KV slots of the core"),
    "export_seed": Range(0, 2**64 - 1, True, "torch.Generator seed of generated weights"),
    "capture_jobs": Range(0, 256, True, "processes capturing variants at once; 0 means one per core for large "
                                        "checkpoints"),
    "speculative_tokens": Range(1, MAX_RECORD_POSITIONS - 1, True,
                                "draft tokens S a verify variant scores; its S+1 positions must fit T"),
    # other commands
    "port": Range(1, 65535, True, "a TCP port"),
    "max_model_len": Range(1, INT32_MAX, True, "serve: prompt plus max_tokens per request; at most the core's context"),
    "max_body_bytes": Range(1, None, True, "serve: bytes of one request body (413 above)"),
    "max_prompt_bytes": Range(1, None, True, "serve: UTF-8 bytes of a text prompt or of all chat messages"),
    "memory_budget": Range(0, None, True, "bytes"),
    # checkpoint config.json fields, checked before anything is allocated (CHECKPOINT_FIELDS)
    "num_hidden_layers": Range(1, 1024, True, "config.json: decoder layers (the largest released models have ~160)"),
    "hidden_size": Range(1, 1 << 17, True, "config.json: model width"),
    "intermediate_size": Range(1, 1 << 20, True, "config.json: dense MLP width"),
    "moe_intermediate_size": Range(1, 1 << 20, True, "config.json: one expert's MLP width"),
    "num_attention_heads": Range(1, 1024, True, "config.json: query heads"),
    "num_key_value_heads": Range(1, 1024, True, "config.json: KV heads"),
    "head_dim": Range(1, 4096, True, "config.json: per-head width"),
    "vocab_size": Range(1, 1 << 24, True, "config.json: embedding rows"),
    "num_experts": Range(1, 1 << 14, True, "config.json: routed experts per MoE layer (also num_local_experts, "
                                            "n_routed_experts)"),
    "num_local_experts": Range(1, 1 << 14, True, "config.json: routed experts per MoE layer"),
    "n_routed_experts": Range(1, 1 << 14, True, "config.json: routed experts per MoE layer (DeepSeek)"),
    "num_experts_per_tok": Range(1, 1024, True, "config.json: experts each token is routed to"),
    "n_shared_experts": Range(0, 1024, True, "config.json: always-on experts (DeepSeek)"),
    "n_group": Range(1, 1 << 14, True, "config.json: expert groups (DeepSeek)"),
    "topk_group": Range(1, 1 << 14, True, "config.json: groups each token may use (DeepSeek)"),
    "first_k_dense_replace": Range(0, 1024, True, "config.json: leading dense layers (DeepSeek)"),
    "decoder_sparse_step": Range(1, 1024, True, "config.json: every n-th layer is sparse (Qwen3-MoE)"),
    "q_lora_rank": Range(1, 1 << 16, True, "config.json: low-rank query width (DeepSeek)"),
    "kv_lora_rank": Range(1, 1 << 16, True, "config.json: latent KV width (DeepSeek)"),
    "qk_rope_head_dim": Range(1, 4096, True, "config.json: rotary part of a head (DeepSeek)"),
    "qk_nope_head_dim": Range(1, 4096, True, "config.json: non-rotary part of a head (DeepSeek)"),
    "v_head_dim": Range(1, 4096, True, "config.json: value head width (DeepSeek)"),
}

CHECKPOINT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                     "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
                     "topk_group", "first_k_dense_replace", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank",
                     "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
"""Top-level config.json fields whose size decides what an export allocates: range-checked (when present and
not null) before a recipe parses the config."""


def check_limit(name: str, value, label: str | None = None) -> str | None:
    """``LIMITS[name].problem`` under the caller's name for the field (``--top-k``, ``top_k``)."""
    return LIMITS[name].problem(label or name, value)


def config_problem(config: dict, source: str) -> str | None:
    """Why a checkpoint's parsed ``config.json`` cannot be exported, checked before anything is allocated:
    a non-finite number anywhere in it (named by its path, e.g. ``rope_parameters.mscale_all_dim``), or a
    ``CHECKPOINT_FIELDS`` size out of its range. None when neither."""
    stack = [("", config)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{path}.{key}" if path else str(key), child) for key, child in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}[{index}]", child) for index, child in enumerate(value)]
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{source}: field {path!r} must be a finite number; found {value!r}"
    for name in CHECKPOINT_FIELDS:
        if config.get(name) is not None and (problem := check_limit(name, config[name], f"field {name!r}")):
            return f"{source}: {problem}"
    return None
