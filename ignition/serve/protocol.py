"""Wire models of the OpenAI-compatible API, shaped after vLLM's protocol (field names, defaults, extensions).

Requests accept unknown fields (ignored with one warning line per field name and process, as
vLLM's ``OpenAIBaseModel`` logs them) and reject non-finite floats. Fields the loader cannot honour
are listed in UNSUPPORTED (or STRUCTURED_OUTPUT) and rejected with 400 when set. docs/serving.md
lists every vLLM request field under one of the three; tests/test_serve_parity.py keeps it in step.
Structured output (``response_format``, ``structured_outputs`` and vLLM's deprecated ``guided_*`` aliases) and
the sampling controls (``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``) are read by
``requests.structured_spec`` and ``requests.sampling_constraints``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("ignition.serve")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# -- errors ----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- requests --------------------------------------------------------------------------------
_warned_fields: set[str] = set()
_warned_lock = threading.Lock()
MAX_WARNED_FIELDS = 1024
"""Field names warned about at most (a client inventing names cannot grow the set or the log without bound)."""


class RequestModel(OpenAIBaseModel):
    """A request body: a field it does not define, and that no refusal list names, is ignored with a warning
    logged once per field name and process (vLLM logs every request's; once keeps a client from flooding the log)."""

    @model_validator(mode="after")
    def _warn_ignored(self):
        extra = self.model_extra
        if extra:
            refused = UNSUPPORTED.keys() | STRUCTURED_OUTPUT
            with _warned_lock:
                fresh = sorted(name for name in extra if name not in refused and name not in _warned_fields)
                fresh = fresh[:max(MAX_WARNED_FIELDS - len(_warned_fields), 0)]
                _warned_fields.update(fresh)
            for name in fresh:
                log.warning("the request field %r is not supported and was ignored (logged once per field name)",
                            name[:100])
        return self


def warn_once(name: str, message: str) -> None:
    """Log ``message`` the first time field ``name`` is seen in this process (a deprecated alias, ...)."""
    with _warned_lock:
        fresh = name not in _warned_fields and len(_warned_fields) < MAX_WARNED_FIELDS
        if fresh:
            _warned_fields.add(name)
    if fresh:
        log.warning("%s (logged once per field name)", message)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class GenerationFields(RequestModel):
    """Fields Completions and Chat share (vLLM's sampling extensions included)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = 1  # choices per prompt (requests.sample_counts): the prompt is prefilled once for all
    best_of: int | None = None  # samples drawn per prompt, the best n returned (vLLM V0); None: n
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    # structured output (requests.structured_spec) and the sampling controls (requests.sampling_constraints)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's deprecated aliases of structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's): blocks are shared only between equal salts

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = None  # None: the route's default (serve/defaults.py)
    suffix: str | None = None
    add_special_tokens: bool = True


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = ChatCompletionNamedToolChoiceParam | str  # a string other than none/auto/required: a 400 (serve/tools.py)


class ChatCompletionRequest(GenerationFields):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = "none"  # "auto" when tools are sent without it (vLLM); serve/tools.py
    parallel_tool_calls: bool | None = True  # False: only the first call is returned (vLLM)


# field -> the only value the loader serves (anything else is a 400)
UNSUPPORTED: dict[str, object] = {
    "use_beam_search": False, "suffix": None, "prompt_embeds": None, "logits_processors": None,
}
STRUCTURED_OUTPUT = frozenset({"structural_tag"})
"""Structured-output fields this server refuses whatever their value: vLLM's structural tags (a JSON schema between
trigger strings), which llguidance's JSON-Schema and Lark front ends do not express here."""


# -- responses -------------------------------------------------------------------------------
class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob as it appears in ``prompt_logprobs``: keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))  # vLLM's make_tool_call_id
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A call's first delta has ``id``, ``type``, ``function.name`` and empty arguments; the next ones
    ``index`` and argument text only (chunks are written with exclude_unset)."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# -- tokenizer endpoints (vLLM's /tokenize, /detokenize, /tokenizer_info) ---------------------------
class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfoResponse(OpenAIBaseModel):
    """tokenizer_config.json without file paths, plus the class and the served chat template (vLLM's shape)."""

    tokenizer_class: str


class VersionResponse(OpenAIBaseModel):
    version: str


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class CoreFeatures(OpenAIBaseModel):
    """What the served core can report (Ignition's extension of vLLM's model card)."""

    allow_logprobs: bool
    max_logprobs: int
    explicit_ids: bool
    max_logprob_token_ids: int
    prompt_logprobs: bool
    chat_template: bool
    structured_output: bool = False  # token bitmask and logit-bias inputs: response_format, structured_outputs, ...


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ignition"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)
    features: CoreFeatures


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
