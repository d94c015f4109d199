"""One process of tests/test_rank_auth.py's rendezvous checks, without a core (gloo on CPU).

``python tests/_rank_peer.py ROLE [PORT]``, one JSON line on stdout per event:
  rank0   opens the store on 127.0.0.1 (prints its port), forms a group of 2, checks membership with the
          secret read from stdin, prints its listening sockets' addresses, then broadcasts REQUEST_DATA
          (the stand-in for a prompt) only when the check passed (an honest rank 1 is the real launcher's,
          tests/test_rank_auth.py).
  rogue   joins PORT as rank 1 knowing the port only: it answers the exchange with random bytes, then
          waits for the broadcast; it prints what it received.
  torchrun  one rank under torchrun (env://): the secret from IGNITION_TP_SECRET; rank 1 uses
          BAD_SECRET instead when the environment sets it.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import sys

import torch
import torch.distributed as dist

from ignition.runtime.parallel.rendezvous import (LOOPBACK, MembershipError, listening_store, pin_interfaces,
                                                  prove_membership, torchrun_store)

REQUEST_DATA = 271828
TIMEOUT_S = 60.0  # generous: these processes start on a busy machine; a refusal never waits for it


def say(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")  # one write: ranks sharing a stdout never split a line
    sys.stdout.flush()


def listening_addresses(pid: int | str = "self") -> list[str]:
    """host:port of every listening TCP socket process ``pid`` holds (/proc/net/tcp{,6} and /proc/PID/fd)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    address, port = local.split(":")
                    raw = bytes.fromhex(address)
                    host = ".".join(str(b) for b in raw[::-1]) if width == 8 else _ipv6(raw)
                    found.append(f"{host}:{int(port, 16)}")
    return found


def _ipv6(raw: bytes) -> str:
    import ipaddress

    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped) if address.ipv4_mapped else str(address)


def join(store, rank: int) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def rank0() -> int:
    pin_interfaces(LOOPBACK)
    store = listening_store(LOOPBACK, 2, TIMEOUT_S)
    say(port=store.port)
    secret = sys.stdin.readline().strip()
    join(store, 0)
    data = torch.tensor([REQUEST_DATA])
    try:
        prove_membership(secret, 0, 2, torch.device("cpu"))
    except MembershipError as exc:
        say(refused=str(exc), listening=listening_addresses())
        return 3
    say(listening=listening_addresses())
    dist.broadcast(data, src=0)
    say(sent=True)
    return 0


def rogue(port: int) -> int:
    try:
        join(dist.TCPStore(LOOPBACK, port, 2, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)), 1)
    except RuntimeError as exc:  # the group was already whole, or refused the connection
        say(joined=False, error=type(exc).__name__)
        return 0
    say(joined=True)
    for _ in range(2):  # the nonce, then a guessed tag: 32 bytes each
        guess = torch.tensor(list(secrets.token_bytes(32)), dtype=torch.uint8)
        dist.all_gather([torch.empty_like(guess) for _ in range(2)], guess)
    data = torch.zeros(1, dtype=torch.int64)
    try:
        dist.broadcast(data, src=0)
        say(received=data.tolist())
    except RuntimeError as exc:
        say(received=None, error=type(exc).__name__)
    return 0


def torchrun() -> int:
    if os.environ.get("BAD_SECRET") and os.environ["RANK"] == "1":
        os.environ["IGNITION_TP_SECRET"] = os.environ["BAD_SECRET"]
    try:
        store, rank, secret = torchrun_store(2, TIMEOUT_S)
    except MembershipError as exc:
        say(rank=os.environ["RANK"], refused=str(exc))
        return 2
    join(store, rank)
    try:
        prove_membership(secret, rank, 2, torch.device("cpu"))
    except MembershipError as exc:
        say(rank=rank, refused=str(exc))
        return 3
    say(rank=rank, member=True)
    return 0


if __name__ == "__main__":
    role = sys.argv[1]
    try:
        code = {"rank0": rank0, "rogue": lambda: rogue(int(sys.argv[2])),
                "torchrun": torchrun}[role]()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)
