"""Tensor-parallel ranks meet on loopback and prove they belong before any request data (issue 24, finding 2).

The rendezvous checks run in small processes without a core (tests/_rank_peer.py, gloo on CPU): rank 0's
store and transports listen on 127.0.0.1 only; a worker holding the launch secret receives the data; a
process that knows only the store's port joins the group, answers the membership exchange with guesses,
is refused by name, and never receives the data; under torchrun the secret comes from IGNITION_TP_SECRET
and a rank with another secret is refused (one without a secret: test_secret_and_host_are_checked...). The pairs run concurrently: each is a few process
starts. Then the real launcher, on the shared TP=2 core: its processes listen on loopback only and carry
no secret in argv or environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ignition.runtime.rendezvous import SECRET_ENVIRONMENT, MembershipError, check_host, secret_from_environment

REPO = Path(__file__).parents[1]
PEER = str(REPO / "tests" / "_rank_peer.py")
REQUEST_DATA = 271828
SECRET = "ab" * 32
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           OMP_NUM_THREADS="1")


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or ENV)


def _events(process: subprocess.Popen, timeout: float = 90) -> tuple[int, list[dict], str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def _pair(second: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Rank 0 and a second process (``member`` with the secret on stdin, or ``rogue`` with the port only)."""
    rank0 = _start(PEER, "rank0")
    port = json.loads(rank0.stdout.readline())["port"]
    rank0.stdin.write(SECRET + "\n")
    rank0.stdin.flush()
    other = _start(PEER, second, str(port))
    if second == "member":
        other.stdin.write(SECRET + "\n")
        other.stdin.flush()
    return rank0, other


def _torchrun(env_changes: dict) -> subprocess.Popen:
    env = {k: v for k, v in ENV.items() if k != SECRET_ENVIRONMENT} | env_changes
    return _start("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PEER, "torchrun", env=env)


@pytest.fixture(scope="module")
def launches():
    """Every rendezvous case, started at once (a refusal never waits for the peers' group timeout)."""
    started = {"member": _pair("member"), "rogue": _pair("rogue"),
               "torchrun": _torchrun({SECRET_ENVIRONMENT: SECRET}),
               "torchrun-bad": _torchrun({SECRET_ENVIRONMENT: SECRET, "BAD_SECRET": "cd" * 32})}
    return {name: [_events(p) for p in (ps if isinstance(ps, tuple) else (ps,))] for name, ps in started.items()}


def test_a_rank_with_the_secret_gets_the_data_over_loopback_only(launches):
    (code0, events0, err0), (code1, events1, err1) = launches["member"]
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    listening = next(e["listening"] for e in events0 if "listening" in e)
    assert len(listening) >= 2, listening  # the store and gloo's listener
    assert all(address.startswith("127.0.0.1:") for address in listening), listening
    assert {"received": [REQUEST_DATA]} in events1


def test_a_joiner_with_only_the_port_is_refused_and_reads_nothing(launches):
    (code0, events0, err0), (_, events1, err1) = launches["rogue"]
    assert code0 == 3, err0[-2000:]
    refusal = next(e["refused"] for e in events0 if "refused" in e)
    assert "rank 1 did not prove it holds this launch's secret" in refusal
    assert all(address.startswith("127.0.0.1:") for address in events0[-1]["listening"])
    assert {"sent": True} not in events0
    assert all(e.get("received") in (None,) for e in events1 if "received" in e), events1
    assert any("received" in e or e.get("joined") is False for e in events1), err1[-2000:]


def test_torchrun_ranks_check_the_same_secret(launches):
    ((code, events, err),) = launches["torchrun"]
    assert code == 0, err[-3000:]
    assert sorted(e["rank"] for e in events if e.get("member")) == [0, 1]
    ((code, events, err),) = launches["torchrun-bad"]
    assert code != 0
    refusals = {e["rank"]: e["refused"] for e in events if "refused" in e}
    assert "rank 1 did not prove" in refusals[0], (events, err[-3000:])


def test_secret_and_host_are_checked_before_anything_starts(capsys):
    with pytest.raises(MembershipError, match=f"{SECRET_ENVIRONMENT}.*it has 5 characters"):
        secret_from_environment({SECRET_ENVIRONMENT: "short"})
    assert secret_from_environment({SECRET_ENVIRONMENT: SECRET}) == SECRET
    with pytest.raises(ValueError, match="expected an IPv4 address"):
        check_host("example.org")
    assert check_host("127.0.0.1") == "127.0.0.1" and capsys.readouterr().err == ""
    check_host("10.1.2.3")
    assert "warning: --tp-host 10.1.2.3" in capsys.readouterr().err
