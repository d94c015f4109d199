"""DeepSeek V4 at V4-Flash width against eager transformers: export, validate, load, serve and decode.

``python -m benchmarks.dsv4 --threads 2`` builds a seeded random 4-layer ``DeepseekV4ForCausalLM`` at the width of
DeepSeek-V4-Flash (``FLASH``: transformers' ``DeepseekV4Config`` defaults, documented against the checkpoint
deepseek-ai/DeepSeek-V4-Flash-Base, whose values the model card and deepseek-ai/DeepSeek-V4-Flash's config.json
share: hidden 4096, 64 query heads over one K=V head of 512 with a 64-wide rotary part, q LoRA rank 1024, 8 output
groups of rank 1024, a lightning indexer of 64 heads of 128 keeping 512 entries, CSA rate 4 and HCA rate 128, a
window of 128, 4 hyper-connection streams with 20 Sinkhorn iterations, 6 of 256 routed experts of 2048 plus one
shared, 3 hash-routed layers; the layer pattern ``compress_ratios`` [0, 0, 4, 128, 4, 128, ...]: two sliding
layers, then CSA and HCA alternating), with two reductions for a host of 24 GiB (``REDUCED``, each stated in the
printed table):

- the vocabulary, 129,280 -> 4,096 words (its embedding and LM head in FP32 would be 4.2 GB of the checkpoint, and
  the vocabulary never touches the state);
- the routed experts, 256 -> 8 a layer (top-6 kept: a routed expert is 3 x 4096 x 2048 weights, 100 MB in FP32,
  so 256 of them are 25.8 GB a layer; 8 keep every routing path: the hash table, top-k with its correction bias).

It exports the checkpoint (``ignition export-core`` in its own process; its seconds and stages), validates the core
(``validate-core``'s rules, their seconds), loads it in a fresh process (seconds, peak RSS), decodes
``DECODE_TOKENS`` greedy tokens at batch 1 and 8 (tokens/s over the median decode step, against transformers'
``generate`` with its cache on the same checkpoint, prompts and threads; greedy tokens must be equal), and serves
it (``ignition serve`` in its own process, one Completions request with ``logprobs``, whose tokens must be the
engine's). ``--tiny`` runs the same steps on the tiny checkpoint's width (examples/make_tiny_deepseek_v4.py),
in a minute: the proof that every step works.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import ignition  # noqa: F401  (first: its allocator setting precedes torch's allocations)
import torch

from benchmarks._steps import decode_rates
from benchmarks.realsize import export, export_cell, fresh_load, hf, ours, stages
from benchmarks.serve import start_server

FLASH = dict(hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
             sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=256,
             num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=1.5,
             swiglu_limit=10.0, vocab_size=129280, rms_norm_eps=1e-6, rope_theta=10_000.0,
             compress_rope_theta=160_000.0, max_position_embeddings=1048576, tie_word_embeddings=False)
"""DeepSeek-V4-Flash's published width (transformers' ``DeepseekV4Config`` defaults)."""
FLASH_HASH_LAYERS = 3
FLASH_PATTERN = (("sliding_attention",) * 2 + ("compressed_sparse_attention", "heavily_compressed_attention") * 20
                 + ("compressed_sparse_attention",))
"""``compress_ratios`` [0, 0, 4, 128, 4, ..., 128, 4] of the 43 layers (the checkpoint's 44th entry, 0, is its
multi-token-prediction layer's)."""
REDUCED = {"vocab_size": 4096, "n_routed_experts": 8}
"""What the benchmark's checkpoint changes from ``FLASH`` (module docstring: why)."""
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2,
            o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=2,
            hc_sinkhorn_iters=5, n_routed_experts=8, moe_intermediate_size=32, vocab_size=320,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            max_position_embeddings=1024)
"""``--tiny``: the tiny checkpoint's width (examples/make_tiny_deepseek_v4.py), Flash's layer pattern."""
DECODE_TOKENS, PROMPT, MAX_SEQ_LEN = 16, 4, 256


def _example():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flash_config(layers: int, overrides: dict | None = None, eos_token_id: int | None = None):
    """The ``DeepseekV4Config`` of Flash's first ``layers`` layers, ``REDUCED`` and then ``overrides`` applied."""
    from transformers import DeepseekV4Config

    values = dict(FLASH) | REDUCED | (overrides or {})
    return DeepseekV4Config(
        num_hidden_layers=layers, layer_types=list(FLASH_PATTERN[:layers]),
        mlp_layer_types=["hash_moe" if i < FLASH_HASH_LAYERS else "moe" for i in range(layers)],
        num_nextn_predict_layers=0, eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=eos_token_id,
        **values)


def reductions(config) -> list[str]:
    """Each value of ``config`` that differs from Flash's published one: "name published -> here"."""
    changed = [f"{name} {value} -> {getattr(config, name)}" for name, value in FLASH.items()
               if getattr(config, name) != value]
    return changed


def served_completion(url: str, name: str, prompt: list[int], tokens: int) -> tuple[float, dict]:
    """One greedy Completions request with ``logprobs`` 5: (its seconds, the choice's logprobs)."""
    import httpx

    body = {"model": name, "prompt": prompt, "max_tokens": tokens, "logprobs": 5, "temperature": 0,
            "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        sys.exit(f"the served completion failed ({response.status_code}): {response.text[:2000]}")
    return seconds, response.json()["choices"][0]["logprobs"]


def verdicts(equal: dict[int, bool], served_equal: bool, violations: int) -> list[tuple[str, str, bool]]:
    """The benchmark's checks: greedy tokens equal transformers' at every batch, the served tokens the engine's, and
    validate-core finds no violation."""
    rows = [(f"batch {batch}: greedy tokens equal transformers'", "equal" if same else "differ", same)
            for batch, same in sorted(equal.items())]
    rows.append(("the served completion's tokens are the engine's", "equal" if served_equal else "differ",
                 served_equal))
    rows.append(("validate-core finds no violation", f"{violations} violations", violations == 0))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3, help="decode: the median step of this many runs")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint's width: a minute, every step")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and core here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request
    from ignition.validate.core import validate_core

    example = _example()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-flash-"))
    tokenizer = example.make_tiny_qwen3.build_tokenizer()
    config = flash_config(args.layers, TINY if args.tiny else None, tokenizer.eos_token_id)
    started = time.perf_counter()
    checkpoint = example.write_checkpoint(config, work / "checkpoint", torch.float32, 0, tokenizer)
    build_s = time.perf_counter() - started
    capacities = ",".join(str(b) for b in sorted(set(batches)))
    export_s, export_stages = export(checkpoint, work / "core", "float32",
                                     ["--capacities", capacities, "--max-seq-len", str(MAX_SEQ_LEN)], "deepseek_v4")
    started = time.perf_counter()
    report = validate_core(work / "core")
    validate_s = time.perf_counter() - started
    rss_gib, load_s, load_stages, _, _ = fresh_load(work / "core", args.threads)
    core = load_core(work / "core")
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rows = [("checkpoint", f"{args.layers} layers, " + "; ".join(reductions(config)), "", f"built in {build_s:.1f} s"),
            ("export", f"{export_s:.1f} s", "", export_cell(export_stages)),
            ("validate-core", f"{validate_s:.1f} s", "", f"{len(report.violations)} violations"),
            ("load (fresh process)", f"{load_s:.1f} s", "", stages(load_stages)),
            ("peak RSS of the loading process", f"{rss_gib:.2f} GiB", "", "")]
    equal = {}
    for batch in batches:
        prompts = [[lane + 1, 7, 9, 11][:PROMPT] for lane in range(batch)]
        mine = decode_rates(lambda p, n, k, t: ours(core, p, n, k, steps=t), prompts, [None], DECODE_TOKENS + 1,
                            args.repeats)[None]
        theirs = decode_rates(lambda p, n, k, t: hf(model, p, n, k, t), prompts, [None], DECODE_TOKENS + 1,
                              args.repeats)[None]
        equal[batch] = mine.tokens == theirs.tokens
        rows.append((f"decode batch {batch}", f"{mine.rate:.2f} tok/s", f"{theirs.rate:.2f} tok/s",
                     f"{mine.rate / theirs.rate:.2f}x"))
    name = "dsv4-flash"
    process, url = start_server(work / "core", name)
    try:
        prompt = [1, 7, 9, 11]
        served_s, served = served_completion(url, name, prompt, 4)
    finally:
        process.terminate()
        process.wait(timeout=60)
    (expected,) = Engine(core).generate([Request(prompt, max_tokens=4, logprobs=5, ignore_eos=True)])
    served_equal = len(served["token_logprobs"]) == len(expected.entries) and all(
        abs(a - e.logprob) < 1e-6 for a, e in zip(served["token_logprobs"], expected.entries))
    rows.append(("served completion (4 tokens, logprobs 5)", f"{served_s:.2f} s", "",
                 f"logprobs {', '.join(f'{v:.4f}' for v in served['token_logprobs'])}"))
    found = verdicts(equal, served_equal, len(report.violations))
    label = "tiny width" if args.tiny else "DeepSeek-V4-Flash width"
    print(f"{label}, {args.layers} layers, float32, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"decode {DECODE_TOKENS} tokens from {PROMPT}-token prompts, median step of {args.repeats} runs")
    print("| measure | Ignition | HF eager | ratio / detail |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n| check | found | met |\n|---|---|---|")
    for check, measured, met in found:
        print(f"| {check} | {measured} | {'yes' if met else '**no**'} |")
    print(json.dumps({"rows": rows, "checks": [[c, m, bool(ok)] for c, m, ok in found]}))
    return 0 if all(met for _, _, met in found) else 1


if __name__ == "__main__":
    sys.exit(main())
