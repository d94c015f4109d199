"""Bounded admission (issue 24, item 10): a batch's admission stops when its client leaves, and SIGTERM stops
``ignition serve`` within 10 s even while a stream is open. The batch cap itself: test_serve_parity.py."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

CMPL = "/v1/completions"


def test_admission_stops_when_the_client_leaves(served, monkeypatch):
    real, submitted = served.ctx.engine.submit, []

    async def slow_submit(request):  # 50 ms per prompt: 200 prompts would take 10 s to admit
        submitted.append(request.request_id)
        await asyncio.sleep(0.05)
        return await real(request)

    monkeypatch.setattr(served.ctx.engine, "submit", slow_submit)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(served.url + CMPL, json={"prompt": [[1]] * 200, "max_tokens": 1}, timeout=0.5)
    time.sleep(0.3)
    count = len(submitted)
    time.sleep(0.5)
    assert len(submitted) == count < 40, f"admission went on after the client left: {len(submitted)} of 200"
    served.wait_idle()  # what was admitted was cancelled or finished; nothing is left tracked
    monkeypatch.undo()
    assert served.post(CMPL, {"prompt": [1], "max_tokens": 1}).status_code == 200


def test_sigterm_stops_the_server_within_ten_seconds(serving_cores, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", "from ignition.cli import main; main()", "serve",
                                    str(serving_cores[1]), "--port", str(port)], stdout=subprocess.DEVNULL,
                                   stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, log.read_text()
                time.sleep(0.2)
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", url + CMPL, json={"prompt": [1], "max_tokens": 100_000, "ignore_eos": True,
                                          "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # generating; this reader now stops reading
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=15)
            elapsed = time.monotonic() - started
        assert elapsed < 10, f"SIGTERM took {elapsed:.1f} s to stop the server"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
