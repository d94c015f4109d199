"""Tensor-parallel ranks meet on loopback and prove they belong before any request data (issue 24, finding 2).

The rendezvous checks run in small processes without a core (tests/_rank_peer.py, gloo on CPU): rank 0's
store and transports listen on 127.0.0.1 only; a process that knows only the store's port joins the group,
answers the membership exchange with guesses, is refused by name and never receives the data; under
torchrun the secret comes from IGNITION_TP_SECRET and a rank with another secret is refused (a missing one:
test_secret_and_host_are_checked_before_anything_starts). The cases run concurrently. Then the real
launcher on the shared TP=2 core (an honest worker receives the data): its processes listen on loopback
only and carry no secret in argv or environment; and the shard binding (finding 7).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _rank_peer import listening_addresses
from _tp_cores import shared_tp_cores
from _tp_runner import as_json, requests
from conftest import CoreCopy
from ignition.runtime.core import CoreLoadError, load_core
from ignition.runtime.engine import Engine
from ignition.runtime.parallel.group import tensor_parallel
from ignition.runtime.parallel.rendezvous import SECRET_ENVIRONMENT, MembershipError, check_host, secret_from_environment
from ignition.validate.core import validate_core

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
    return process.returncode, _json_objects(out), err


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed at the start of a line, several on one line included: torchrun's two ranks share
    one stdout, and one rank's line can land before the other's newline (``{...}{...}``)."""
    decoder, events = json.JSONDecoder(), []
    for line in text.splitlines():
        index = 0
        while line.startswith("{", index):
            event, index = decoder.raw_decode(line, index)
            events.append(event)
    return events


def _rogue_pair() -> tuple[subprocess.Popen, subprocess.Popen]:
    """Rank 0 (the secret on its stdin) and a rogue that knows only the store's port."""
    rank0 = _start(PEER, "rank0")
    port = json.loads(rank0.stdout.readline())["port"]
    rank0.stdin.write(SECRET + "\n")
    rank0.stdin.flush()
    return rank0, _start(PEER, "rogue", str(port))


def _torchrun(env_changes: dict) -> subprocess.Popen:
    env = {k: v for k, v in ENV.items() if k != SECRET_ENVIRONMENT} | env_changes
    return _start("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PEER, "torchrun", env=env)


@pytest.fixture(scope="module")
def launches():
    """Every rendezvous case, started at once (a refusal never waits for the peers' group timeout)."""
    started = {"rogue": _rogue_pair(),
               "torchrun": _torchrun({SECRET_ENVIRONMENT: SECRET}),
               "torchrun-bad": _torchrun({SECRET_ENVIRONMENT: SECRET, "BAD_SECRET": "cd" * 32})}
    return {name: [_events(p) for p in (ps if isinstance(ps, tuple) else (ps,))] for name, ps in started.items()}


def test_a_joiner_with_only_the_port_is_refused_and_reads_nothing(launches):
    (code0, events0, err0), (_, events1, err1) = launches["rogue"]
    assert code0 == 3, err0[-2000:]
    refusal = next(e["refused"] for e in events0 if "refused" in e)
    assert "rank 1 did not prove it holds this launch's secret" in refusal
    listening = events0[-1]["listening"]
    assert len(listening) >= 2 and all(address.startswith("127.0.0.1:") for address in listening), listening
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


def test_wake_messages_through_the_store_are_sealed(caplog):
    """Issue 50, finding 5: under torchrun rank 0 wakes the ranks through torchrun's store, which listens on every
    interface. A message written by a process without the secret (a plain ``stop``, one sealed under another
    secret) or replayed from another counter is refused and logged; the rank reads rank 0's own and goes on."""
    import datetime
    import queue
    import threading

    import torch.distributed as dist

    from ignition.runtime.parallel.rendezvous import STOP, StoreChannel, seal, store_lines, wake_key

    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    stores = [dist.TCPStore("127.0.0.1", master.port, 3, is_master=False, timeout=datetime.timedelta(seconds=30))
              for _ in range(2)]
    rank0, attacker = StoreChannel(master, SECRET), stores[1]
    lines: queue.Queue = queue.Queue()
    def read():
        for line in store_lines(stores[0], SECRET, 1):
            lines.put(line)
            if line == STOP:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rank0.send("0")
    assert lines.get(timeout=10) == "0"
    with caplog.at_level("WARNING", logger="ignition.runtime.parallel.rendezvous"):
        attacker.set("ignition/wake/2", STOP)  # the old, unsealed key
        attacker.set(wake_key(SECRET, 2), b"0|\xff\xfe not a tag")  # not even text
        time.sleep(0.2)
        attacker.set(wake_key(SECRET, 2), seal("cd" * 32, 2, STOP))  # the key known, the secret not
        time.sleep(0.3)
        assert lines.empty() and "refused wake message 2" in caplog.text
        rank0.send("1")
        assert lines.get(timeout=10) == "1"
        caplog.clear()
        attacker.set(wake_key(SECRET, 3), attacker.get(wake_key(SECRET, 2)))  # message 2 replayed as message 3
        time.sleep(0.3)
        assert lines.empty() and "refused wake message 3" in caplog.text
        rank0.send("1")
        assert lines.get(timeout=10) == "1"
        rank0.send(STOP)
        assert lines.get(timeout=10) == STOP
    reader.join(timeout=10)
    assert not master.check([wake_key(SECRET, 1)])  # read by every rank: deleted


def test_secret_and_host_are_checked_before_anything_starts(capsys):
    with pytest.raises(MembershipError, match=f"{SECRET_ENVIRONMENT}.*it has 5 characters"):
        secret_from_environment({SECRET_ENVIRONMENT: "short"})
    assert secret_from_environment({SECRET_ENVIRONMENT: SECRET}) == SECRET
    with pytest.raises(ValueError, match="expected an IPv4 address"):
        check_host("example.org")
    assert check_host("127.0.0.1") == "127.0.0.1" and capsys.readouterr().err == ""
    check_host("10.1.2.3")
    assert "warning: --tp-host 10.1.2.3" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Path:
    return shared_tp_cores(tmp_path_factory).tp2


def test_the_launcher_listens_on_loopback_and_keeps_the_secret_out_of_argv(tp2):
    """While a TP=2 group runs: every listening socket of both ranks is on 127.0.0.1 (the store was on *:PORT),
    no 64-hex secret and no store port is in the worker's argv (a local racer read the port there and stopped
    the launch), no secret in its environment, and a process that joins the store with the port neither
    receives request data nor changes the answers."""
    with tensor_parallel(tp2, 2) as loaded:
        worker = loaded.group.workers[0]
        argv = Path(f"/proc/{worker.pid}/cmdline").read_bytes().split(b"\0")
        port = loaded.group.port
        assert b"--port" not in argv and str(port).encode() not in argv, argv  # issue 50: the port is on stdin
        ours = listening_addresses() + listening_addresses(worker.pid)
        assert f"127.0.0.1:{port}" in ours, ours
        assert all(address.startswith("127.0.0.1:") for address in ours), ours
        for exposed in (b" ".join(argv), Path(f"/proc/{worker.pid}/environ").read_bytes()):
            assert not re.search(rb"[0-9a-f]{64}", exposed)
        rogue = _start(PEER, "rogue", str(port))
        engine = Engine(loaded)
        first = [as_json(r) for r in engine.generate(requests())]
        second = [as_json(r) for r in engine.generate(requests())]  # with the rogue knocking meanwhile
        assert first == second and not any(r["error"] for r in first)
        rogue.kill()  # it may still be waiting for a group that will never take it
        _, events, _ = _events(rogue)
        assert not any(e.get("received") for e in events), events


def test_a_shard_copied_over_another_rank_is_refused(tp2, tmp_path):
    """Finding 7: rank 0's weights copied over rank 1's and rehashed validated and changed the tokens."""
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(tp2, copy.root)
    shutil.copyfile(copy.root / "weights.safetensors", copy.root / "ranks/1/weights.safetensors")
    copy.rehash("ranks/1/weights.safetensors")
    found = {(v.rule, v.where) for v in validate_core(copy.root, check_graphs=False).violations}
    assert ("TP-RANK-BIND", "manifest.json:tensor_parallel.rank_files[1].sha256") in found, found
    assert ("TP-RANK-BIND", "ranks/1/weights.safetensors:__metadata__") in found, found
    copy.edit("manifest.json", lambda m: m["tensor_parallel"]["rank_files"][1].update(
        sha256=m["files"]["ranks/1/weights.safetensors"]))  # the binding rewritten too: still a copy
    violations = validate_core(copy.root, check_graphs=False).violations
    assert any(v.rule == "TP-RANK-BIND" and "byte for byte rank 0's" in v.message for v in violations), violations
    with pytest.raises(CoreLoadError, match="TP-RANK-BIND"):
        load_core(copy.root, rank=1, tensor_parallel=2)
    copy.edit("manifest.json", lambda m: m["tensor_parallel"]["rank_files"][1].update(rank=0))
    assert any(v.rule == "TP-RANK-BIND" and v.where.endswith("rank_files[1].rank")
               for v in validate_core(copy.root, check_graphs=False).violations)
