"""Vocabulary 151,936 (Qwen3's), on the core exported here by the ``export`` step.

1. the prepared launches (CUDA) against the torch reference (CPU) on the same requests: same ids, values
   within 2e-5;
2. greedy tokens against Hugging Face's Qwen3ForCausalLM on this GPU (fp32, a plain greedy loop);
3. timings at batch 1 and 4 for logprobs off, 0, 5 and 20 (each recorded as it is measured), prefill and decode
   apart, for both:
   Ignition's prefill is ``generate`` with max_tokens=1, its decode the rest of a longer ``generate``;
   HF's prefill is one forward over the prompts, its decode the cached single-token forwards, each step
   doing what a server must for that setting (argmax; log_softmax, the chosen value and top-K; a host copy).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu.record import step_main

PROMPT, NEW_TOKENS, BATCHES, SETTINGS, REPEATS = 32, 32, (1, 4), (None, 0, 5, 20), 3
TIMING_HEADER = ["batch", "logprobs", "ignition prefill ms", "HF prefill ms", "ignition decode tok/s",
                 "HF decode tok/s", "decode speed vs HF"]
"""Each row is recorded as a metric the moment it is measured, so a step cut at its timeout keeps the rows it
reached; the table follows at the end."""


def run(context, record) -> None:
    import torch

    from benchmarks.gpu.cores import QWEN3_VOCABULARY

    if not record.check("CUDA is available", torch.cuda.is_available()):
        return
    core = context.fresh("vocabulary")
    checkpoint = context.work / "checkpoints" / "vocabulary"
    if not record.check("the export step left the vocabulary core and its checkpoint",
                        (core / "manifest.json").is_file() and (checkpoint / "config.json").is_file(), str(core)):
        return
    from ignition.runtime.core import load_core

    from benchmarks.gpu.replay import capture_coverage, compare, generate, launch_count, requests_for

    cpu = load_core(core, device="cpu")
    record.check("the core's vocabulary is 151,936", cpu.vocab_size == QWEN3_VOCABULARY, str(cpu.vocab_size))
    requests = requests_for(cpu)
    cpu_results = generate(cpu, requests)[0]
    del cpu
    loaded = load_core(core, device="cuda")
    record.check("every capturable variant is captured", *capture_coverage(loaded))
    record.check("the prepared reduction launched at this vocabulary", launch_count(loaded) > 0,
                 f"{launch_count(loaded)} launches at load")
    cuda_results = generate(loaded, requests)[0]
    record.check("prepared launches match the CPU reference at vocabulary 151,936 (same ids, within 2e-5)",
                 *compare(cuda_results, cpu_results)[:2])
    with record.attempt("Hugging Face runs on this GPU"):
        model = _hf_model(checkpoint)
        _hf_tokens(record, model, requests, cuda_results)
        _timings(record, loaded, model)


def _hf_model(checkpoint, device: str = "cuda"):
    import torch
    from transformers import Qwen3ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs, as the core's
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()


def _hf_tokens(record, model, requests, cuda_results) -> None:
    import torch

    device = next(model.parameters()).device
    mismatched = []
    for number, (request, result) in enumerate(zip(requests, cuda_results)):
        if request.logprobs is None or request.prompt_logprobs is not None:
            continue
        prompts = torch.tensor([request.prompt_ids], device=device)
        tokens = hf_greedy(model, prompts, len(result.token_ids), None)[0][0].tolist()
        if tokens != result.token_ids:
            mismatched.append(f"request {number}: HF {tokens} vs ignition {result.token_ids}")
    record.check("greedy tokens equal Hugging Face's on this GPU", not mismatched, "; ".join(mismatched))


def _pick(logits, k):
    """What a server does with one step's logits for logprobs setting ``k``; the chosen ids (on the host)."""
    import torch

    chosen = logits.argmax(-1)
    if k is not None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values = [logprobs.gather(1, chosen[:, None])]
        if k:
            top = logprobs.topk(k, dim=-1)
            values += [top.values, top.indices]
        [v.cpu() for v in values]
    return chosen


def hf_greedy(model, prompts, new_tokens: int, k):
    """Greedy tokens ``[batch, new_tokens]`` (host), prefill seconds and decode seconds."""
    import torch

    with torch.inference_mode():
        if prompts.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = model(input_ids=prompts, use_cache=True)
        step = _pick(out.logits[:, -1, :], k)
        tokens = [step.cpu()]
        prefilled = time.perf_counter()
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = model(input_ids=step[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            step = _pick(out.logits[:, -1, :], k)
            tokens.append(step.cpu())
        decoded = time.perf_counter()
    return torch.stack(tokens, dim=1), prefilled - started, decoded - prefilled


def _ignition_times(loaded, prompts, k) -> tuple[float, float]:
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    def once(max_tokens):
        engine = Engine(loaded)
        requests = [Request(prompt_ids=p, max_tokens=max_tokens, logprobs=k, ignore_eos=True) for p in prompts]
        started = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - started
        if any(r.error or len(r.token_ids) != max_tokens for r in results):
            raise RuntimeError(f"generation failed: {[r.error for r in results]}")
        return seconds

    once(NEW_TOKENS)  # warm-up
    prefill = statistics.median(once(1) for _ in range(REPEATS))
    full = statistics.median(once(NEW_TOKENS) for _ in range(REPEATS))
    return prefill, max(full - prefill, 1e-9)


def _timings(record, loaded, model) -> None:
    import torch

    from benchmarks.gpu.steps.environment import nvidia_smi

    record.metric("clocks_before_timing", nvidia_smi())
    device = next(model.parameters()).device
    rows = []
    for batch in BATCHES:
        prompts = [[(17 * i + 5 * j) % 150000 + 1 for j in range(PROMPT)] for i in range(batch)]
        tensor = torch.tensor(prompts, device=device)
        for k in SETTINGS:
            hf_greedy(model, tensor, NEW_TOKENS, k)  # warm-up
            runs = [hf_greedy(model, tensor, NEW_TOKENS, k)[1:] for _ in range(REPEATS)]
            hf_prefill = statistics.median(r[0] for r in runs)
            hf_decode = statistics.median(r[1] for r in runs)
            prefill, decode = _ignition_times(loaded, prompts, k)
            decoded = batch * (NEW_TOKENS - 1)
            rows.append([batch, "off" if k is None else k, f"{prefill * 1e3:.2f}", f"{hf_prefill * 1e3:.2f}",
                         f"{decoded / decode:,.0f}", f"{decoded / hf_decode:,.0f}",
                         f"{hf_decode / decode:.2f}x"])
            record.metric(f"timing batch {batch} logprobs {rows[-1][1]}", dict(zip(TIMING_HEADER, rows[-1])))
    record.metric("clocks_after_timing", nvidia_smi())
    record.table(f"vocabulary 151,936, tiny Qwen3 shape, fp32: {PROMPT}-token prompts, {NEW_TOKENS} tokens "
                 f"(median of {REPEATS})", TIMING_HEADER, rows)


if __name__ == "__main__":
    step_main(run)
