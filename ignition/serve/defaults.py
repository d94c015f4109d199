"""How many tokens a request generates when it names no limit: one row per route, read by the routes and by
docs/serving.md (``python -m ignition.serve.defaults`` rewrites the table there; ``--check`` exits 1 when the
file is stale, and a test runs it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ignition.catalog.docs import regenerate, render_blocks
from ignition.runtime.requests import DEFAULT_MAX_TOKENS

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
BLOCK = "request-defaults"


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


def table() -> str:
    """The markdown table of ``TOKEN_LIMITS`` in docs/serving.md."""
    rows = ["| route | limit fields (the first given wins) | default |", "|---|---|---|"]
    rows += [f"| `{limit.route}` | {', '.join(f'`{name}`' for name in limit.fields)} | {limit.described()} |"
             for limit in TOKEN_LIMITS]
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with the generated block ``request-defaults`` rewritten from ``TOKEN_LIMITS``."""
    return render_blocks(text, {BLOCK: table}, str(DOC))


def main(argv: list[str]) -> int:
    return regenerate(DOC, render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
