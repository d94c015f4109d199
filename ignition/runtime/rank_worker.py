"""Ranks 1..N-1 of a tensor-parallel run: load this rank's shard, join the group, replay rank 0's submissions.

Started either by rank 0 (``python -m ignition.runtime.parallel``; the launch secret is the first line
of stdin, then one line per submission) or by torchrun (``torchrun_worker``; the secret comes from
IGNITION_TP_SECRET and the submissions through the store). ignition/runtime/parallel.py is rank 0's side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

from ignition.catalog.parallel import PROCESS_GROUP_TIMEOUT_S
from ignition.runtime.parallel import SUPPORTED_RUNTIME, _input_tensors, check_runtime, join_group
from ignition.runtime.rendezvous import LOOPBACK, STOP, store_lines, torchrun_store


def _replay(core, rank: int, ranks: int, device: str, timeout_s: float, connect, lines, load_options: dict) -> int:
    """Rank r >= 1: load the shard, join the group (``connect()`` -> (store, secret)), replay every submission
    ``lines`` announces until STOP or its end (rank 0 gone)."""
    import warnings

    import torch.distributed as dist

    from ignition.runtime.core import load_core
    from ignition.runtime.device import resolve_device

    warnings.simplefilter("ignore")  # rank 0 reports the same load warnings once
    try:
        resolved = resolve_device(device)
        if resolved.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun: this machine's rank
            resolved = torch.device("cuda", local % torch.cuda.device_count())
        loaded = load_core(core, device=resolved, rank=rank, tensor_parallel=ranks, **load_options)
        store, secret = connect()
        join_group(store, rank, ranks, resolved, loaded.manifest, timeout_s, secret)
        variants = list(loaded.variants.values())
        for line in lines(store):
            if line.strip() == STOP:
                break
            variant = variants[int(line)]
            for tensor in _input_tensors(variant):
                dist.broadcast(tensor, src=0)
            variant.run(variant.buffers)
    except Exception as exc:  # every failure ends this rank with one line naming it
        print(f"error: tensor-parallel rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def torchrun_worker(core: str | Path, ranks: int, *, device: str = "cpu", timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
                    runtime: str = SUPPORTED_RUNTIME, host: str = LOOPBACK, **load_options) -> int:
    """A rank >= 1 started by torchrun: the same load, group and secret check as a worker rank 0 started."""
    check_runtime(runtime, ranks)
    try:
        store, rank, secret = torchrun_store(ranks, timeout_s)
    except (RuntimeError, ValueError) as exc:  # MembershipError (no secret), the rank count, the rendezvous
        print(f"error: tensor-parallel rank {os.environ.get('RANK')}: {exc}", file=sys.stderr, flush=True)
        return 2
    return _replay(core, rank, ranks, device, timeout_s, lambda: (store, secret), store_lines, load_options)


def worker(argv: list[str] | None = None) -> int:
    """A rank rank 0 started: its first stdin line is the launch secret, then one line per submission."""
    parser = argparse.ArgumentParser(prog="python -m ignition.runtime.parallel")
    parser.add_argument("core")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=PROCESS_GROUP_TIMEOUT_S)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--trust-compiled", action="store_true")
    parser.add_argument("--trusted-key", default=None)
    args = parser.parse_args(argv)
    secret = sys.stdin.readline().strip()

    def connect():
        import torch.distributed as dist

        store = dist.TCPStore(args.host, args.port, args.ranks, is_master=False,
                              timeout=datetime.timedelta(seconds=args.timeout))
        return store, secret

    options = dict(eager=args.eager, trust_compiled=args.trust_compiled, trusted_key=args.trusted_key)
    return _replay(args.core, args.rank, args.ranks, args.device, args.timeout, connect, lambda store: sys.stdin,
                   options)
