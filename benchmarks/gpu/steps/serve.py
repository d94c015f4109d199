"""`ignition serve` on CUDA in its own process, with Triton unimportable: it answers, and never loaded Triton."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from benchmarks.gpu.record import ROOT, step_main


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(context, record) -> None:
    core = context.carried("qwen3")
    if not record.check("the carried qwen3 core is there", (core / "manifest.json").is_file(), str(core)):
        return
    result = context.work / "serve-probe.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.gpu.serve_probe", str(core), str(free_port()), str(result), "cuda"]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print((done.stdout + done.stderr)[-4000:], flush=True)
    if not record.check("the serving process wrote its probe", result.is_file(),
                        f"exit {done.returncode}; " + (done.stderr.strip().splitlines() or [""])[-1]):
        return
    found = json.loads(result.read_text())
    choices = found.get("choices") or []
    logprobs = (choices[0].get("logprobs") or {}) if choices else {}
    tops = logprobs.get("top_logprobs") or []
    # NOTE: top_logprobs maps token text to logprob, so two ids that decode alike share a key: 1 to 5 keys
    record.check("the server answers /v1/completions with 8 tokens and their logprobs",
                 found.get("status") == 200 and len(logprobs.get("tokens") or []) == 8 == len(tops)
                 and all(1 <= len(top) <= 5 for top in tops),
                 found.get("error") or json.dumps(choices)[:500])
    record.check("the serving process never imported Triton", not found["triton_modules"],
                 ", ".join(found["triton_modules"]))


if __name__ == "__main__":
    step_main(run)
