"""``ignition serve CORE --tensor-parallel 2`` over HTTP against the same checkpoint at TP=1, then a rank killed.

The TP=2 server is the real command line in a subprocess (rank 0 starts rank 1 itself, gloo on CPU);
the TP=1 server is the same app in this process on the recipe's graph modules run eagerly
(tests/_tp_cores.py: what the exported graphs run, without a second export). Both answer the same
Completions (text and token-id prompts, ``logprobs`` 5, ``prompt_logprobs`` 5) and Chat
(``top_logprobs`` 5) requests: tokens, logprob ids and their order must be identical, values within
test_tensor_parallel.py's bound (``_tp_cores.close``: 8 FP32 ulp of the value). Ids travel as
``token_id:N`` (``return_tokens_as_token_ids``), so two ids without text cannot look alike.

Then rank 1 is killed while the server idles: the server must notice within its one-second health
check, fail a request sent meanwhile (never answer it, never hang it), and exit 1 with an error naming
the rank, all within a bounded time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from _served import serve_in_thread
from _tp_cores import close, eager_core, shared_tp_cores
from ignition.serve.app import create_app
from ignition.serve.config import ServeConfig

MODEL = "tiny"
START_TIMEOUT_S = 180  # load of both ranks on a busy 2-core machine; the test itself takes far less
EXIT_TIMEOUT_S = 20  # a dead rank to a stopped server: a 1 s health check, then uvicorn's shutdown
REPO = Path(__file__).parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CliServer:
    """``ignition serve`` in a subprocess; its stderr goes to a file (read when it exits or fails)."""

    def __init__(self, core: Path, log: Path):
        self.port, self.log_path = _free_port(), log
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1")
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ignition.cli", "serve", str(core), "--tensor-parallel", "2",
             "--port", str(self.port), "--served-model-name", MODEL, "--disable-log-requests"],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env, cwd=REPO)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready: serving" not in self.stderr():
            assert self.process.poll() is None, f"the server exited while starting:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{self.stderr()}"
            time.sleep(0.2)

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def worker(self, rank: int) -> int:
        """The pid of the worker process of ``rank`` (a child of the server)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.process.pid and b"ignition.runtime.parallel.rank_worker" in argv and b"--rank" in argv \
                    and argv[argv.index(b"--rank") + 1] == str(rank).encode():
                return int(entry.name)
        raise AssertionError(f"no rank {rank} worker under the server (pid {self.process.pid})")

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


class InProcessServer:
    """The TP=1 reference: the same app on the eager core, uvicorn in a thread."""

    def __init__(self, shared):
        app = create_app(eager_core(shared.options(1)), model_name=MODEL, config=ServeConfig(tokenizer=shared.tokenizer))
        self.server, self.thread, url = serve_in_thread(app)
        self.http = httpx.Client(base_url=url, timeout=60)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    shared = shared_tp_cores(tmp_path_factory)
    tp2 = CliServer(shared.tp2, tmp_path_factory.mktemp("serve-tp2") / "stderr.log")
    tp1 = InProcessServer(shared)
    yield tp1, tp2
    tp1.close()
    tp2.close()


COMPLETION = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 5,
              "prompt_logprobs": 5, "return_tokens_as_token_ids": True}
REQUESTS = [
    ("/v1/completions", dict(COMPLETION, prompt="the cat sat on")),
    ("/v1/completions", dict(COMPLETION, prompt=[5, 17, 33, 2, 140, 9, 75, 76, 150, 3])),  # two prefill chunks
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a dog ran"}],
                              "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True,
                              "top_logprobs": 5, "return_tokens_as_token_ids": True}),
]


def assert_same(sharded, reference, where: str = "") -> int:
    """Equal JSON, except floats under the key ``logprob`` or in a logprob map, which are ``close``;
    returns how many values were compared that way (so a test sees that it compared something)."""
    if isinstance(reference, dict):
        assert list(sharded) == list(reference), f"{where}: keys {list(sharded)} != {list(reference)}"
        return sum(assert_same(sharded[k], reference[k], f"{where}.{k}") for k in reference)
    if isinstance(reference, list):
        assert len(sharded) == len(reference), f"{where}: {len(sharded)} items != {len(reference)}"
        return sum(assert_same(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(sharded, reference)))
    if isinstance(reference, float):
        assert isinstance(sharded, float) and close(sharded, reference), f"{where}: {sharded} vs {reference}"
        return 1
    assert sharded == reference, f"{where}: {sharded!r} != {reference!r}"
    return 0


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_tp2_server_answers_like_tp1(servers):
    tp1, tp2 = servers
    compared = 0
    for path, body in REQUESTS:
        sharded, reference = tp2.http.post(path, json=body), tp1.http.post(path, json=body)
        assert sharded.status_code == reference.status_code == 200, (sharded.text, reference.text)
        sharded, reference = sharded.json(), reference.json()
        (choice,) = reference["choices"]
        logprobs = choice["logprobs"]
        if path == "/v1/completions":
            assert len(logprobs["tokens"]) == 4 and all(len(top) == 5 for top in logprobs["top_logprobs"])
            assert all(t.startswith("token_id:") for t in logprobs["tokens"])
            assert sum(p is not None and len(p) >= 5 for p in choice["prompt_logprobs"]) == \
                len(choice["prompt_logprobs"]) - 1  # every prompt token after the first
        else:
            assert len(logprobs["content"]) == 4 and all(len(e["top_logprobs"]) == 5 for e in logprobs["content"])
        compared += assert_same(_without_ids(sharded), _without_ids(reference), path)
    assert compared > 100  # token, top and prompt logprobs of all three requests


def test_killing_rank_1_stops_the_server_with_an_error_naming_it(servers):
    _, tp2 = servers
    assert tp2.http.get("/health").status_code == 200
    os.kill(tp2.worker(1), signal.SIGKILL)
    killed = time.monotonic()
    try:  # a request meanwhile fails (an error status, or a refused connection once the server is gone)
        response = tp2.http.post("/v1/completions", json=dict(COMPLETION, prompt="the cat"), timeout=EXIT_TIMEOUT_S)
        assert response.status_code >= 500, response.text
        assert "rank 1" in response.text, response.text
    except httpx.TransportError:
        pass
    try:
        code = tp2.process.wait(timeout=EXIT_TIMEOUT_S - (time.monotonic() - killed))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {EXIT_TIMEOUT_S} s after rank 1 died:\n{tp2.stderr()}")
    stderr = tp2.stderr()
    assert code == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: tensor-parallel group failed: rank 1 exited with code -9"), stderr
    assert "Traceback" not in stderr, stderr
