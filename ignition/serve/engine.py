"""The engine behind the HTTP server: one thread drives the (not thread-safe) Engine.

Handlers talk to it through a command queue (submit, cancel) and receive each request's
output through a bounded asyncio queue of deltas. A delta is sent only while the request's
queue has room; otherwise new entries wait in the engine and are coalesced into the next
delta, so a slow reader never blocks generation for others and never grows a queue.
Delivered entries are moved out of the engine state: nothing keeps a response history.
A request that ends on EOS or a ``stop_token_ids`` token has no entry for that token (the logprob
contract); the runtime keeps which token it was (``RequestState.stop_token``, also the EOS that a complete
grammar forces next), and the last delta carries it, so usage and ``token_ids`` count it as vLLM does.
The coalesced entries are bounded too: once ``entry_limit`` wait undelivered, the engine stops
scheduling that request (its slot stays held) until the reader drains them, so a request holds
at most ``entry_limit + T`` entries whatever its max_tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ignition.catalog.abi import TokenEntry
from ignition.runtime.engine import Engine
from ignition.runtime.parallel.group import ParallelError
from ignition.runtime.requests import Request, RequestState
from ignition.runtime.samples import sample_ids
from ignition.runtime.verified import CoreRunError

log = logging.getLogger("ignition.serve")
ENGINE_STOP_SECONDS = 5
"""How long stopping the server waits for the engine thread (SIGTERM must stop it within 10 s in all)."""


@dataclass(slots=True)
class Delta:
    """What one request produced since the previous delta."""

    entries: list[TokenEntry] = field(default_factory=list)
    prompt_entries: list[dict | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stop_token: int | None = None  # the EOS or stop_token_ids token that ended the request (no entry)
    stop_by_eos: bool = False  # that token ended it as EOS (vLLM's stop_reason is then None, not the id)
    error_param: str | None = None  # the request field an error is due to (its constraints): answered as a 400


class EngineStopped(RuntimeError):
    """The engine thread stopped serving (a loader failure); the server answers 503."""


class RequestStream:
    """The handler's end of one admitted request."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, wake, capacity: int):
        self.request_id = request_id
        self.loop, self._wake = loop, wake
        self.queue: asyncio.Queue[Delta] = asyncio.Queue(maxsize=capacity)
        self.capacity = capacity
        self.scheduled = 0  # written by the engine thread only
        self.received = 0  # written by the event loop only

    def has_room(self) -> bool:
        return self.scheduled - self.received < self.capacity

    async def get(self) -> Delta:
        delta = await self.queue.get()
        self.received += 1
        self._wake()  # room again: the engine thread may owe this request a coalesced delta
        return delta


@dataclass(slots=True)
class _Tracked:
    stream: RequestStream
    state: RequestState
    prompt_sent: int = 0


class AsyncEngine:
    """Owns the Engine and the single thread that steps it."""

    def __init__(self, engine: Engine, queue_capacity: int = 4, entry_limit: int = 64,
                 health: Callable[[], None] | None = None):
        """``health``: called on the engine thread at least once a second, also while idle; an exception
        it raises stops the engine like a failed step (a tensor-parallel rank that died: RankGroup.check)."""
        self.engine = engine
        self.health = health
        self.on_dead: Callable[[BaseException], None] | None = None  # called once, on the engine thread
        self.queue_capacity = queue_capacity
        engine.entry_limit = entry_limit  # bounds the entries coalesced for a lagging reader
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self.dead: str | None = None  # why the engine thread stopped serving, if it did
        self._thread = threading.Thread(target=self._run, name="ignition-engine", daemon=True)

    # -- handler side (event loop) ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step; a step that hangs is left to the (daemon) thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=ENGINE_STOP_SECONDS)

    async def submit(self, request: Request) -> RequestStream:
        """Admit a request that passed ``check_admission`` against this engine (``build_request`` checks every prompt
        of a request before any is submitted), so the engine does not check it again; an AdmissionError the engine
        still raises (a sample group it cannot hold) is raised here, before anything is sent to the client."""
        if request.n != 1:
            raise ValueError("a request for several samples is admitted with submit_samples")
        (stream,) = await self._submit(request, [request.request_id])
        return stream

    async def submit_samples(self, request: Request) -> list[RequestStream]:
        """Admit a request for ``request.n`` samples (its ``request_id`` names the group): one stream per sample,
        in index order, each the stream of an engine request ``samples.sample_ids`` names."""
        if not request.request_id:
            raise ValueError("a request for several samples needs a request_id")
        return await self._submit(request, sample_ids(request.request_id, request.n) if request.n > 1
                                  else [request.request_id])

    async def _submit(self, request: Request, ids: list[str]) -> list[RequestStream]:
        if self.dead is not None:
            raise EngineStopped(f"the engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(request_id, loop, self._wakeup.set, self.queue_capacity) for request_id in ids]
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("submit", request, streams, admitted))
        self._wakeup.set()
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:  # the handler went away while waiting: the request must not run on
            for request_id in ids:
                self.cancel(request_id)
            raise
        return streams

    def cancel(self, request_id: str) -> None:
        """Abort a request (client gone, or a stop string ended it), or every sample of a group by the group's id;
        its slots are freed on the engine thread."""
        self._commands.put(("cancel", request_id, None, None))
        self._wakeup.set()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wakeup.clear()
            try:
                self._apply_commands()
                worked = self.dead is None and self._healthy() and self._step()
                self._deliver()
            except Exception as exc:  # a bug in the thread's own bookkeeping fails the requests, not hangs them
                log.exception("engine thread failed")
                if self.dead is None:
                    self._die(exc)
                worked = False
            if not worked:
                self._wakeup.wait(timeout=1.0)
        for tracked in self._tracked.values():
            self.engine.cancel(tracked.stream.request_id)
        while True:  # submissions still queued: their handlers get a 503 instead of waiting forever
            try:
                kind, _, _, admitted = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit" and admitted.set_running_or_notify_cancel():
                admitted.set_exception(EngineStopped("the server is stopping"))

    def _healthy(self) -> bool:
        if self.health is None:
            return True
        try:
            self.health()
        except Exception as exc:
            self._die(exc)
            return False
        return True

    def _step(self) -> bool:
        try:
            return self.engine.step()
        except CoreRunError as exc:  # the core's graph failed: the requests it ran fail, the others go on
            self._fail_running(exc)
            return True
        except ParallelError as exc:  # a tensor-parallel rank died: its message says which, no traceback needed
            log.error("engine step failed: %s", exc)
            self._die(exc)
            return False
        except Exception as exc:  # a loader bug must fail its requests, not hang their clients
            log.exception("engine step failed")
            self._die(exc)
            return False

    def _fail_running(self, exc: CoreRunError) -> None:
        """A step's graph failed (an index out of range, an allocation the machine cannot meet; the message names
        the variant): every running request ends with the error, which its handler answers as a 500 "core error",
        and their slots are freed; waiting requests are admitted by the next step. The failure is logged once,
        without a traceback: the core is at fault, not the server."""
        error = f"core error: {exc}"
        failed = list(self.engine.running)
        log.error("%s (%d running request%s failed; serving goes on)", error, len(failed), "" if len(failed) == 1
                  else "s")
        scheduler = self.engine.scheduler
        for state in failed:
            scheduler.finish(state, "error", error)
        scheduler.release_retiring(list(self.engine.retiring))  # their records-only lanes rode the failed round

    def _die(self, exc: BaseException) -> None:
        self.dead = f"{type(exc).__name__}: {exc}"
        for tracked in self._tracked.values():
            tracked.state.finish_reason, tracked.state.error = "error", self.dead
        if self.on_dead is not None:
            self.on_dead(exc)

    def _apply_commands(self) -> None:
        while not self._stopping:  # a stop (SIGTERM) does not wait for a long queue of submissions
            try:
                kind, payload, stream, admitted = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                # The handler may have left while this command waited (its cancelled future is then final): such a
                # request is not admitted. Once claimed here, the future can no longer be cancelled under us.
                if not admitted.set_running_or_notify_cancel():
                    continue
                if self.dead is not None:
                    admitted.set_exception(EngineStopped(f"the engine stopped: {self.dead}"))
                    continue
                try:  # the handler checked it against this engine before it was sent (serve/requests.py build_request)
                    request_id = self.engine.submit(payload, checked=True)
                except Exception as exc:  # AdmissionError (a 400), or a loader bug: the handler reports it
                    admitted.set_exception(exc)
                    continue
                for sample_id, sample_stream in zip(self.engine.samples(request_id), stream, strict=True):
                    self._tracked[sample_id] = _Tracked(sample_stream, self.engine.state(sample_id))
                admitted.set_result(request_id)
            else:
                for request_id in self.engine.samples(payload):  # a group's id cancels each of its samples
                    if self._tracked.pop(request_id, None) is not None:
                        self.engine.cancel(request_id)
                        self.engine.finished.pop(request_id, None)

    def _deliver(self) -> None:
        for request_id, tracked in list(self._tracked.items()):
            state, stream = tracked.state, tracked.stream
            finished = state.finish_reason is not None
            fresh_prompt = len(state.prompt_entries) > tracked.prompt_sent
            if not (state.entries or fresh_prompt or finished) or not stream.has_room():
                continue
            delta = Delta(state.entries, state.prompt_entries[tracked.prompt_sent:])
            state.entries = []  # handed over: the engine keeps no response history
            tracked.prompt_sent = len(state.prompt_entries)
            if finished:
                delta.finish_reason, delta.error = state.finish_reason, state.error
                delta.error_param = state.error_param
                delta.stop_token, delta.stop_by_eos = state.stop_token, state.stop_by_eos
                del self._tracked[request_id]
                self.engine.finished.pop(request_id, None)
            stream.scheduled += 1
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
            except RuntimeError:  # the handler's event loop is closed: nobody will read this request
                self._tracked.pop(request_id, None)
                self.engine.cancel(request_id)
                self.engine.finished.pop(request_id, None)

    # -- introspection ---------------------------------------------------------------------
    @property
    def max_context(self) -> int | None:
        """Prompt plus max_tokens the engine admits (--max-model-len, else the core's context)."""
        return self.engine.max_context

    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    def load(self) -> dict[str, int]:
        engine = self.engine
        return {"running": len(engine.running), "waiting": len(engine.waiting),
                "free_slots": len(engine.free_slots), "num_slots": engine.num_slots, "tracked": len(self._tracked),
                "prefill_chunks": engine.stats["prefill_chunks"],
                "prompt_tokens_prefilled": engine.stats["prompt_tokens_prefilled"]} | engine.kv_cache_stats()
