"""Scored-prefill throughput against ordinary prefill, and the fixed memory the flag adds.

``python -m benchmarks.scoring`` exports the tiny Qwen3 example with ``--prompt-logprobs``
and measures, in one run, prompt tokens/s of ordinary prefill (no scoring), scored prefill
with 0 alternatives requested and with 20, all through the minimal loader (the K-dependent
part is host formatting: the graph always runs the same top-20 reduction). It then prints
``inspect-core --memory``'s account of what the flag costs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks._common import best_of, example_checkpoint, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=900, help="prompt tokens")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ignition.catalog.inspect import inspect_core
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request
    from ignition.validate.core import validate_core

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = example_checkpoint(tmp)
        common = dict(capacities=(1, 2, 4), max_seq_len=1024, chunk_limit=512)
        scored_path = export(checkpoint, tmp / "scored", prompt_logprobs=True, **common)
        plain_path = export(checkpoint, tmp / "plain", **common)
        core = load_core(scored_path)
        prompts = [[(13 * i + 7 * j) % 300 for j in range(args.prompt)] for i in range(args.requests)]

        def run(prompt_logprobs):
            results = Engine(core).generate([Request(p, max_tokens=0, prompt_logprobs=prompt_logprobs) for p in prompts])
            assert all(r.error is None for r in results)

        tokens = args.requests * args.prompt
        plain = best_of(lambda: run(None), args.repeats)
        k0 = best_of(lambda: run(0), args.repeats)
        k20 = best_of(lambda: run(20), args.repeats)
        print(f"tiny Qwen3 example, {args.requests} prompts x {args.prompt} tokens, chunk limit 512, "
              f"torch threads {torch.get_num_threads()}")
        print(f"ordinary prefill        {tokens / plain:9.1f} tok/s")
        print(f"scored prefill, K=0     {tokens / k0:9.1f} tok/s   {plain / k0:.2f}x of ordinary (spec: 0.50x)")
        print(f"scored prefill, K=20    {tokens / k20:9.1f} tok/s   {plain / k20:.2f}x of ordinary (spec: 0.37x)")
        budget = 64 << 20
        memory = inspect_core(validate_core(scored_path, check_graphs=False), budget)["memory"]
        plain_memory = inspect_core(validate_core(plain_path, check_graphs=False), budget)["memory"]
        print(f"fixed bytes the flag adds: scoring buffers {memory['prompt_scoring_buffer_bytes']:,}, "
              f"scoring graphs {memory['prompt_scoring_graph_bytes']:,}, completion frames "
              f"{memory['completion_frame_bytes'] - plain_memory['completion_frame_bytes']:,}")
        print(f"KV under a {budget >> 20} MiB state budget: {memory['kv_tokens_without_scoring']:,} tokens without, "
              f"{memory['kv_tokens_with_scoring']:,} with the flag ({100 * memory['kv_capacity_loss']:.2f}% displaced)")


if __name__ == "__main__":
    main()
