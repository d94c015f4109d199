"""CPU decode throughput of one core on both runtimes: the torch loader and onnxruntime.

``python -m benchmarks.onnx_decode`` exports the tiny Qwen3 example once with ``--onnx`` and
times the same greedy requests (``--batch`` prompts of 24 tokens, ``--tokens`` new tokens each)
through ``Engine`` on ``load_core(runtime="torch")`` and ``load_core(runtime="onnxruntime")``,
with and without ``logprobs=5``. Both runtimes get the same thread count (``--threads``). The
time includes prefill; decode dominates (``--tokens`` rounds against one prefill per request).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks._common import best_of, example_checkpoint, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="threads for both runtimes (default 1: OpenMP spinning makes 2-thread timings erratic "
                             "on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the onnxruntime backend uses torch.get_num_threads() too

    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        core = export(example_checkpoint(tmp), tmp / "core", capacities=(args.batch,), max_seq_len=256,
                      chunk_limit=64, onnx=True)
        prompts = [[(17 * i + 5 * j) % 300 for j in range(24)] for i in range(args.batch)]
        tokens = args.batch * args.tokens
        results = {}
        for runtime in ("torch", "onnxruntime"):
            loaded = load_core(core, runtime=runtime)
            if runtime == "torch":
                print(f"tiny Qwen3 example (2 layers, d=64, vocab {loaded.vocab_size}), {args.batch} requests x "
                      f"{args.tokens} tokens, {args.threads} thread(s)")
            for logprobs in (None, 5):
                def run():
                    requests = [Request(p, max_tokens=args.tokens, logprobs=logprobs, ignore_eos=True) for p in prompts]
                    done = Engine(loaded).generate(requests)
                    assert all(len(r.token_ids) == args.tokens for r in done)
                    results[runtime, logprobs] = [r.token_ids for r in done]

                seconds = best_of(run, args.repeats)
                print(f"{runtime:<12} logprobs={str(logprobs):<5} {tokens / seconds:8.1f} tok/s")
                results[runtime, logprobs, "s"] = seconds
        for logprobs in (None, 5):
            assert results["torch", logprobs] == results["onnxruntime", logprobs], "runtimes disagree on tokens"
            speedup = results["torch", logprobs, "s"] / results["onnxruntime", logprobs, "s"]
            print(f"onnxruntime / torch, logprobs={logprobs}: {speedup:.2f}x (same tokens)")


if __name__ == "__main__":
    main()
