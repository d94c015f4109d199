"""Ranks 1..N-1 of a tensor-parallel run: load this rank's shard, join the group, replay rank 0's submissions.

Started either by rank 0 (``python -m ignition.runtime.parallel.rank_worker CORE --rank R``; stdin carries the launch
secret, the store's port and rank 0's LoadOptions, one line each, then one line per submission: the variant's
index, then the operations to repeat before it as JSON when rank 0 has any, ``RankGroup.submission``) or by torchrun
(``torchrun_worker``; the secret comes from IGNITION_TP_SECRET and the submissions through the store, sealed
under it). ignition/runtime/parallel/group.py is rank 0's side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from ignition.runtime.options import LoadOptions
from ignition.runtime.parallel.group import _input_tensors, join_group
from ignition.runtime.parallel.rendezvous import STOP, store_lines, torchrun_store
from ignition.runtime.verified import LoadOptionError


def _replay(core, options: LoadOptions, connect, lines) -> int:
    """Rank r >= 1 (``options.rank``): load the shard, join the group (``connect()`` -> (store, secret)), replay
    every submission ``lines`` announces until STOP or its end (rank 0 gone)."""
    import warnings

    import torch.distributed as dist

    from ignition.runtime.core import load_core
    from ignition.runtime.paging import replay_operations

    warnings.simplefilter("ignore")  # rank 0 reports the same load warnings once
    rank = options.rank
    try:
        loaded = load_core(core, options)
        store, secret = connect()
        join_group(store, options, loaded.spec, secret)
        variants = list(loaded.variants.values())
        for line in lines(store):
            if line.strip() == STOP:
                break
            index, _, operations = line.strip().partition(" ")
            if operations:  # what rank 0 changed outside a graph since the last submission
                replay_operations(loaded, json.loads(operations))
            variant = variants[int(index)]
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


def torchrun_worker(core: str | Path, options: LoadOptions) -> int:
    """A rank >= 1 started by torchrun: the same load, group and secret check as a worker rank 0 started. Its
    device is LOCAL_RANK's GPU on CUDA (torchrun's placement), the CPU otherwise."""
    try:
        store, rank, secret = torchrun_store(options.ranks, options.timeout_s)
    except (RuntimeError, ValueError) as exc:  # MembershipError (no secret), the rank count, the rendezvous
        print(f"error: tensor-parallel rank {os.environ.get('RANK')}: {exc}", file=sys.stderr, flush=True)
        return 2
    device = None
    if options.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    return _replay(core, options.for_rank(rank, device), lambda: (store, secret),
                   lambda store: store_lines(store, secret, rank))


def worker(argv: list[str] | None = None) -> int:
    """A rank rank 0 started: its stdin carries the launch secret, the store's port, rank 0's LoadOptions (one
    JSON line), then one line per submission."""
    parser = argparse.ArgumentParser(prog="python -m ignition.runtime.parallel.rank_worker")
    parser.add_argument("core")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    secret = sys.stdin.readline().strip()
    port = sys.stdin.readline().strip()
    try:
        if not port.isdigit():
            raise LoadOptionError(f"expected the store's port on the second line of stdin, got {port[:20]!r}")
        options = LoadOptions.from_json(sys.stdin.readline()).for_rank(args.rank)
    except LoadOptionError as exc:  # rank 0 and this rank disagree on what can run here
        print(f"error: tensor-parallel rank {args.rank}: {exc}", file=sys.stderr, flush=True)
        return 2

    def connect():
        import torch.distributed as dist

        store = dist.TCPStore(options.tp_host, int(port), options.ranks, is_master=False,
                              timeout=datetime.timedelta(seconds=options.timeout_s))
        return store, secret

    return _replay(args.core, options, connect, lambda store: sys.stdin)


if __name__ == "__main__":
    sys.exit(worker())
