"""HTTP serving: requests/s and latency of short completions with logprobs=5 against the same without.

Exports the toy core with a small byte-level BPE tokenizer, starts ``ignition serve`` in a
subprocess (so the load generator does not share the server's interpreter), and drives it with
CONCURRENCY closed-loop clients: each sends its next request when the previous one returns.
Rounds alternate between the two modes so both see the same machine load; a warm-up round runs
first. Latency is per request, from send to the complete JSON response.

    python -m benchmarks.serve [--rounds 3] [--requests-per-client 2] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONCURRENCY = 32
CORPUS = ["the cat sat on the mat, héllo wörld, naïve café", "price: €100 — 中文 😀 ∑ ≈ →"] * 20


def build_core(root: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    export_core(ExportOptions(recipe="toy", capacities=(1, 4, 8), tokenizer=root / "tokenizer"), root / "core")
    return root / "core"


def start_server(core: Path, name: str = "toy", options: tuple[str, ...] = (), log: Path | None = None,
                 env: dict | None = None, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``ignition serve CORE [options]`` on a free port in its own process, serving ``name``: (the process, its URL)
    once /health answers. ``log``: its output goes there (else nowhere), and is shown if it does not start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output = log.open("w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen([sys.executable, "-c", "from ignition.cli import main; main()", "serve", str(core),
                                "--port", str(port), "--served-model-name", name, *options],
                               stdout=output, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                said = f"; its output:\n{log.read_text()}" if log is not None else ""
                raise SystemExit(f"ignition serve did not start{said}")
            time.sleep(0.2)


async def run_round(url: str, body: dict, per_client: int) -> tuple[float, list[float]]:
    """CONCURRENCY clients, each sending per_client requests back to back; (wall seconds, latencies)."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one_client(index: int) -> None:
            for _ in range(per_client):
                started = time.perf_counter()
                response = await client.post("/v1/completions", json=dict(body, prompt=[index % 200 + 10, 7]))
                response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one_client(i) for i in range(CONCURRENCY)))
        return time.perf_counter() - started, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    modes = {"no logprobs": {"model": "toy", "max_tokens": args.max_tokens},
             "logprobs=5": {"model": "toy", "max_tokens": args.max_tokens, "logprobs": 5}}
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(build_core(Path(tmp)))
        try:
            asyncio.run(run_round(url, modes["logprobs=5"], 1))  # warm-up
            walls = {name: 0.0 for name in modes}
            latencies: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(args.rounds):
                for name, body in modes.items():
                    wall, lat = asyncio.run(run_round(url, body, args.requests_per_client))
                    walls[name] += wall
                    latencies[name] += lat
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"{CONCURRENCY} concurrent clients, {args.rounds} rounds x {args.requests_per_client} requests each, "
          f"max_tokens={args.max_tokens}, toy core (capacities 1,4,8), same server process")
    print(f"{'mode':<14}{'requests':>10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name in modes:
        lat = latencies[name]
        print(f"{name:<14}{len(lat):>10}{len(lat) / walls[name]:>10.2f}{1e3 * percentile(lat, 0.5):>10.1f}"
              f"{1e3 * percentile(lat, 0.99):>10.1f}{1e3 * statistics.fmean(lat):>10.1f}")
    rates = {name: len(latencies[name]) / walls[name] for name in modes}
    print(f"throughput with logprobs=5 / without: {rates['logprobs=5'] / rates['no logprobs']:.2f}x")


if __name__ == "__main__":
    main()
