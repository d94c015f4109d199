"""Tensor-parallel start-up: N rank processes over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Rank 0 is the calling process: it owns the engine, the HTTP server and the frame readback.
Ranks 1..N-1 are worker processes (``python -m ignition.runtime.parallel.rank_worker``) that load their own
shard of the core and replay the same submissions: before each graph run rank 0 wakes every
worker with the variant's index over its stdin pipe, then broadcasts the variant's input
buffers over the default process group; every rank then runs its graph, whose in-graph
collectives join the ranks. State (KV shards, penalty counts) evolves identically on every
rank: what rank 0 changes outside a graph (a prefix hit's penalty counts, the block manager's moves of blocks,
ignition/runtime/paging.py) travels on the next submission's line (``RankGroup.replay``), and every rank repeats it
before that graph runs. Peers never read frames back.

Where ranks meet and how they prove they belong is ignition/runtime/parallel/rendezvous.py: the store and
the transports on 127.0.0.1 unless ``host`` (``--tp-host``) says otherwise, a per-launch secret
and the store's port on the worker's stdin, the secret checked over the new group before any
request data. Under ``torchrun`` (``launched_by_torchrun``) every rank runs the same command: rank 0
serves, the others run ``rank_worker.torchrun_worker`` and are woken through the store instead of a
pipe, with messages sealed under the secret (rendezvous.py).

Failure is loud and bounded: the process group has a timeout (``PROCESS_GROUP_TIMEOUT_S``),
rank 0 checks its workers before every submission (and an idle server checks them every second,
``RankGroup.check``, then exits naming the rank), a watchdog thread ends the group when a worker
dies while rank 0 is blocked, and a worker whose stdin closes (rank 0 gone) exits.

Every choice arrives in one ``LoadOptions`` (ignition/runtime/options.py), which already refused a
backend that cannot replay rank shards; workers receive it whole on their stdin and take their device
from ``LoadOptions.rank_device``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ignition.catalog.manifest import Manifest
from ignition.catalog.enums import Role
from ignition.runtime.options import LoadOptions
from ignition.runtime.parallel.rendezvous import (STOP, MembershipError, PipeChannel, StoreChannel, check_host,
                                                  launched_by_torchrun, listening_store, new_secret, pin_interfaces,
                                                  prove_membership, torchrun_store)
from ignition.runtime.verified import LoadOptionError

WATCH_INTERVAL_S = 0.2


class ParallelError(RuntimeError):
    """A tensor-parallel group cannot start or has lost a rank; the message names the rank and the cause."""


class ParallelOptionError(ParallelError):
    """Options that cannot run tensor parallelism at all (a usage error, refused before anything starts)."""


def _input_tensors(variant) -> list[torch.Tensor]:
    """The buffers rank 0 uploads for a submission, in argument order (what every peer must receive)."""
    return [variant.buffers[a.name] for a in variant.arguments if a.role is Role.INPUT]


def join_group(store, options: LoadOptions, spec: Manifest, secret: str) -> None:
    """Join the default process group, check that it is the group the core's graphs were traced against, and
    prove to every rank that this one holds the launch's ``secret`` (before any request data travels)."""
    import torch.distributed as dist

    dist.init_process_group(options.collective_backend, store=store, rank=options.rank, world_size=options.ranks,
                            timeout=datetime.timedelta(seconds=options.timeout_s))
    expected = spec.parallel.group
    if dist.group.WORLD.group_name != expected:
        raise ParallelError(f"the default process group is named {dist.group.WORLD.group_name!r}, but the core's "
                            f"graphs were traced against group {expected!r}")
    prove_membership(secret, options.rank, options.ranks, options.device)


class _Replicated:
    """Rank 0's outermost replay layer: wake the workers, broadcast the inputs, run this rank's graph."""

    def __init__(self, group: "RankGroup", index: int, variant, inner):
        self.group, self.index, self.run, self.inputs = group, index, inner, _input_tensors(variant)

    def __call__(self, buffers):
        import torch.distributed as dist

        self.group.wake(self.group.submission(self.index))
        try:
            for tensor in self.inputs:
                dist.broadcast(tensor, src=0)
            return self.run(buffers)
        except RuntimeError as exc:  # a collective failed: a peer died or timed out
            raise self.group.failure(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


class RankGroup:
    """Rank 0's handle on the worker processes (ranks 1..N-1)."""

    def __init__(self, workers: list[subprocess.Popen], timeout_s: float, channel=None, port: int | None = None):
        self.workers, self.timeout_s, self.closed, self.port = workers, timeout_s, False, port  # port: the store's
        self.channel = channel or PipeChannel(workers)  # torchrun: a StoreChannel, and no worker processes
        self.pending: list[list] = []  # ``replay``'s operations, sent with the next submission
        self._watchdog = threading.Thread(target=self._watch, name="ignition-tp-watchdog", daemon=True)
        self._watchdog.start()

    def dead(self) -> list[tuple[int, int]]:
        return [(rank, p.returncode) for rank, p in enumerate(self.workers, start=1) if p.poll() is not None]

    def failure(self, cause: str) -> ParallelError:
        time.sleep(WATCH_INTERVAL_S)  # let a dying peer's exit status arrive, so the message can name it
        dead = self.dead()
        who = ", ".join(f"rank {r} exited with code {c}" for r, c in dead) or "a rank stopped responding"
        self.close(kill=True)
        return ParallelError(f"tensor-parallel group failed: {who} ({cause}); all ranks were stopped")

    def check(self, when: str = "found while idle") -> None:
        """Raise ParallelError naming the rank when a worker has exited (the group is then stopped)."""
        if self.closed:
            raise ParallelError("tensor-parallel group failed: its ranks were already stopped")
        if self.dead():
            raise self.failure(when)

    def replay(self, name: str, *arguments) -> None:
        """Every other rank repeats operation ``name`` with JSON ``arguments`` on its own core before the next
        submission (ignition/runtime/paging.py ``replay_operations``): a change rank 0 made outside a graph."""
        self.pending.append([name, *arguments])

    def submission(self, index: int) -> str:
        """The wake line of variant ``index``: its index, then the pending ``replay`` operations as JSON, if any."""
        line = str(index) if not self.pending else f"{index} {json.dumps(self.pending, separators=(',', ':'))}"
        self.pending = []
        return line

    def wake(self, line: str) -> None:
        self.check("found before a submission")
        try:
            self.channel.send(line)
        except (OSError, RuntimeError):  # a closed pipe, a lost store
            raise self.failure("its control channel closed") from None

    def _watch(self) -> None:
        """Rank 0 may be blocked inside a collective when a worker dies: end the process, never hang."""
        while not self.closed:
            dead = self.dead()
            if dead and not self.closed:
                time.sleep(self.timeout_s)  # the failing collective normally raises first (ParallelError)
                if not self.closed:
                    rank, code = dead[0]
                    print(f"error: tensor-parallel rank {rank} exited with code {code} and rank 0 is still blocked "
                          f"after {self.timeout_s:.0f} s; stopping", file=sys.stderr, flush=True)
                    self.close(kill=True)
                    os._exit(1)
            time.sleep(WATCH_INTERVAL_S)

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if kill:
            for process in self.workers:
                process.kill()
        else:
            try:
                self.channel.send(STOP)
            except (OSError, RuntimeError):
                pass
        for process in self.workers:
            try:
                process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _check_rank_count(core: Path, ranks: int) -> None:
    """Refuse a rank count the core does not have before any worker starts (load_core checks it again)."""
    from ignition.runtime.core import check_rank_count, read_manifest

    manifest = read_manifest(core)
    if manifest is not None:  # else load_core reports an unreadable core with the validator's findings
        check_rank_count(core, Manifest.from_json(manifest), ranks)


def _start_workers(core, options: LoadOptions):
    """Ranks 1..N-1 as child processes and rank 0's store on ``options.tp_host``; each worker's stdin gets the
    launch secret, the store's port, then the load options whole (none of them in argv, which every local user
    can read). Returns (store, secret, RankGroup)."""
    ranks, host, timeout_s = options.ranks, options.tp_host, options.timeout_s
    try:
        check_host(host)
        pinned = pin_interfaces(host)
        store = listening_store(host, ranks, timeout_s)
    except (ValueError, OSError) as exc:  # not an address of this machine, or one that cannot be bound
        raise ParallelOptionError(str(exc) if "--tp-host" in str(exc) else f"--tp-host {host}: {exc}") from None
    secret = new_secret()
    command = [sys.executable, "-m", "ignition.runtime.parallel.rank_worker", str(core)]
    environment = dict(os.environ, **pinned, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])))
    workers = [subprocess.Popen(command + ["--rank", str(rank)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                text=True, env=environment) for rank in range(1, ranks)]
    group = RankGroup(workers, timeout_s, port=store.port)
    for process in workers:
        try:
            process.stdin.write(f"{secret}\n{store.port}\n{options.to_json()}\n")
            process.stdin.flush()
        except OSError:
            pass  # the worker is already gone; the group start-up names it
    return store, secret, group


@contextmanager
def tensor_parallel(core: str | Path, ranks_or_options: int | LoadOptions, **choices):
    """Start the ranks of a sharded core; yields rank 0's LoadedCore (give it to an Engine), whose ``group``
    is the RankGroup of the workers.

    ``ranks_or_options``: a ``LoadOptions`` (its ``ranks``, ``tp_host``, ``timeout_s`` and the rest), or a rank
    count with keyword ``choices`` for ``LoadOptions.create``. Under torchrun
    this process must be rank 0 (``start_for_process`` runs the others) and torchrun's store is used.
    On exit the workers are stopped and the process group is destroyed.
    """
    import torch.distributed as dist

    from ignition.runtime.core import load_core

    options = _options(ranks_or_options, choices)
    ranks = options.ranks
    _check_rank_count(Path(core), ranks)
    if launched_by_torchrun():
        try:
            store, rank, secret = torchrun_store(ranks, options.timeout_s)
        except (MembershipError, ValueError) as exc:
            raise ParallelOptionError(str(exc)) from None
        if rank != 0:
            raise ParallelOptionError(f"torchrun rank {rank} runs torchrun_worker, not tensor_parallel")
        group = RankGroup([], options.timeout_s, StoreChannel(store, secret))
    else:
        store, secret, group = _start_workers(core, options)
    try:
        loaded = load_core(core, options)
        try:
            join_group(store, options, loaded.spec, secret)
        except RuntimeError as exc:
            raise group.failure(f"process-group start-up: {str(exc).splitlines()[0]}") from None
        for index, variant in enumerate(loaded.variants.values()):
            variant.wrap("replicated", lambda inner, i=index, v=variant: _Replicated(group, i, v, inner))
        loaded.group = group
        yield loaded
    finally:
        group.close(kill=bool(group.dead()))
        if dist.is_initialized():
            dist.destroy_process_group()


def _options(ranks_or_options: int | LoadOptions, choices: dict) -> LoadOptions:
    """The LoadOptions of a tensor-parallel start (ParallelOptionError when they cannot run one)."""
    if isinstance(ranks_or_options, LoadOptions):
        if choices:
            raise ParallelOptionError(f"pass either LoadOptions or keyword choices, not both ({', '.join(choices)})")
        options = ranks_or_options
    else:
        if "host" in choices:
            choices["tp_host"] = choices.pop("host")
        try:
            options = LoadOptions.create(ranks=ranks_or_options, **choices)
        except LoadOptionError as exc:
            raise ParallelOptionError(str(exc)) from None
    if options.ranks < 2:
        from ignition.catalog.parallel import MAX_TENSOR_PARALLEL
        raise ParallelOptionError(f"--tensor-parallel must be between 2 and {MAX_TENSOR_PARALLEL} to start ranks, "
                                  f"got {options.ranks}")
    return options


def start_for_process(core: str | Path, options: LoadOptions):
    """``tensor_parallel`` for a command-line process: the ranks stop when this process exits. (Under torchrun,
    a rank other than 0 runs ``rank_worker.torchrun_worker`` instead: the CLI's choice.)"""
    import atexit
    from contextlib import ExitStack

    stack = ExitStack()
    loaded = stack.enter_context(tensor_parallel(core, options))
    atexit.register(stack.close)
    return loaded
