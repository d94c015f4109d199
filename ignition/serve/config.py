"""What ``ignition serve`` is configured with beyond the core: keys, bounds, templates, docs.

One ``ServeConfig`` per app, read by the middleware and the handlers at request time (tests
change a field of a running server's config instead of starting another server).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ignition.serve.parsers import PARSERS
from ignition.serve.tool_parsers import TOOL_PARSERS

API_KEY_ENVIRONMENT = ("IGNITION_API_KEY", "VLLM_API_KEY")
"""Environment variables read for the API key when ``--api-key`` is not given, in this order."""

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Default bound on a request body; a larger body is a 413 before it is parsed."""
MAX_PROMPT_BYTES = 16 * 1024 * 1024
"""Default bound on the UTF-8 bytes of a text prompt (Completions) or of all message texts (Chat)."""
MAX_BATCH_PROMPTS = 1024
"""Default bound on the prompts of one Completions request (--max-batch-prompts); more is a 400."""


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """Bounds on rendering a chat template: a request's, and the server's own (the core's is untrusted data too),
    whose output bound is raised to --max-prompt-bytes when that is larger (serve/chat.py)."""

    max_template_bytes: int = 64 * 1024
    max_nesting: int = 16  # nested for/if/macro/call/filter blocks; real chat templates nest 6 or fewer
    render_seconds: float = 1.0
    max_steps: int = 1_000_000  # Python lines executed while rendering, loop bodies and filters included
    max_output_bytes: int = 4 * 1024 * 1024
    max_int_bits: int = 65_536  # an integer a template computes (``**``, ``*``): checked before the operation


STRUCTURED_OUTPUTS_CONFIG = {"disable_any_whitespace": bool, "disable_additional_properties": bool}
"""The keys of vLLM's ``--structured-outputs-config`` this server reads, with their types. ``disable_any_whitespace``:
the default for requests that do not set ``structured_outputs.disable_any_whitespace``;
``disable_additional_properties`` is accepted and changes nothing (objects are always closed as vLLM's default
backend closes them, runtime/grammar_spec.py)."""


def structured_outputs_config(value) -> dict:
    """``--structured-outputs-config JSON`` (vLLM's spelling) as a dict; ValueError naming the key at fault."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--structured-outputs-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--structured-outputs-config must be a JSON object such as "
                         f"'{{\"disable_any_whitespace\": true}}', got {type(value).__name__}")
    for key, item in value.items():
        if key not in STRUCTURED_OUTPUTS_CONFIG:
            raise ValueError(f"--structured-outputs-config: unknown key {key!r} (this server reads "
                             f"{', '.join(STRUCTURED_OUTPUTS_CONFIG)})")
        if not isinstance(item, STRUCTURED_OUTPUTS_CONFIG[key]):
            raise ValueError(f"--structured-outputs-config: {key} must be a "
                             f"{STRUCTURED_OUTPUTS_CONFIG[key].__name__}, got {json.dumps(item)}")
    return dict(value)


@dataclass(slots=True)
class ServeConfig:
    """Server options; every field has the default ``ignition serve`` uses."""

    api_keys: tuple[str, ...] = ()
    max_model_len: int | None = None  # None: the core's context
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_bytes: int = MAX_PROMPT_BYTES
    chat_template: str | None = None  # overrides the tokenizer's template (--chat-template)
    tokenizer: Path | None = None  # a tokenizer directory used instead of CORE/tokenizer (--tokenizer)
    allow_request_chat_template: bool = False
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)
    enable_docs: bool = False  # /docs, /redoc and /openapi.json
    log_requests: bool = True  # one log line per finished request
    reasoning_parser: str = "plain"  # how /v1/responses splits output: a name in parsers.PARSERS
    tool_call_parser: str | None = None  # how tool calls are read from the output: a name in TOOL_PARSERS
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) needs it and a parser
    structured_outputs_config: dict = field(default_factory=dict)  # --structured-outputs-config (vLLM's)

    def __post_init__(self):
        self.api_keys = tuple(key for key in self.api_keys if key)
        if self.reasoning_parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r} (choices: {', '.join(PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} "
                             f"(choices: {', '.join(TOOL_PARSERS)})")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:  # vLLM refuses this at start too
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        self.structured_outputs_config = structured_outputs_config(self.structured_outputs_config)

    @property
    def disable_any_whitespace(self) -> bool:
        """The server's default for ``structured_outputs.disable_any_whitespace``."""
        return bool(self.structured_outputs_config.get("disable_any_whitespace", False))


def api_keys_from(option: str | None) -> tuple[str, ...]:
    """``--api-key`` if given, else the first environment variable of API_KEY_ENVIRONMENT that is set."""
    if option:
        return (option,)
    for name in API_KEY_ENVIRONMENT:
        if os.environ.get(name):
            return (os.environ[name],)
    return ()


class ChatTemplateError(ValueError):
    """``--chat-template`` names neither a readable file nor a template."""


def read_chat_template(value: str) -> str:
    """``--chat-template FILE|STRING``: a file's text, or the value itself when it looks like a Jinja template.

    As vLLM decides: an existing path is read; a value with Jinja markup is a template; anything
    else is taken for a missing file.
    """
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # too long a name for a path, unreadable, not UTF-8
        if "{" not in value:
            raise ChatTemplateError(f"--chat-template {value}: cannot read it: {exc}") from None
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise ChatTemplateError(f"--chat-template {value}: no such file, and not a Jinja template "
                            "(a template contains {{ }} or {% %})")
