"""How many tokens a request generates when it names no limit (one row per route, read by the routes), and the KV
cache options of ``serve`` and ``run`` (read by the CLI): both tables are written into docs/serving.md
(``python -m ignition.serve.defaults`` rewrites them there; ``--check`` exits 1 when the file is stale, and a test
runs it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ignition.catalog.docs import regenerate, render_blocks
from ignition.runtime.requests import DEFAULT_MAX_TOKENS
from ignition.runtime.state_snapshots import STATE_SNAPSHOT_MEMORY as DEFAULT_STATE_SNAPSHOT_MEMORY

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
BLOCK = "request-defaults"
KV_BLOCK = "kv-cache-options"


@dataclass(frozen=True, slots=True)
class TokenLimit:
    """A route's generation limit: the request fields that set it (the first one given wins), and its default:
    ``fixed`` tokens, or (``fixed`` None) the rest of the context after the prompt, ``without_context`` tokens
    when the core declares no context length."""

    route: str
    fields: tuple[str, ...]
    fixed: int | None
    without_context: int

    def resolve(self, body: object, prompt_tokens: int, max_context: int | None) -> int:
        """The request's limit: its first field that is set, else this route's default."""
        for name in self.fields:
            value = getattr(body, name, None)
            if value is not None:
                return value
        if self.fixed is not None:
            return self.fixed
        return max_context - prompt_tokens if max_context else self.without_context

    def described(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed} tokens (vLLM's and OpenAI's Completions default)"
        return f"the rest of the context after the prompt; {self.without_context} tokens when the core declares none"


FILL_WITHOUT_CONTEXT = 256
"""Chat's and Responses' limit when a request names none and the core declares no context length to fill."""

COMPLETIONS = TokenLimit("/v1/completions", ("max_tokens",), DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)
CHAT = TokenLimit("/v1/chat/completions", ("max_completion_tokens", "max_tokens"), None, FILL_WITHOUT_CONTEXT)
RESPONSES = TokenLimit("/v1/responses", ("max_output_tokens",), None, FILL_WITHOUT_CONTEXT)
TOKEN_LIMITS = (COMPLETIONS, CHAT, RESPONSES)


@dataclass(frozen=True, slots=True)
class CacheOption:
    """A KV cache option of ``serve`` and ``run``: its flag (typer's spelling), default and meaning."""

    flag: str
    default: object
    shown_default: str
    meaning: str


PREFIX_CACHING = CacheOption(
    "--enable-prefix-caching/--no-enable-prefix-caching", True, "on",
    "reuse the KV blocks of earlier requests' equal prefixes (vLLM's automatic prefix caching); a request's "
    "`cache_salt` keeps tenants apart, requests with `prompt_logprobs` never read the cache")
KV_CACHE_MEMORY = CacheOption(
    "--kv-cache-memory", None, "the core's declared capacity",
    "bytes of the paged KV pool; requests are admitted while its blocks last and preempted when they run out")
KV_HOST_MEMORY = CacheOption(
    "--kv-host-memory", 0, "0 (no host tier)",
    "bytes of the host tier evicted prefix blocks move to (pinned on CUDA); looked up after the device blocks")
STATE_SNAPSHOT_MEMORY = CacheOption(
    "--state-snapshot-memory", DEFAULT_STATE_SNAPSHOT_MEMORY, f"{DEFAULT_STATE_SNAPSHOT_MEMORY} (1 GiB)",
    "host bytes for the linear-attention states kept where a prefix hit can resume them (Qwen3.5; taken as they "
    "are made, least recently used evicted); below one snapshot, such a core reuses no prefix")
GPU_MEMORY_UTILIZATION = CacheOption(
    "--gpu-memory-utilization", None, "none",
    "CUDA: the fraction of the GPU's memory this server may use, as vLLM's option; the KV pool gets what the "
    "weights leave of it (refused on CPU; `--kv-cache-memory` is the exact size)")
KV_CACHE_OPTIONS = (PREFIX_CACHING, KV_CACHE_MEMORY, KV_HOST_MEMORY, STATE_SNAPSHOT_MEMORY, GPU_MEMORY_UTILIZATION)


def kv_table() -> str:
    """The markdown table of ``KV_CACHE_OPTIONS`` in docs/serving.md."""
    rows = ["| option | default | what |", "|---|---|---|"]
    rows += [f"| `{' / '.join(option.flag.split('/'))}` | {option.shown_default} | {option.meaning} |"
             for option in KV_CACHE_OPTIONS]
    return "\n".join(rows) + "\n"


def table() -> str:
    """The markdown table of ``TOKEN_LIMITS`` in docs/serving.md."""
    rows = ["| route | limit fields (the first given wins) | default |", "|---|---|---|"]
    rows += [f"| `{limit.route}` | {', '.join(f'`{name}`' for name in limit.fields)} | {limit.described()} |"
             for limit in TOKEN_LIMITS]
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with the generated block ``request-defaults`` rewritten from ``TOKEN_LIMITS``."""
    return render_blocks(text, {BLOCK: table, KV_BLOCK: kv_table}, str(DOC))


def main(argv: list[str]) -> int:
    return regenerate(DOC, render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
