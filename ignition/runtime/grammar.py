"""Structured output: compiled grammars (llguidance) and per-request matchers that fill ``token_bitmask`` rows.

1. ``runtime/grammar_spec.py`` turns a request's ``response_format`` / ``structured_outputs`` into a ``GrammarSpec``.
2. ``GrammarCompiler(tokenizer_json, vocab_padded, eos_token_id)`` compiles specs on its own worker threads
   (llguidance releases the GIL while it builds a grammar): ``submit(spec)`` returns a ``Future`` (an event loop
   awaits ``asyncio.wrap_future(...)``), ``compile(spec)`` waits for it. Results are cached by ``spec.key``
   (kind, canonical spec, whitespace options), least recently used first out; concurrent requests for one spec
   share one compilation, and a spec that failed fails again from the cache without recompiling.
3. ``compiler.matcher(compiled)`` gives a request its own ``GrammarMatcher`` (a copy of the compiled template):
   ``accept(token)`` advances it on every emitted token, ``fill(row)`` writes the next step's allowed tokens into
   an int32 ``token_bitmask`` row (bit ``i`` of word ``w`` allows token ``32*w+i``), and
   ``GrammarMatcher.fill_many`` fills many lanes at once on llguidance's own thread pool.
4. ``prefetch()`` starts the next row's fill on a worker thread as soon as a step's tokens are accepted, so it
   overlaps whatever the engine does before the next submission (the other lanes' records, a prefill round);
   the next ``fill``/``fill_many`` copies the ready row and waits only for what is left of it. Every other use of
   the matcher waits for a fill in flight first (llguidance holds the matcher while it fills, without the GIL).

A spec the engine cannot compile raises ``GrammarError`` naming the request field and, for JSON Schema, the
unsupported keywords (``constructs``). Nothing here imports the HTTP layer.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from ignition.catalog.contract import bitmask_words
from ignition.runtime.grammar_spec import GrammarError, GrammarSpec, grammar_spec, guidance_options

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_MAX_MESSAGE = 600  # llguidance quotes the grammar around a syntax error; keep the head of it
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors name the problem, not the parser state


class GrammarSetupError(RuntimeError):
    """The core's tokenizer cannot drive the grammar engine: the server serves without structured output."""


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow was emitted (a forced token, or a bug upstream); ``lane`` is
    the bitmask row at fault when raised by ``GrammarMatcher.fill_many``."""

    def __init__(self, message: str, lane: int | None = None):
        super().__init__(message)
        self.lane = lane


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec; GrammarError for what cannot even be translated (GBNF syntax)."""
    if spec.kind in ("json", "json_object"):
        options = guidance_options(spec.whitespace_flexible, spec.whitespace_pattern)
        try:  # serde_json's recursion limit refuses a schema nested more than 128 levels deep
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=options)
        except ValueError as exc:
            raise GrammarError(f"{spec.param}: cannot read this JSON Schema: {exc} (the grammar engine reads JSON "
                               "nested at most 128 levels deep)", spec.param) from None
    try:
        return llguidance.grammar_from(spec.kind, spec.source)  # Lark or GBNF, a regex, a JSON list of choices
    except ValueError as exc:
        raise GrammarError(f"{spec.param}: {exc}", spec.param) from None


def _compile_error(spec: GrammarSpec, message: str) -> GrammarError:
    constructs: tuple[str, ...] = ()
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        constructs = tuple(json.loads(unimplemented.group(1)))
        what = f"unsupported JSON Schema keyword{'s' if len(constructs) > 1 else ''} {', '.join(constructs)}"
    else:
        what = message.strip()[:_MAX_MESSAGE]
    return GrammarError(f"{spec.param}: cannot compile this {spec.kind.replace('_', ' ')} constraint: {what}",
                        spec.param, constructs)


_EXECUTOR: list[llguidance.LLExecutor] = []  # one llguidance thread pool for every batch fill, made on first use
_EXECUTOR_LOCK = threading.Lock()
MASK_THREADS: int | None = None
"""Threads of that pool (None: llguidance's default, 80% of the CPUs up to 32); set before the first fill."""


def _executor() -> llguidance.LLExecutor:
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor(MASK_THREADS))
        return _EXECUTOR[0]


@functools.cache
def _prefetcher() -> ThreadPoolExecutor:
    """The workers of ``GrammarMatcher.prefetch``, made on first use."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")


class CompiledGrammar:
    """A spec compiled for one tokenizer: a template matcher that every request copies."""

    __slots__ = ("spec", "seconds", "_template", "_lock")

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, seconds: float):
        self.spec, self.seconds, self._template, self._lock = spec, seconds, template, threading.Lock()

    def copy_matcher(self) -> llguidance.LLMatcher:
        with self._lock:  # one borrow of the shared template at a time
            return self._template.deep_copy()


def _fill_row(matcher: llguidance.LLMatcher, row: np.ndarray) -> None:
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class GrammarMatcher:
    """One request's position in its grammar; used from one thread (the engine's) plus its own prefetch."""

    __slots__ = ("spec", "words", "_matcher", "_ahead", "_ahead_row")

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher, words: int):
        self.spec, self.words, self._matcher = spec, words, matcher
        self._ahead: Future | None = None  # the prefetched fill of the current position, in flight or done
        self._ahead_row: np.ndarray | None = None

    def _settle(self) -> np.ndarray | None:
        """Wait for a prefetched fill; its row (for the current position), or None when none was started."""
        ahead, row = self._ahead, self._ahead_row
        if ahead is None:
            return None
        self._ahead = self._ahead_row = None
        ahead.result()
        return row

    @property
    def stopped(self) -> bool:
        """The grammar is complete and can take no further token: finish the request (finish reason ``stop``)."""
        self._settle()
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed next)."""
        self._settle()
        return self._matcher.is_accepting()

    def fork(self) -> "GrammarMatcher":
        """An independent matcher at this one's position (another sample of the same request)."""
        self._settle()
        return GrammarMatcher(self.spec, self._matcher.deep_copy(), self.words)

    def accept(self, token: int) -> None:
        """Advance over an emitted token; GrammarViolation when the grammar does not allow it."""
        self._settle()  # a prefetched row is for the position before this token: dropped
        if not self._matcher.consume_token(int(token)):
            raise GrammarViolation(f"token {token} is not allowed by the {self.spec.kind} constraint "
                                   f"({self.spec.param}): {self._matcher.get_error()}")

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted tokens (speculative rounds that reject a draft)."""
        self._settle()
        if not self._matcher.rollback(tokens):
            raise GrammarViolation(f"cannot roll back {tokens} tokens: {self._matcher.get_error()}")

    def prefetch(self) -> None:
        """Start filling the current position's row on a worker thread (no GIL while llguidance fills); the next
        ``fill``/``fill_many`` takes it. Nothing to do when a fill is already in flight or the grammar stopped."""
        if self._ahead is not None or self._matcher.is_stopped() or self._matcher.is_error():
            return
        row = np.empty(self.words, dtype=np.int32)
        # the work item holds the row (and the matcher) until the fill ends, even when this matcher is dropped first
        self._ahead_row, self._ahead = row, _prefetcher().submit(_fill_row, self._matcher, row)

    def fill(self, row: np.ndarray) -> None:
        """Write the next step's allowed tokens into ``row``: int32 [VOCAB_WORDS], contiguous."""
        if row.dtype != np.int32 or row.shape != (self.words,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a bitmask row is a contiguous int32 [{self.words}], got {row.dtype} {list(row.shape)}")
        ahead = self._settle()
        if ahead is not None:
            row[:] = ahead
        else:
            _fill_row(self._matcher, row)
        if self._matcher.is_error():
            raise GrammarViolation(f"{self.spec.param}: {self._matcher.get_error()}")

    @staticmethod
    def fill_many(lanes: Sequence[tuple["GrammarMatcher", int]], bitmask: np.ndarray) -> None:
        """Fill ``bitmask[index]`` (contiguous int32 [rows, VOCAB_WORDS]) for every (matcher, index): prefetched
        rows are copied, the others filled in parallel on llguidance's thread pool (without the GIL)."""
        if not lanes:
            return
        words = lanes[0][0].words
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != words \
                or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a bitmask is a contiguous int32 [rows, {words}], got {bitmask.dtype} "
                             f"{list(bitmask.shape)}")
        rest = []
        for lane, index in lanes:
            ahead = lane._settle()
            if ahead is None:
                rest.append((lane._matcher, index))
            else:
                bitmask[index] = ahead
        if rest:
            _executor().unsafe_compute_mask_ptr(rest, bitmask.ctypes.data, words * 4, bitmask.shape[0])
        for lane, index in lanes:
            if lane._matcher.is_error():
                raise GrammarViolation(f"{lane.spec.param}: {lane._matcher.get_error()}", index)


class GrammarCompiler:
    """Compiles and caches specs for one core's tokenizer; thread-safe.

    ``vocab_padded`` sets the row width (``ceil(vocab_padded / 32)`` words); ``eos_token_id`` is the token a
    grammar allows once its text is complete (the core's EOS, or the tokenizer's when the core declares none).
    """

    def __init__(self, tokenizer_json: str, vocab_padded: int, eos_token_id: int | None, *, workers: int = 2,
                 cache_size: int = 256):
        if eos_token_id is None:
            raise GrammarSetupError("structured output needs an end-of-sequence token: the core declares no "
                                    "eos_token_id and none was given")
        self.words = bitmask_words(vocab_padded)
        self.eos_token_id = eos_token_id
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_padded, eos_token=eos_token_id)
        except (ValueError, RuntimeError) as exc:
            raise GrammarSetupError(f"the core's tokenizer cannot drive the grammar engine: {exc}") from None
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")

    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the CompiledGrammar (its exception: GrammarError); cached by ``spec.key``."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self.submit(spec).result()

    def compile_request(self, response_format: dict | None = None,
                        structured_outputs: dict | None = None) -> CompiledGrammar | None:
        """``grammar_spec`` then ``compile``: None for a request without a constraint."""
        spec = grammar_spec(response_format, structured_outputs)
        return None if spec is None else self.compile(spec)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        started = time.perf_counter()
        template = llguidance.LLMatcher(self.tokenizer, _grammar_text(spec), log_level=0, limits=_LIMITS)
        if template.is_error():
            raise _compile_error(spec, template.get_error())
        return CompiledGrammar(spec, template, time.perf_counter() - started)

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``'s grammar, for one request."""
        return GrammarMatcher(compiled.spec, compiled.copy_matcher(), self.words)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarSetupError", "GrammarSpec",
           "GrammarViolation", "grammar_spec"]
