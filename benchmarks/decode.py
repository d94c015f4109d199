"""Decode throughput of an exported core through the minimal loader, against Hugging Face.

``python -m benchmarks.decode`` prints, in one run on the tiny Qwen3 example:

1. tokens/s with ``logprobs=5`` through the loader (exported graphs, in-graph reduction)
   against transformers ``generate(output_logits=True)`` followed by ``log_softmax`` and
   ``topk(5)`` on the same checkpoint and prompts;
2. decode cost of a core *with* the logprob buffers serving requests *without* logprobs,
   against a benchmark-only records-only core (``ExportOptions(logprobs=False)``: no logprob
   buffers; the specification rules such cores out of user exports, so the CLI cannot make one).
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
                        help="torch threads (default 1: OpenMP spinning makes 2-thread timings erratic on a shared machine)")
    parser.add_argument("--compile", action="store_true",
                        help="also measure a core exported with --compile inductor (AOTInductor, ~1 min extra)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import Qwen3ForCausalLM

    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = example_checkpoint(tmp)
        common = dict(capacities=(1, 2, 4, 8), max_seq_len=256, chunk_limit=64)
        with_lp = load_core(export(checkpoint, tmp / "lp", **common))
        without_lp = load_core(export(checkpoint, tmp / "nolp", logprobs=False, **common))
        prompts = [[(17 * i + 5 * j) % 300 for j in range(24)] for i in range(args.batch)]

        def ours(core, logprobs):
            requests = [Request(p, max_tokens=args.tokens, logprobs=logprobs, ignore_eos=True) for p in prompts]
            results = Engine(core).generate(requests)
            assert all(len(r.token_ids) == args.tokens for r in results)

        hf = Qwen3ForCausalLM.from_pretrained(checkpoint).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0

        def baseline():
            with torch.no_grad():
                out = hf.generate(torch.tensor(prompts), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
                for logits in out.logits:  # one [batch, vocab] per step
                    logprobs = torch.log_softmax(logits.float(), dim=-1)
                    logprobs.topk(5, dim=-1)
                    logprobs.gather(1, logits.argmax(-1, keepdim=True))

        tokens = args.batch * args.tokens
        t_ours = best_of(lambda: ours(with_lp, 5), args.repeats)
        t_hf = best_of(baseline, args.repeats)
        t_none = best_of(lambda: ours(with_lp, None), args.repeats)
        t_absent = best_of(lambda: ours(without_lp, None), args.repeats)
        print(f"tiny Qwen3 example, {args.batch} requests x {args.tokens} tokens, torch threads {torch.get_num_threads()}")
        print(f"loader, logprobs=5                 {tokens / t_ours:8.1f} tok/s")
        print(f"HF generate + log_softmax + topk   {tokens / t_hf:8.1f} tok/s   ratio ours/HF {t_hf / t_ours:.2f}x")
        print(f"loader, buffers present, no request {tokens / t_none:8.1f} tok/s")
        print(f"loader, core without logprob buffers {tokens / t_absent:8.1f} tok/s   "
              f"cost of present-but-unused buffers {t_none / t_absent:.3f}x")
        if args.compile:
            compiled = load_core(export(checkpoint, tmp / "aoti", compile="inductor", capacities=(args.batch,),
                                        max_seq_len=256, chunk_limit=64), trust_compiled=True)  # exported just now
            t_aoti = best_of(lambda: ours(compiled, 5), args.repeats)
            print(f"loader, AOTInductor core, logprobs=5 {tokens / t_aoti:8.1f} tok/s   ratio ours/HF {t_hf / t_aoti:.2f}x")


if __name__ == "__main__":
    main()
