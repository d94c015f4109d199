"""``python -m benchmarks.gpu.serve_probe CORE PORT RESULT [DEVICE]``: `ignition serve CORE --device DEVICE` (default
cuda) in this process, probed from a thread.

Triton is made unimportable first (``sys.modules["triton"] = None``): torch imports it whenever it is installed
(``torch._dynamo.utils`` asks ``has_triton_package()``), so only a blocked import proves serving needs none of
it. The main thread then runs the real CLI (``ignition.cli.main``) as ``ignition serve`` would. A watcher thread
waits for ``/health``, asks ``/v1/completions`` for 8 tokens with 5 logprobs, and writes RESULT: the answer and
every ``triton`` module in ``sys.modules`` of the serving process, which must be none. It then ends the
process (the server has no other way to stop from inside).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

READY_SECONDS = 60


def _get(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read() or b"{}")


def watch(port: int, result: Path) -> None:
    found: dict = {}
    try:
        deadline = time.monotonic() + READY_SECONDS
        while True:
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"/health did not answer 200 within {READY_SECONDS} s")
            time.sleep(0.2)
        model = _get(port, "/v1/models")[1]["data"][0]["id"]
        status, answer = _get(port, "/v1/completions", {"model": model, "prompt": "Hello world", "max_tokens": 8,
                                                         "logprobs": 5, "temperature": 0.0})
        found = {"status": status, "choices": answer.get("choices")}
    except Exception as exc:  # reported, not raised: the file says what went wrong
        found = {"error": f"{type(exc).__name__}: {exc}"}
    found["triton_modules"] = sorted(name for name, module in list(sys.modules.items())
                                     if module is not None and (name == "triton" or name.startswith("triton.")))
    result.write_text(json.dumps(found, indent=1))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    if len(sys.argv) not in (4, 5) or not sys.argv[2].isdigit():
        sys.exit("usage: python -m benchmarks.gpu.serve_probe CORE PORT RESULT [DEVICE]")
    core, port, result = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) == 5 else "cuda"
    sys.modules["triton"] = None  # serving must not need Triton: any import of it fails from here on
    threading.Thread(target=watch, args=(port, result), daemon=True).start()
    from ignition.cli import main as cli

    sys.argv = ["ignition", "serve", core, "--port", str(port), "--device", device]
    cli()


if __name__ == "__main__":
    main()
