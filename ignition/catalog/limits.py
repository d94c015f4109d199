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
    "speculative_tokens": Range(1, MAX_RECORD_POSITIONS - 1, True,
                                "draft tokens S a verify variant scores; its S+1 positions must fit T"),
    # other commands
    "port": Range(1, 65535, True, "a TCP port"),
    "max_model_len": Range(1, INT32_MAX, True, "serve: prompt plus max_tokens per request; at most the core's context"),
    "max_body_bytes": Range(1, None, True, "serve: bytes of one request body (413 above)"),
    "max_prompt_bytes": Range(1, None, True, "serve: UTF-8 bytes of a text prompt or of all chat messages"),
    "memory_budget": Range(0, None, True, "bytes"),
}


def check_limit(name: str, value, label: str | None = None) -> str | None:
    """``LIMITS[name].problem`` under the caller's name for the field (``--top-k``, ``top_k``)."""
    return LIMITS[name].problem(label or name, value)
