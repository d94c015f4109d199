"""Requests and admission: everything a request can get wrong is rejected before it is admitted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ignition.catalog.abi import TokenEntry
from ignition.catalog.buffers import SAMPLING_DEFAULTS
from ignition.catalog.contract import MAX_SELECTED_IDS
from ignition.catalog.limits import check_limit
from ignition.catalog.manifest import Manifest
from ignition.runtime.constraints import LaneConstraints


class AdmissionError(ValueError):
    """A request the core cannot serve; the HTTP front end maps it to 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


DEFAULT_MAX_TOKENS = 16
"""Tokens generated when a request names no limit: ``ignition run``, the runtime's ``Request`` and Completions
(vLLM's and OpenAI's Completions default)."""

_D = SAMPLING_DEFAULTS


@dataclass(slots=True)
class SamplingParams:
    """One request's sampling; every default is the catalog's (``SAMPLING_DEFAULTS``)."""

    temperature: float = _D["temperature"]
    top_k: int = _D["top_k"]
    top_p: float = _D["top_p"]
    min_p: float = _D["min_p"]
    repetition_penalty: float = _D["repetition_penalty"]
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    seed: int | None = None  # None: a seed derived from the request id (ignition/runtime/bindings.py)


@dataclass(slots=True)
class Request:
    """One generation request, in token ids."""

    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # natural alternatives 0..K (None: no logprobs)
    logprob_token_ids: list[int] | None = None  # explicit ids, reported in caller order
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    forced_tokens: dict[int, int] = field(default_factory=dict)  # generated index -> token emitted without logprob
    prompt_logprobs: int | None = None
    request_id: str = ""
    n: int = 1  # samples of this prompt (ignition/runtime/samples.py): the prompt is prefilled once for all
    constraints: LaneConstraints | None = None  # structured output and sampling controls (runtime/constraints.py)
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only between equal salts (vLLM's)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or bool(self.logprob_token_ids)


@dataclass(slots=True)
class RequestState:
    """One admitted request as the engine tracks it: its lane (slot, epoch), its progress and, once finished, how it
    ended. The scheduler, the sample groups, the constraints and the drafter all work on this one type."""

    request: Request
    request_id: str
    slot: int = -1
    epoch: int = 0
    prefilled: int = 0  # context tokens already in the KV state
    generated: list[int] = field(default_factory=list)
    prompt_entries: list[dict | None] = field(default_factory=list)  # published prompt scores, position 0 first
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    group: object | None = None  # SampleGroup: a sample of an n > 1 request (ignition/runtime/samples.py)
    prompt_source: RequestState | None = None  # the sibling whose slot will hold the prompt state to copy
    grammar_ended: bool = False  # finished "stop" because its grammar is complete: the EOS it forces next is implied
    error_param: str | None = None  # the request field an "error" finish is due to (its constraints): a client error
    stop_token: int | None = None  # the EOS or stop_token_ids token that ended it "stop" (it has no entry)
    stop_by_eos: bool = False  # that token ended it as EOS (vLLM's stop_reason is then None, not the id)
    block_table: list[int] = field(default_factory=list)  # paged KV: the pool block of each block_size positions
    block_hashes: list[bytes] = field(default_factory=list)  # the hash chain of its full blocks (block_manager.py)
    cached_blocks: int = 0  # leading block_table entries already looked up or registered in the prefix cache
    window_table: list[int] = field(default_factory=list)  # the sliding pools' blocks (kv_groups.py), null once released
    window_cached_blocks: int = 0  # leading window_table entries looked up or registered in the sliding group's cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def context(self) -> list[int]:
        """Tokens the KV state must hold before the next decode: the prompt, then all but the last generated."""
        return self.request.prompt_ids + self.generated[:-1]

    def scoring(self) -> bool:
        return self.request.prompt_logprobs is not None and len(self.prompt_entries) < len(self.request.prompt_ids)


def check_admission(request: Request, spec: Manifest, max_context: int | None) -> None:
    """Raise AdmissionError with an exact message for anything this core (its typed manifest) cannot serve."""
    vocab_size = spec.vocab_size
    if not request.prompt_ids:
        raise AdmissionError("prompt must contain at least one token", "prompt")
    if request.n < 1:
        raise AdmissionError(f"n must be at least 1, got {request.n}", "n")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise AdmissionError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    problem = check_limit("max_tokens", request.max_tokens)
    if problem:
        raise AdmissionError(problem, "max_tokens")
    if max_context is not None and len(request.prompt_ids) + request.max_tokens > max_context:
        raise AdmissionError(f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds "
                             f"the core's context of {max_context} tokens", "max_tokens")
    check_options(request, spec)


def check_options(request: Request, spec: Manifest) -> None:
    """The part of check_admission that needs no prompt: logprob options against the core's features
    (from its manifest alone, so ``ignition run`` refuses them before loading) and sampling ranges."""
    k, features, vocab_size = spec.k, spec.features, spec.vocab_size
    if request.wants_logprobs and not features.allow_logprobs:
        raise AdmissionError("this core was exported without logprob outputs (allow_logprobs: false)", "logprobs")
    if request.logprobs is not None and not 0 <= request.logprobs <= k:
        raise AdmissionError(f"logprobs must be between 0 and {k}, got {request.logprobs}", "logprobs")
    if request.logprob_token_ids is not None:
        ids = request.logprob_token_ids
        if not features.explicit_ids:
            raise AdmissionError("this core does not support logprob_token_ids (no explicit-ID inputs)", "logprob_token_ids")
        if request.logprobs not in (None, 0):
            raise AdmissionError("logprob_token_ids cannot be combined with logprobs > 0", "logprob_token_ids")
        if not 1 <= len(ids) <= MAX_SELECTED_IDS:
            raise AdmissionError(f"logprob_token_ids must hold 1 to {MAX_SELECTED_IDS} ids, got {len(ids)}",
                                 "logprob_token_ids")
        if len(set(ids)) != len(ids):
            duplicate = next(t for t in ids if ids.count(t) > 1)
            raise AdmissionError(f"logprob_token_ids contains duplicate id {duplicate}", "logprob_token_ids")
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise AdmissionError(f"logprob_token_ids id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                                 "logprob_token_ids")
    if request.prompt_logprobs is not None:
        if not features.prompt_logprobs:
            raise AdmissionError("this core was exported without prompt scoring (--prompt-logprobs)", "prompt_logprobs")
        if not 0 <= request.prompt_logprobs <= k:
            raise AdmissionError(f"prompt_logprobs must be between 0 and {k}, got {request.prompt_logprobs}",
                                 "prompt_logprobs")
    if request.constraints is not None and request.constraints.fields and not features.structured_output:
        fields = request.constraints.fields
        raise AdmissionError(f"this core was exported without the structured-output inputs (token_bitmask, logit "
                             f"bias), so it cannot serve {', '.join(fields)}; re-export it", fields[0])
    check_sampling(request.sampling)


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def check_sampling(sampling: SamplingParams) -> None:
    """Every sampling value against its range in ``catalog.limits.LIMITS`` (NaN and infinities included)."""
    for name in SAMPLING_FIELDS:
        value = getattr(sampling, name)
        problem = None if value is None else check_limit(name, value)
        if problem:
            raise AdmissionError(f"sampling parameters out of range: {problem}", name)


def check_server_request(request: Request, vocab_size: int) -> None:
    """What the HTTP front end checks on top of check_admission: values the input buffers must hold."""
    outside = [t for t in request.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise AdmissionError(f"stop_token_ids id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                             "stop_token_ids")
