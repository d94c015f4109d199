"""How tensor-parallel ranks find each other and prove they belong to one launch.

Two launches share one check. ``ignition run|serve --tensor-parallel N`` starts ranks 1..N-1
itself: rank 0 opens the TCP store on a socket it binds to ``127.0.0.1`` (``--tp-host ADDR`` opts
in to another interface, with a warning), the gloo / NCCL transports are pinned to the interface
that holds that address, and each worker receives the launch's random secret as the first line of
its stdin pipe (never its argv or environment). Under ``torchrun`` (env:// rendezvous, one rank per
process) torchrun owns the store and every rank reads the secret from ``IGNITION_TP_SECRET``.

Joining the store proves nothing (anyone who can reach its port can join it), so before any
request data travels, every rank proves it holds the secret (``prove_membership``): the ranks
exchange fresh nonces, then an HMAC-SHA256 of the whole exchange under the secret, keyed by rank,
over the new process group itself. A rank whose tag does not verify is named and the launch is
refused; a joiner that does not answer leaves the group to its timeout. The secret authenticates
the ranks; it does not encrypt their traffic.

Under torchrun rank 0 wakes the other ranks through torchrun's store, which listens on every
interface whatever ``--master-addr`` says. Each wake message is sealed (``seal``): its line and an
HMAC-SHA256 over a counter and the line under the launch secret, stored under a key named by the
counter and a tag of it (``wake_key``). A rank refuses and logs a message that does not verify
(forged, or replayed under another counter) and waits for rank 0's own (``store_lines``).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import sys
import time

import torch

SECRET_ENVIRONMENT = "IGNITION_TP_SECRET"
"""The launch secret under torchrun: the same value, at least ``MIN_SECRET_CHARS`` characters, on every rank."""
MIN_SECRET_CHARS = 32
LOOPBACK = "127.0.0.1"
INTERFACE_ENVIRONMENT = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Set to the interface of the chosen address, so the transports listen where the store does."""
TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NONCE_BYTES = 32
_SIOCGIFADDR = 0x8915


class MembershipError(RuntimeError):
    """A rank could not prove it holds this launch's secret (or the secret itself is unusable)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_from_environment(environ=os.environ) -> str:
    """The torchrun launch's secret; refused when unset or too short to be a secret."""
    secret = environ.get(SECRET_ENVIRONMENT, "")
    if len(secret) < MIN_SECRET_CHARS:
        found = "it is not set" if not secret else f"it has {len(secret)} characters"
        raise MembershipError(f"ranks started by torchrun prove they belong with a shared secret in "
                              f"{SECRET_ENVIRONMENT} (at least {MIN_SECRET_CHARS} characters, the same on every rank, "
                              f"e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`); {found}")
    return secret


def launched_by_torchrun(environ=os.environ) -> bool:
    return all(environ.get(name) for name in TORCHRUN_ENVIRONMENT)


def torchrun_follower(environ=os.environ) -> bool:
    """A rank >= 1 under torchrun: it replays rank 0's submissions and serves nothing itself."""
    return launched_by_torchrun(environ) and environ["RANK"] != "0"


def torchrun_store(ranks: int, timeout_s: float):
    """torchrun's env:// rendezvous: (store, this rank, the launch secret from IGNITION_TP_SECRET)."""
    import torch.distributed as dist

    secret = secret_from_environment()
    world = int(os.environ["WORLD_SIZE"])
    if world != ranks:
        raise ValueError(f"torchrun started {world} ranks (WORLD_SIZE), but --tensor-parallel is {ranks}; "
                         "start one process per rank")
    store, rank, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return store, rank, secret


def check_host(host: str) -> str:
    """``--tp-host``: an IPv4 address of this machine; anything but loopback is warned about."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"--tp-host {host!r}: expected an IPv4 address of this machine, such as {LOOPBACK}") from None
    if not address.is_loopback:
        print(f"warning: --tp-host {host}: the tensor-parallel store and rank traffic listen on {host}, where other "
              "machines may reach them; ranks prove they belong with a per-launch secret, but their traffic is "
              "not encrypted", file=sys.stderr, flush=True)
    return host


def interface_of(host: str) -> str:
    """The name of the network interface holding IPv4 address ``host`` (``lo`` for 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == host:
                return name
    raise ValueError(f"--tp-host {host}: no network interface of this machine has that address")


def pin_interfaces(host: str) -> dict[str, str]:
    """Pin gloo and NCCL to ``host``'s interface in this process; returns the variables for the workers."""
    pinned = dict.fromkeys(INTERFACE_ENVIRONMENT, interface_of(host))
    os.environ.update(pinned)
    return pinned


def listening_store(host: str, ranks: int, timeout_s: float):
    """Rank 0's TCP store, listening on ``host`` only (torch's own store would listen on every interface)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, ranks, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s),
                         master_listen_fd=listener.detach())  # the store owns the socket from here on


def _gathered(tensor: torch.Tensor, ranks: int) -> list[bytes]:
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(ranks)]
    dist.all_gather(parts, tensor)
    return [bytes(part.cpu().tolist()) for part in parts]


def _tag(secret: str, rank: int, transcript: bytes) -> bytes:
    return hmac.new(secret.encode(), b"ignition-tp-member|%d|" % rank + transcript, hashlib.sha256).digest()


def prove_membership(secret: str, rank: int, ranks: int, device: torch.device) -> None:
    """Every rank shows every other an HMAC of this exchange's nonces under the launch secret (exchanged as
    tensors on ``device``, the rank's own, which its process group's backend serves).

    Runs right after the default group forms, before any request data: a rank whose tag does not verify
    raises MembershipError naming it (on every honest rank); one that stays silent times the group out.
    """
    import torch.distributed as dist

    nonce = torch.tensor(list(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8, device=device)
    transcript = b"".join(_gathered(nonce, ranks)) + dist.group.WORLD.group_name.encode()
    tag = torch.tensor(list(_tag(secret, rank, transcript)), dtype=torch.uint8, device=device)
    tags = _gathered(tag, ranks)
    strangers = [r for r, found in enumerate(tags) if not hmac.compare_digest(found, _tag(secret, r, transcript))]
    if strangers:
        raise MembershipError(f"rank{'s' if len(strangers) > 1 else ''} {', '.join(map(str, strangers))} did not "
                              "prove it holds this launch's secret: a process that is not one of this launch's ranks "
                              "joined the group; refusing it before any request data is sent")


STOP = "stop"
WAKE_KEY = "ignition/wake/{}/{}"
"""A wake message's store key: its counter, then a tag of the counter under the launch secret (``wake_key``)."""
WAKE_POLL_S = 5.0
WAKE_RETRY_S = 0.05  # after a refused message, how often the key is read again for rank 0's own
log = logging.getLogger("ignition.runtime.parallel.rendezvous")


class PipeChannel:
    """Rank 0 -> workers it started: one line per submission on each worker's stdin (EOF: rank 0 is gone)."""

    def __init__(self, workers):
        self.workers = workers

    def send(self, line: str) -> None:
        for process in self.workers:
            process.stdin.write(line + "\n")
            process.stdin.flush()


def _wake_tag(secret: str, counter: int, line: str) -> str:
    return hmac.new(secret.encode(), b"ignition-tp-wake|%d|" % counter + line.encode(), hashlib.sha256).hexdigest()


def wake_key(secret: str, counter: int) -> str:
    """The store key of message ``counter``: torchrun's store listens on every interface, so its name is a tag
    under the secret too (a process that reaches the store cannot address the next message)."""
    return WAKE_KEY.format(counter, _wake_tag(secret, counter, "")[:32])


def seal(secret: str, counter: int, line: str) -> bytes:
    """Message ``counter`` as stored: ``line``, then its HMAC-SHA256 under the launch secret over the counter and
    the line (a message replayed under another counter, or changed, does not verify)."""
    return f"{line}|{_wake_tag(secret, counter, line)}".encode()


def opened(secret: str, counter: int, value: bytes) -> str | None:
    """The line of a sealed message ``counter``, or None when its tag does not verify."""
    line, _, tag = value.decode("utf-8", "replace").rpartition("|")
    expected = _wake_tag(secret, counter, line).encode()
    return line if hmac.compare_digest(tag.encode("utf-8", "replace"), expected) else None  # bytes: any text


class StoreChannel:
    """Rank 0 -> torchrun's other ranks: one sealed message per submission under its own key, in order (no pipe
    joins them)."""

    def __init__(self, store, secret: str):
        self.store, self.secret, self.sent = store, secret, 0

    def send(self, line: str) -> None:
        self.sent += 1
        self.store.set(wake_key(self.secret, self.sent), seal(self.secret, self.sent, line))
        if self.sent > 2:  # every rank has run submission sent-1, so it has read this older key
            self.store.delete_key(wake_key(self.secret, self.sent - 2))


def store_lines(store, secret: str, rank: int | str = "?"):
    """A worker's view of StoreChannel: the lines in order; an idle rank 0 only means waiting longer. A message
    whose tag does not verify (forged, or replayed from another counter) is refused and logged, and the key is
    read again until rank 0's own message is there: the rank keeps serving."""
    import torch.distributed as dist

    received = 0
    while True:
        received += 1
        key = wake_key(secret, received)
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=WAKE_POLL_S))
                break
            except dist.DistStoreError:  # a timeout; a lost store raises DistNetworkError, which ends the rank
                continue
        refused = None
        while (line := opened(secret, received, value := store.get(key))) is None:
            if value != refused:
                log.warning("tensor-parallel rank %s: refused wake message %d: its HMAC under the launch secret does "
                            "not verify (forged or replayed by a process that reached the store); waiting for rank "
                            "0's own", rank, received)
                refused = value
            time.sleep(WAKE_RETRY_S)
        yield line
