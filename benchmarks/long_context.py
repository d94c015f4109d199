"""A long context served from a KV budget: issue 52's third target.

``python -m benchmarks.long_context --threads 2`` builds a random checkpoint in the Qwen3-0.6B shape (28 layers,
hidden 1024, 16 query and 8 KV heads, head_dim 128; ``--layers`` and ``--vocab`` change it), exports it in FP32 with
``max_seq_len`` 32,768 and 8 slots, starts ``ignition serve`` on it with ``--kv-cache-memory`` (8 GiB by default:
about 37,400 tokens at 229,376 bytes a token, more than the one sequence of ``max_seq_len`` the load requires, where
the slot layout needs 56 GiB), and sends one completion whose prompt is 16,384 token ids, with ``max_tokens`` 4 and
``logprobs`` 1.

It prints what the slot-contiguous layout would need for the same core (``slots x max_seq_len`` positions of every
layer), the pool the budget gives (the server's start-up line: capacity in tokens), the request's seconds, the
tokens it returned, and the server's peak resident memory. The target: the core loads with its KV memory set by the
budget and serves the prompt. ``--prompt`` and ``--max-seq-len`` shorten it (the test runs a tiny form).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks._common import export
from benchmarks.realsize_families import FAMILIES, make_checkpoint
from benchmarks.serve import start_server

SLOTS, BLOCK_SIZE = 8, 16
READY = re.compile(r"KV capacity [\d,]+ tokens \([\d,]+ blocks of \d+\)")  # the load line's pool


def serve(core: Path, budget: int, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``ignition serve`` on ``core`` with ``--kv-cache-memory budget`` and ``threads`` torch threads, once its health
    check answers."""
    return start_server(core, "long-context", ("--kv-cache-memory", str(budget)), log,
                        dict(os.environ, OMP_NUM_THREADS=str(threads)), timeout=600)


def peak_rss(pid: int) -> int:
    """The process's peak resident bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def slot_layout_bytes(manifest: dict) -> int:
    """KV bytes of the slot-contiguous layout: every full layer's K and V for ``num_slots x max_seq_len``."""
    model = manifest["model"]
    itemsize = torch.empty((), dtype=getattr(torch, model["dtype"])).element_size()
    per_token = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * itemsize
    return per_token * model["num_slots"] * model["max_seq_len"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", type=int, default=FAMILIES["qwen3"].shape["vocab_size"])
    parser.add_argument("--hidden", type=int, help="hidden size (default: the family's; the test shrinks it)")
    parser.add_argument("--max-seq-len", type=int, default=32768)
    parser.add_argument("--prompt", type=int, default=16384, help="prompt tokens")
    parser.add_argument("--kv-cache-memory", type=int, default=8 * 2**30,
                        help="bytes (the pool must hold one sequence of max_seq_len, as vLLM requires)")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and core here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import json

    with tempfile.TemporaryDirectory() as scratch:
        root = args.workdir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        overrides = {"vocab_size": args.vocab, "max_position_embeddings": args.max_seq_len}
        if args.hidden:
            overrides.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
        core = root / "core"
        if not (core / "manifest.json").exists():
            checkpoint = make_checkpoint(FAMILIES["qwen3"], root / "ckpt", args.layers, "float32", overrides)
            started = time.perf_counter()
            export(checkpoint, core, capacities=(1, SLOTS), num_slots=SLOTS, max_seq_len=args.max_seq_len,
                   block_size=BLOCK_SIZE)
            print(f"exported in {time.perf_counter() - started:.1f} s", flush=True)
        manifest = json.loads((core / "manifest.json").read_text())
        log = root / "serve.log"
        started = time.perf_counter()
        process, url = serve(core, args.kv_cache_memory, args.threads, log)
        ready = time.perf_counter() - started
        try:
            prompt = torch.randint(1, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(3)).tolist()
            started = time.perf_counter()
            response = httpx.post(url + "/v1/completions", timeout=3600,
                                  json={"prompt": prompt,
                                        "max_tokens": 4, "logprobs": 1, "ignore_eos": True})
            seconds = time.perf_counter() - started
            if response.status_code != 200:
                raise SystemExit(f"the completion failed: {response.status_code} {response.text}")
            body = response.json()
            rss = peak_rss(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=60)
        line = next((m.group(0) for m in map(READY.search, log.read_text().splitlines()) if m), "(no KV line)")
    usage = body["usage"]
    result = {"slot_layout": slot_layout_bytes(manifest), "budget": args.kv_cache_memory, "line": line,
              "ready": ready, "seconds": seconds, "prompt_tokens": usage["prompt_tokens"],
              "completion_tokens": usage["completion_tokens"], "logprobs": body["choices"][0]["logprobs"]["token_logprobs"],
              "rss": rss}
    print(f"\nQwen3-0.6B shape, {args.layers} layers, FP32, max_seq_len {args.max_seq_len}, {SLOTS} slots, "
          f"{args.threads} threads")
    print("| measure | value |")
    print("|---|---|")
    print(f"| slot-contiguous KV for {SLOTS} x {args.max_seq_len} positions | {result['slot_layout'] / 2**30:.2f} GiB |")
    print(f"| --kv-cache-memory | {args.kv_cache_memory / 2**30:.2f} GiB |")
    print(f"| server start-up line | {line} |")
    print(f"| server ready (load included) | {ready:.1f} s |")
    print(f"| {result['prompt_tokens']}-token prompt, {result['completion_tokens']} tokens returned | "
          f"{seconds:.1f} s ({result['prompt_tokens'] / seconds:.1f} prompt tok/s) |")
    print(f"| server peak RSS | {rss / 2**30:.2f} GiB |")
    print(f"| token logprobs | {', '.join(f'{v:.4f}' for v in result['logprobs'])} |")
    return result


if __name__ == "__main__":
    main()
