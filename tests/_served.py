"""A live server for the HTTP tests: uvicorn on a free port in a thread, plus a reference engine on the same core."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time

import httpx
import openai
import uvicorn
from safetensors.torch import load_file

from ignition.recipes.toy import batch_invariant_logits
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from ignition.serve.app import create_app
from ignition.serve.config import ServeConfig

VOCAB = 250  # tokens the serving tests' tokenizers define, and the toy's greedy chains stay below


def serve_in_thread(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Start uvicorn on a free 127.0.0.1 port in a daemon thread; return once it accepts, with its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start within 30 s"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


class Served:
    """A uvicorn server on a free 127.0.0.1 port, in a thread, plus a reference engine on the same core."""

    def __init__(self, core_dir, tokenizer=None, config: ServeConfig | None = None):
        self.app = create_app(core_dir, model_name="toy",
                              config=config or ServeConfig(allow_request_chat_template=True))
        self.core_dir = core_dir
        self.ctx = self.app.state.ctx
        self.table, self.tokenizer = self.ctx.table, tokenizer
        self.server, self.thread, self.url = serve_in_thread(self.app)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.url, timeout=60)  # one client: each new one builds an SSL context
        weights = load_file(str(core_dir / "weights.safetensors"))
        logits = batch_invariant_logits(weights["embedding.weight"], weights["lm_head.weight"])[:, :VOCAB]
        self.successor = logits.argmax(dim=1).tolist()  # the toy is a greedy bigram: next token of each token

    @functools.cached_property
    def reference(self) -> Engine:
        """The loader on the same core, loaded when a test first compares with it."""
        return Engine(load_core(self.core_dir))

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        # json.dumps escapes non-ASCII, so lone surrogates travel as JSON escapes (httpx would fail to encode them)
        return self.http.post(path, content=json.dumps(body),
                              headers={"content-type": "application/json", **kwargs.pop("headers", {})}, **kwargs)

    def sse(self, path: str, body: dict) -> list[dict]:
        with self.http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def generate(self, prompt_ids, **kwargs):
        (result,) = self.reference.generate([Request(list(prompt_ids), **kwargs)])
        return result

    def chain(self, token: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            token = self.successor[token]
            out.append(token)
        return out

    def pieces(self, ids) -> list[bytes]:
        return [b"" if i in self.table.special else self.table.bytes[i] for i in ids]

    def text(self, ids) -> str:
        return b"".join(self.pieces(ids)).decode("utf-8", "replace")

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            load = self.ctx.engine.load()
            if load["tracked"] == load["running"] == load["waiting"] == 0 and load["free_slots"] == load["num_slots"]:
                return load
            assert time.monotonic() < deadline, f"engine not idle: {load}"
            time.sleep(0.01)

    def close(self):
        self.client.close()
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


