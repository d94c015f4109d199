"""``ignition serve``: a core behind the vLLM-compatible HTTP API, every option checked and the port bound
before the core loads."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ignition.cli import loading
from ignition.cli.checks import bind, check_limits, identify_core, read_manifest
from ignition.cli.console import console
from ignition.cli.errors import CoreError, UsageError
from ignition.cli.group import app
from ignition.serve.config import MAX_BATCH_PROMPTS, MAX_BODY_BYTES, MAX_PROMPT_BYTES


@app.command("serve")
@loading.with_shared_options
def serve_cmd(
    core: Path = typer.Argument(..., help="Core directory"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                             help="Model id reported by /v1/models and required in `model` "
                                                  "(default: the core path)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer KEY` on /v1/* "
                                          "and /invocations, as vLLM (default: $IGNITION_API_KEY, then "
                                          "$VLLM_API_KEY)"),
    allowed_origins: Optional[str] = typer.Option(None, "--allowed-origins",
                                                  help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: none)"),
    max_batch_prompts: int = typer.Option(MAX_BATCH_PROMPTS, "--max-batch-prompts",
                                          help="Most prompts in one Completions request (400 above)"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                help="Prompt plus max_tokens per request (default: the core's context)"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="Chat template file or Jinja text, instead of the tokenizer's"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer",
                                             help="Tokenizer directory (tokenizer.json, tokenizer_config.json, "
                                                  "chat_template.jinja) instead of CORE/tokenizer"),
    allow_request_chat_template: bool = typer.Option(False, "--allow-request-chat-template",
                                                     help="Accept `chat_template` in requests (rendered with "
                                                          "time, step, nesting and size bounds)"),
    max_body_bytes: int = typer.Option(MAX_BODY_BYTES, "--max-body-bytes", help="Largest request body (413 above)"),
    max_prompt_bytes: int = typer.Option(MAX_PROMPT_BYTES, "--max-prompt-bytes",
                                         help="Largest text prompt or chat messages, in UTF-8 bytes (400 above)"),
    enable_docs: bool = typer.Option(False, "--enable-docs", help="Serve /docs, /redoc and /openapi.json"),
    disable_log_requests: bool = typer.Option(False, "--disable-log-requests",
                                              help="No log line per finished request"),
    reasoning_parser: str = typer.Option("plain", "--reasoning-parser",
                                         help="How /v1/responses splits output: plain (all content) or think "
                                              "(<think>reasoning</think>content)"),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser",
                                                   help="How tool calls are read from the output: hermes "
                                                        "(<tool_call>{...}</tool_call>, Qwen) or llama3_json"),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help="Let the model choose to call tools (tool_choice auto, the "
                                                      "default with tools); needs --tool-call-parser"),
    structured_outputs_config: Optional[str] = typer.Option(
        None, "--structured-outputs-config",
        help="vLLM's structured-output defaults as JSON, e.g. '{\"disable_any_whitespace\": true}' (no whitespace "
             "in JSON the grammar engine writes unless a request asks for it)"),
    *,
    shared: loading.SharedOptions,
) -> None:
    """Serve a core over a vLLM-compatible HTTP API (Completions, Chat, Responses, tokenizer, metrics)."""
    from ignition.runtime.parallel.group import ParallelError
    from ignition.runtime.paging import kv_capacity_tokens
    from ignition.runtime.parallel.rendezvous import torchrun_follower
    from ignition.serve.app import ServeSetupError, serve
    from ignition.serve.config import ChatTemplateError, ServeConfig, api_keys_from, read_chat_template
    from ignition.serve.config import structured_outputs_config as structured_outputs_config_from
    from ignition.serve.guards import parse_allowed_origins
    from ignition.serve.parsers import PARSERS
    from ignition.serve.tool_parsers import TOOL_PARSERS

    check_limits(port=port, max_model_len=max_model_len, max_body_bytes=max_body_bytes,
                  max_prompt_bytes=max_prompt_bytes)
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty: give the key clients must send, or leave the option out to serve without one")
    if max_batch_prompts < 1:
        raise UsageError(f"--max-batch-prompts must be at least 1, got {max_batch_prompts}")
    try:
        origins = parse_allowed_origins(allowed_origins) if allowed_origins is not None else ()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if reasoning_parser not in PARSERS:
        raise UsageError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {reasoning_parser!r}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise UsageError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice requires --tool-call-parser (which format the model writes calls in)")
    if tokenizer is not None and not tokenizer.is_dir():
        raise UsageError(f"--tokenizer {tokenizer}: not a directory")
    try:
        template = read_chat_template(chat_template) if chat_template is not None else None
    except ChatTemplateError as exc:
        raise UsageError(str(exc)) from None
    try:
        outputs_config = structured_outputs_config_from(structured_outputs_config or "{}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = ServeConfig(api_keys=api_keys_from(api_key), max_model_len=max_model_len, max_body_bytes=max_body_bytes,
                         max_prompt_bytes=max_prompt_bytes, chat_template=template, tokenizer=tokenizer,
                         allow_request_chat_template=allow_request_chat_template, enable_docs=enable_docs,
                         log_requests=not disable_log_requests, reasoning_parser=reasoning_parser,
                         tool_call_parser=tool_call_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                         structured_outputs_config=outputs_config)
    loading.check_speculative(shared.speculative)
    identify_core(core)
    load_options = shared.load_options(core)
    if read_manifest(core) is None:  # a core whose manifest does not parse: its findings, not the port, first
        loading.load(core, load_options)  # exits 1 with them
        raise UsageError(f"{core}/manifest.json changed while the server started")
    if shared.tensor_parallel > 1 and torchrun_follower():  # torchrun rank >= 1: follows rank 0, exits in loading.load
        loading.load(core, load_options)
    sock = bind(host, port)
    loaded = loading.load(core, load_options)
    name = model_name or str(core)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    capacity = kv_capacity_tokens(loaded)
    kv = f", KV cache {capacity} tokens" if capacity is not None else ""

    def ready() -> None:
        console.print(f"ready: serving {core} as {name} on {url} (loaded in {loaded.load_seconds:.1f} s{kv})",
                      markup=False, highlight=False, soft_wrap=True)

    options = shared.engine_options(loaded)
    try:
        serve(loaded, host=host, port=port, model_name=name, batch_invariant=shared.batch_invariant, config=config,
              sock=sock, on_ready=ready, engine_options=options, allowed_origins=origins,
              max_batch_prompts=max_batch_prompts)
    except ServeSetupError as exc:
        raise UsageError(str(exc)) from None
    except ParallelError as exc:  # a tensor-parallel rank died while serving: the server stopped
        raise CoreError(str(exc)) from None
