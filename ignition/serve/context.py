"""What every handler reads: the served core, its engine and tokenizer, the server's options and metrics, and the
checks of a prompt's text against them (``ServerContext``)."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from ignition.runtime.core import LoadedCore
from ignition.runtime.grammar import GrammarCompiler, GrammarSetupError
from ignition.serve.config import MAX_BATCH_PROMPTS, ServeConfig
from ignition.serve.detokenize import TokenTable
from ignition.serve.engine import AsyncEngine
from ignition.serve.errors import ApiError, tokenizer_errors
from ignition.serve.metrics import ServerMetrics

PREPROCESS_THREADS = 2
"""Threads that tokenize, render templates and detokenize echoed prompts, off the event loop."""


@dataclass(slots=True)
class ServerContext:
    """Everything a handler needs: the core, its engine, the tokenizer files, the server's options and metrics."""

    core: LoadedCore
    engine: AsyncEngine
    table: TokenTable
    model_name: str
    config: ServeConfig
    metrics: ServerMetrics
    tokenizer: object | None = None
    tokenizer_dir: Path | None = None
    tokenizer_config: dict = field(default_factory=dict)
    chat_template: str | None = None
    chat_template_source: str = ""
    max_batch_prompts: int = MAX_BATCH_PROMPTS
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=PREPROCESS_THREADS, thread_name_prefix="ignition-preprocess"))
    grammars: GrammarCompiler | str | None = None  # made on first use: the compiler, or why there is none
    grammars_lock: threading.Lock = field(default_factory=threading.Lock)
    longest_token: int | None = None  # characters of the tokenizer's longest vocabulary entry, read on first use

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"The model `{name}` does not exist.", "model", HTTPStatus.NOT_FOUND, "NotFoundError")

    async def run(self, fn, *args):
        """``fn(*args)`` on a preprocessing thread: tokenizing, templating and detokenizing never block the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def grammar_compiler(self, param: str) -> GrammarCompiler:
        """The core's grammar compiler (made once, from the tokenizer's tokenizer.json text, the core's padded
        vocabulary and EOS), or a 400 naming ``param`` when the tokenizer cannot drive the grammar engine."""
        with self.grammars_lock:
            if self.grammars is None:
                self.grammars = self._make_grammar_compiler()
        if isinstance(self.grammars, str):
            raise ApiError(f"`{param}` cannot be served: {self.grammars}", param)
        return self.grammars

    def _make_grammar_compiler(self) -> GrammarCompiler | str:
        if self.tokenizer is None:
            return f"this core has no tokenizer ({self.core.path}/tokenizer/tokenizer.json) to compile grammars for"
        eos = self.core.spec.eos_token_id
        if eos is None:  # the graph then stops on no token; the grammar still needs one to end on
            name = self.tokenizer_config.get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
            eos = self.tokenizer.token_to_id(name) if isinstance(name, str) else None
        try:
            return GrammarCompiler(self.tokenizer.to_str(), self.core.spec.vocab_padded, eos)
        except GrammarSetupError as exc:
            return str(exc)

    def check_text(self, text: str, param: str) -> bytes:
        """The UTF-8 of a prompt text, or a 400: lone surrogates, or more bytes than --max-prompt-bytes."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(f"{param} contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                           f"{exc.start}: text must be valid Unicode", param) from None
        if len(data) > self.config.max_prompt_bytes:
            raise ApiError(f"{param} has {len(data)} bytes of text; this server accepts at most "
                           f"{self.config.max_prompt_bytes} (--max-prompt-bytes)", param)
        return data

    def truncation(self, keep: int | None) -> int | None:
        """How many prompt tokens ``truncate_prompt_tokens`` keeps (the last ones, as in vLLM): -1 is the
        context length; None keeps all."""
        if keep is None or (keep == -1 and self.max_context is None):
            return None
        if keep == -1:
            return self.max_context
        if keep < 1:
            raise ApiError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {keep}",
                           "truncate_prompt_tokens")
        if self.max_context is not None and keep > self.max_context:
            raise ApiError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                           f"({self.max_context}); select a smaller truncation size", "truncate_prompt_tokens")
        return keep

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``ids`` (see ``truncation``)."""
        kept = self.truncation(keep)
        return ids if kept is None else ids[-kept:]

    def max_prompt_chars(self, tokens: int) -> int | None:
        """The most characters ``tokens`` tokens can cover: ``tokens`` times the longest vocabulary entry (None
        without a tokenizer). vLLM's bound (``TokenizeParams._text_len_check`` in vllm/renderers/params.py, with
        ``max_chars_per_token`` the longest token of vllm/tokenizers/hf.py): a longer text cannot fit, so it is
        refused before it is tokenized and tokenizing costs time and memory in proportion to the context."""
        if self.tokenizer is None:
            return None
        if self.longest_token is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self.longest_token = max(1, max((len(token) for token in vocab), default=1))
        return tokens * self.longest_token

    def encode(self, text: str, add_special_tokens: bool, param: str, truncate: int | None = None) -> list[int]:
        """Token ids of a prompt text, the last ``truncate`` (``truncate_prompt_tokens``) when given (call it
        through ``run``: a long text takes a while). A text longer than the context can hold is refused before
        it is tokenized (``max_prompt_chars``); with truncation only its last characters are tokenized."""
        if self.tokenizer is None:
            raise ApiError(f"this core has no tokenizer ({self.core.path}/tokenizer/tokenizer.json): send the "
                           "prompt as token ids", param)
        self.check_text(text, param)
        kept = self.truncation(truncate)
        if kept is not None:
            # the last ``kept`` tokens lie within the last kept * longest characters: one token more of text
            # (tokenized and dropped) keeps the cut away from the tokens kept
            text = text[-self.max_prompt_chars(kept + 1):]
        elif self.max_context is not None and len(text) > (bound := self.max_prompt_chars(self.max_context)):
            raise ApiError(f"{param} has {len(text)} characters, more than the context of {self.max_context} tokens "
                           f"can hold: this tokenizer's longest token has {self.longest_token} characters, so at "
                           f"most {bound} characters fit; shorten the prompt", param)
        # NOTE: encode_batch, not encode: only the batch call releases the GIL while Rust tokenizes, and a
        # multi-megabyte prompt holding it would stall the event loop as surely as tokenizing on it
        with tokenizer_errors(param):
            encoding = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if kept is not None:
            return encoding.ids[-kept:]
        if self.max_context is not None and len(encoding) > self.max_context:  # before a list of millions of ids
            raise ApiError(f"{param} has {len(encoding)} tokens, more than the context of {self.max_context} tokens",
                           param)
        return encoding.ids
