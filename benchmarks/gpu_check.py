"""`make gpu-check`: the one prepared script for a CUDA machine (sized for 8 minutes on an H200).

Steps, each timed and reported even when a later one fails:

1. environment: torch, Triton, cuda-bindings versions and the device's compute capability;
2. export the tiny Qwen3 example and a Qwen3-0.6B-shaped random-weight checkpoint
   (vocabulary 151,936, bf16) with ``--targets`` for this device's architecture;
3. ``pytest -m cuda`` (the CUDA replay tests);
4. ``ignition run CORE --device cuda|cpu --logprobs 5 --json`` on the tiny core: same ids, values within 2e-5;
5. decode tokens/s at batch 1, 8 and 32 with logprobs 0, 5 and 20 against Hugging Face
   ``generate(output_logits=True)`` + ``log_softmax`` + ``topk`` on the same checkpoint and GPU;
6. a core with logprob buffers serving requests that ask for none, against one without them;
7. scored-prefill throughput as a ratio of ordinary prefill at K=0 and K=20;
8. ``benchmarks.reduction --device cuda``: the reduction against the vLLM-style path and the one-read floor;
9. the vocabulary-sharded stages (Qwen3 vocabulary at TP=2 and TP=4, bf16, one process with the
   all-gathers emulated by concatenation): the six Triton launches per rank against the torch
   reference stages, words compared and each rank's stage time measured; then sharded prompt
   scoring the same way (a 64-row block, the seven scoring launches per rank).

Results go to ``OUT/results.md`` (a table per step with the command) and ``OUT/log.txt``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
PROMPT, NEW_TOKENS, BATCHES, LOGPROBS = 128, 64, (1, 8, 32), (0, 5, 20)


class Report:
    def __init__(self, out: Path):
        self.out, self.lines = out, ["# GPU check", "", f"command: `make gpu-check` (python -m benchmarks.gpu_check)", ""]

    def section(self, title: str, rows: list[list], header: list[str]) -> None:
        self.lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]
        self.flush()

    def note(self, text: str) -> None:
        self.lines += [text, ""]
        self.flush()

    def flush(self) -> None:
        (self.out / "results.md").write_text("\n".join(self.lines) + "\n")
        print("\n".join(self.lines[-8:]), flush=True)


def qwen3_checkpoint(directory: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B, eos_token_id=0, bos_token_id=0))
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0.0, parameter.shape[1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def export(checkpoint: Path | None, out: Path, recipe: str = "qwen3", **options) -> Path:
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    export_core(ExportOptions(recipe=recipe, checkpoint=checkpoint, **options), out, overwrite=True)
    return out


def median_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def decode_rate(core, batch: int, logprobs: int | None) -> float:
    from ignition.runtime.scheduler import Engine
    from ignition.runtime.requests import Request

    prompts = [[(17 * i + 5 * j) % 150000 + 1 for j in range(PROMPT)] for i in range(batch)]

    def run():
        requests = [Request(p, max_tokens=NEW_TOKENS, logprobs=logprobs or None, ignore_eos=True) for p in prompts]
        results = Engine(core).generate(requests)
        assert all(r.error is None and len(r.token_ids) == NEW_TOKENS for r in results), results[0].error

    return batch * NEW_TOKENS / median_time(run)


def hf_rate(model, batch: int, k: int) -> float:
    prompts = torch.tensor([[(17 * i + 5 * j) % 150000 + 1 for j in range(PROMPT)] for i in range(batch)], device="cuda")

    def run():
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            for logits in out.logits:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                if k:
                    logprobs.topk(k, dim=-1)
                logprobs.gather(1, logits.argmax(-1, keepdim=True))

    return batch * NEW_TOKENS / median_time(run)


def step_environment(report: Report) -> str:
    from ignition.runtime.launcher import target_name

    import triton  # the exporter compiles with it; serving never imports it
    from cuda import bindings

    capability = torch.cuda.get_device_capability()
    report.section("environment", [[torch.__version__, triton.__version__, bindings.__version__,
                                    torch.cuda.get_device_name(), f"{capability[0]}.{capability[1]}"]],
                   ["torch", "triton", "cuda-bindings", "device", "capability"])
    return target_name(capability)


def step_cli_parity(report: Report, core: Path) -> None:
    def run(device):
        done = subprocess.run([sys.executable, "-m", "ignition.cli", "run", str(core), "--prompt-ids", "1,2,3",
                               "--max-tokens", "16", "--logprobs", "5", "--json", "--device", device],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        if done.returncode:
            raise RuntimeError(f"run --device {device} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    cuda, cpu = run("cuda"), run("cpu")
    ids = lambda out: [(t["id"], [a["id"] for a in t["top_logprobs"]]) for t in out["tokens"]]  # noqa: E731
    same_ids = ids(cuda) == ids(cpu)
    report.section("ignition run --device cuda vs cpu (tiny Qwen3, --logprobs 5 --json)",
                   [[same_ids, _max_json_difference(cuda, cpu)]], ["same token and alternative ids, in order", "max |logprob difference|"])


def _max_json_difference(a, b) -> float:
    if isinstance(a, dict) and isinstance(b, dict):
        return max([_max_json_difference(a[k], b[k]) for k in a if k in b] + [0.0])
    if isinstance(a, list) and isinstance(b, list):
        return max([_max_json_difference(x, y) for x, y in zip(a, b)] + [0.0])
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b)
    return 0.0


def _shard_logits(vocab: int, rows: int, ranks: int, generator: torch.Generator) -> tuple[int, list[torch.Tensor]]:
    """The shard width and each rank's contiguous bf16 shard of ``[rows, padded vocabulary]`` logits (N(0, 9))."""
    from ignition.catalog.parallel import padded_vocabulary

    padded = padded_vocabulary(vocab, ranks)
    width = padded // ranks
    logits = (torch.randn(rows, padded, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    return width, [logits[:, r * width:(r + 1) * width].contiguous() for r in range(ranks)]


def step_sharded(report: Report) -> None:
    """The six sharded launches per rank (JIT-compiled here) against the torch stages, on one GPU."""
    from ignition.components import vocabulary_logprobs as V
    from ignition.components.triton_vocabulary import TritonVocabulary

    vocab, rows, k, rows_out = 151936, 32, 20, []
    g = torch.Generator(device="cuda").manual_seed(0)
    for ranks in (2, 4):
        width, parts = _shard_logits(vocab, rows, ranks, g)
        chosen = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        requested = torch.ones(rows, dtype=torch.int32, device="cuda")
        out_rows = torch.arange(rows, device="cuda")
        launches = [TritonVocabulary() for _ in parts]

        def reference(out):
            stats = torch.cat([V.shard_statistics(x, requested, r * width, vocab) for r, x in enumerate(parts)])
            cands = torch.cat([V.shard_candidates(x, stats, chosen, requested, None, None, r * width, vocab)
                               for r, x in enumerate(parts)])
            V.merge_vocabulary_logprobs(stats, cands, chosen, requested, out, out_rows, None, None, vocab, width, k)
            return stats, cands

        def triton(out, stats=None, cands=None):
            own = torch.cat([t.statistics(x, requested, r * width, vocab) for r, (t, x) in enumerate(zip(launches, parts))])
            stats = own if stats is None else stats
            got = torch.cat([t.candidates(x, stats, chosen, requested, None, None, r * width, vocab)
                             for r, (t, x) in enumerate(zip(launches, parts))])
            launches[0].merge(stats, got if cands is None else cands, chosen, requested, out, out_rows, None, None,
                              vocab, width, k)
            return own, got

        ref_out, tri_out, staged_out = (torch.zeros(rows, 2 + 2 * k, dtype=torch.int32, device="cuda")
                                        for _ in range(3))
        stats, cands = reference(ref_out)
        own_stats, staged_cands = triton(staged_out, stats, cands)  # every stage fed the reference's exchanges
        triton(tri_out)
        words = lambda t: t.view(torch.int32)  # noqa: E731
        stats_same = bool(torch.equal(words(own_stats)[:, 0], words(stats)[:, 0]))
        mass_rel = float(((own_stats[:, 1] - stats[:, 1]).abs() / stats[:, 1].abs()).max())
        cands_same = bool(torch.equal(words(staged_cands), words(cands)))
        merge_same = bool(torch.equal(staged_out, ref_out))
        ids_same = bool(torch.equal(tri_out[:, 0::2], ref_out[:, 0::2]))
        value_diff = float((tri_out[:, 1::2].view(torch.float32) - ref_out[:, 1::2].view(torch.float32)).abs().max())
        torch_ms, triton_ms = (median_time(lambda: run(torch.zeros_like(ref_out))) * 1e3 / ranks
                               for run in (reference, triton))
        rows_out.append([ranks, width, stats_same, f"{mass_rel:.2e}", cands_same, merge_same, ids_same,
                         f"{value_diff:.2e}", f"{torch_ms:.2f}", f"{triton_ms:.2f}"])
    report.section(f"vocabulary-sharded stages, {rows} rows, vocabulary {vocab}, bf16, K={k} (gathers emulated)",
                   rows_out, ["ranks", "vocab_shard", "exchange 1 max words equal", "mass max rel diff",
                              "exchange 2 equal (same inputs)", "merge equal (same inputs)", "pipeline ids equal",
                              "pipeline max value diff", "torch ms/rank", "triton ms/rank"])
    step_sharded_scoring(report, vocab)


def step_sharded_scoring(report: Report, vocab: int) -> None:
    """The seven sharded scoring launches per rank (JIT) against the torch scoring stages, one 64-row block."""
    from ignition.catalog.contract import PROMPT_ROW_WIDTH, SCORING_ROW_BLOCK
    from ignition.components import vocabulary_logprobs as V
    from ignition.components.triton_vocabulary import TritonScoring

    rows, rows_out = SCORING_ROW_BLOCK, []
    g = torch.Generator(device="cuda").manual_seed(1)
    for ranks in (2, 4):
        width, parts = _shard_logits(vocab, rows, ranks, g)
        targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g, dtype=torch.int32)
        targets[-1] = -1  # the prompt's end
        out_rows = torch.arange(rows, device="cuda")
        launches = [TritonScoring() for _ in parts]

        def reference(out):
            stats = torch.cat([V.score_shard_statistics(x, targets, r * width, vocab) for r, x in enumerate(parts)])
            cands = torch.cat([V.score_shard_candidates(x, stats, targets, r * width, vocab)
                               for r, x in enumerate(parts)])
            V.merge_prompt_scores(stats, cands, targets, out, out_rows, vocab, width)
            return stats, cands

        def triton(out, stats=None, cands=None):
            own = torch.cat([t.statistics(x, targets, r * width, vocab) for r, (t, x) in enumerate(zip(launches, parts))])
            stats = own if stats is None else stats
            got = torch.cat([t.candidates(x, stats, targets, r * width, vocab)
                             for r, (t, x) in enumerate(zip(launches, parts))])
            launches[0].merge(stats, got if cands is None else cands, targets, out, out_rows, vocab, width)
            return own, got

        ref_out, tri_out, staged_out = (torch.zeros(rows, PROMPT_ROW_WIDTH, dtype=torch.int32, device="cuda")
                                        for _ in range(3))
        stats, cands = reference(ref_out)
        own_stats, staged_cands = triton(staged_out, stats, cands)  # every stage fed the reference's exchanges
        triton(tri_out)
        stats_same = bool(torch.equal(own_stats[:, [0, 2]], stats[:, [0, 2]]))
        mass, expected = own_stats[:, 1].view(torch.float32), stats[:, 1].view(torch.float32)
        valid = expected != 0
        mass_rel = float(((mass - expected).abs() / expected.abs())[valid].max())
        ids = [0, 2] + list(range(3, PROMPT_ROW_WIDTH, 2))
        values = [1] + list(range(4, PROMPT_ROW_WIDTH, 2))
        value_diff = float((tri_out[:, values].view(torch.float32) - ref_out[:, values].view(torch.float32))
                           .nan_to_num().abs().max())
        torch_ms, triton_ms = (median_time(lambda: run(torch.zeros_like(ref_out))) * 1e3 / ranks
                               for run in (reference, triton))
        rows_out.append([ranks, width, stats_same, f"{mass_rel:.2e}", bool(torch.equal(staged_cands, cands)),
                         bool(torch.equal(staged_out, ref_out)), bool(torch.equal(tri_out[:, ids], ref_out[:, ids])),
                         f"{value_diff:.2e}", f"{torch_ms:.2f}", f"{triton_ms:.2f}"])
    report.section(f"vocabulary-sharded prompt scoring, {rows} rows, vocabulary {vocab}, bf16 (gathers emulated)",
                   rows_out, ["ranks", "vocab_shard", "exchange 1 max/target words equal", "mass max rel diff",
                              "exchange 2 equal (same inputs)", "merge equal (same inputs)",
                              "pipeline ids and ranks equal", "pipeline max value diff", "torch ms/rank",
                              "triton ms/rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check")
    parser.add_argument("--skip-pytest", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu-check needs a CUDA device: torch.cuda.is_available() is False")
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    work = args.out / "work"
    steps = []

    def step(name):
        def wrap(fn):
            steps.append((name, fn))
            return fn
        return wrap

    state = {}

    @step("environment")
    def _():
        state["target"] = step_environment(report)

    @step("export")
    def _():
        sys.path.insert(0, str(ROOT / "examples"))
        from make_tiny_qwen3 import make_checkpoint

        target, rows = (state["target"],), []
        started = time.perf_counter()
        state["tiny"] = export(make_checkpoint(work / "tiny-qwen3"), work / "tiny-core", targets=target,
                               prompt_logprobs=True)
        rows.append(["tiny Qwen3", f"{time.perf_counter() - started:.1f}"])
        started = time.perf_counter()
        state["ckpt"] = qwen3_checkpoint(work / "qwen3-0.6b-shape")
        common = dict(capacities=BATCHES, chunk_limit=512, max_seq_len=PROMPT + NEW_TOKENS + 16, targets=target,
                      dtype="bfloat16")
        state["big"] = export(state["ckpt"], work / "big-core", prompt_logprobs=True, **common)
        state["big_plain"] = export(state["ckpt"], work / "big-nolp", logprobs=False, **common)
        rows.append(["Qwen3-0.6B shape (2 cores)", f"{time.perf_counter() - started:.1f}"])
        report.section("export on this machine", rows, ["checkpoint", "seconds"])

    @step("pytest -m cuda")
    def _():
        if args.skip_pytest:
            return
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT,
                              capture_output=True, text=True, timeout=400)
        report.note("### pytest -m cuda\n\n```\n" + (done.stdout[-3000:] + done.stderr[-1500:]).strip() + "\n```")

    @step("run parity")
    def _():
        step_cli_parity(report, state["tiny"])

    @step("decode")
    def _():
        from transformers import Qwen3ForCausalLM

        from ignition.runtime.core import load_core

        core = load_core(state["big"], device="cuda")
        hf = Qwen3ForCausalLM.from_pretrained(state["ckpt"], dtype=torch.bfloat16).cuda().eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        rows = []
        for batch in BATCHES:
            hf_tps = hf_rate(hf, batch, 20)
            for logprobs in LOGPROBS:
                ours = decode_rate(core, batch, logprobs)
                rows.append([batch, logprobs, f"{ours:,.0f}", f"{hf_tps:,.0f}", f"{ours / hf_tps:.2f}x"])
        report.section("decode tokens/s, Qwen3-0.6B shape, bf16 (128-token prompt, 64 new tokens)", rows,
                       ["batch", "logprobs", "ignition", "HF generate + log_softmax + topk", "ratio"])
        plain = load_core(state["big_plain"], device="cuda")
        rows = [[batch, f"{decode_rate(core, batch, None):,.0f}", f"{decode_rate(plain, batch, None):,.0f}"]
                for batch in BATCHES]
        report.section("requests without logprobs: core with buffers vs core without", 
                       [r + [f"{float(r[2].replace(',', '')) / float(r[1].replace(',', '')):.3f}x"] for r in rows],
                       ["batch", "with buffers tok/s", "without tok/s", "cost"])
        state["core"] = core

    @step("scoring")
    def _():
        from ignition.runtime.scheduler import Engine
        from ignition.runtime.requests import Request

        core = state["core"]
        prompts = [[(13 * i + 7 * j) % 150000 + 1 for j in range(900)] for i in range(4)]

        def run(k):
            results = Engine(core).generate([Request(p, max_tokens=0, prompt_logprobs=k) for p in prompts])
            assert all(r.error is None for r in results)

        plain, k0, k20 = (median_time(lambda k=k: run(k)) for k in (None, 0, 20))
        tokens = 4 * 900
        report.section("scored prefill vs ordinary prefill (4 x 900-token prompts)",
                       [["ordinary", f"{tokens / plain:,.0f}", "1.00x"], ["scored K=0", f"{tokens / k0:,.0f}",
                        f"{plain / k0:.2f}x"], ["scored K=20", f"{tokens / k20:,.0f}", f"{plain / k20:.2f}x"]],
                       ["mode", "prompt tokens/s", "of ordinary"])

    @step("reduction")
    def _():
        done = subprocess.run([sys.executable, "-m", "benchmarks.reduction", "--device", "cuda"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        report.note("### python -m benchmarks.reduction --device cuda\n\n```\n"
                    + (done.stdout[-6000:] + done.stderr[-1500:]).strip() + "\n```")

    @step("sharded stages")
    def _():
        step_sharded(report)

    for name, fn in steps:
        started = time.perf_counter()
        try:
            fn()
            status = "ok"
        except Exception:
            status = "FAILED"
            report.note(f"### {name} failed\n\n```\n{traceback.format_exc()[-3000:]}\n```")
        print(f"[gpu-check] {name}: {status} in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
