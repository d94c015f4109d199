"""Cores at a real model's size against eager transformers: the reference measurement of issue 23.

``python -m benchmarks.realsize --threads 2`` builds a random checkpoint in the Qwen3-0.6B shape
(vocabulary 151,936, 28 layers, hidden 1024, 16 query and 8 KV heads, head_dim 128, MLP 3072, tied
embeddings), exports it with ``ignition export-core`` and prints, in one run against HF eager on
the same checkpoint, prompts and threads:

- export seconds (``export-core`` in its own process; where they went, from the stage table it prints),
  ``load_core`` seconds (here, the first load after the export, and in ``FRESH_LOADS`` fresh processes one after
  another), each with the memory it faulted in and the
  host's rate of faulting in fresh memory right after it (``fault_seconds_per_gib``), and the peak RSS of a fresh
  process that only loads the core;
- prefill tokens/s: 8 prompts of 512 tokens, 8 of 4 and 8 of 64 tokens, and 1 of 2,048 (a second, one-slot core);
- decode tokens/s at batch 1, 8 and 32 with logprobs off, 5 and 20: the lanes over the median decode step of
  ``--decode-repeats`` runs of N+1 tokens each (every step after the first token's, so prefill is not counted; ours: an
  engine step, HF's: between consecutive tokens of ``generate``, its logits processor doing ``log_softmax`` +
  ``topk``), after one untimed run at each batch, the settings alternated run by run, each round starting one
  setting later (the median step of each run goes to stderr, with the rounds' ratios of logprobs 20's run over off's,
  ``paired_costs``); logprobs 20's cost over off is the median ratio of adjacent steps of two engines stepping in turn,
  one with logprobs 20 and one without (``alternating_costs``);
- the matrix products' share of a decode step's operator time (torch.profiler; the median of ``PROFILED_STEPS``
  steps) at each batch, logprobs 5, and every other operator's self ms, ours and HF's own (``hf_step_profile``);
- llama.cpp as a second anchor (``benchmarks/llama_cpp.py``; Qwen3 shape only): the same checkpoint converted to an
  F32 GGUF (``--dtype float32``) or a BF16 one (``--dtype bfloat16``) and decoded by ``llama-batched-bench`` at the
  same batches, prompt length, token count and threads, ``--decode-repeats`` runs, each batch's median beside our
  logprobs-off rate; where llama.cpp is not built the rows say so, with the command that builds it
  (``python -m benchmarks.llama_cpp build``), and its targets read not met; ``--no-llama-cpp`` skips them;
- in FP32, that greedy tokens equal HF's; in BF16, where no bits are promised against transformers (issue 53), the
  fidelity instead: each side's greedy tokens' logprobs against an FP32 reference (the checkpoint's BF16 values in
  FP32, teacher-forced on that side's tokens), our mean deviation at most ``FIDELITY_SLACK`` times HF's BF16
  (``bf16_fidelity``); the ratios, and a last table of the issue's targets, each with what this run measured and
  whether it is met;
- first, the machine (``benchmarks/machine.py``): the CPU model, the ISA flags its kernels rely on, the read
  bandwidth of a streaming one-row GEMV, and the weight-streaming floor (weight bytes / bandwidth), with each decode
  row's fraction of it, ours and HF's. The bandwidth drifts on a shared host, so it is probed again just before and
  just after each decode batch's rows, and those rows are put against the faster of the two (``floor_bandwidths``);
  the header gives the probes' spread over the run and each batch's floor.

``--onnx`` and ``--compile`` export the core with ONNX graphs or AOTInductor packages too, and time every decode
row on ``--runtime onnxruntime`` or the packages as well. ``--layers N`` builds a shallower variant for quick runs; ``--dtype bfloat16`` the bf16 one. ``--prefill-only``
skips the decode rows; ``--compare-serial`` also times every prefill row with one prompt chunk per submission
(``Engine(core, packed=False)``, the path of cores without a packed variant), the two interleaved ``--repeats``
times, and reports medians; ``--core DIR`` reuses an exported core instead of exporting. ``--csv FILE`` adds each
decode row's steps (ours and HF's, per batch and logprobs setting) to a CSV of data rows. The step timing and
profiling (``alternating_costs``, ``step_profile``, ``hf_step_profile``) live in ``benchmarks/_steps.py``.

``--family gemma3`` or ``--family qwen3_5`` builds a Gemma-3-1B-shaped or Qwen3.5-0.8B-shaped checkpoint instead
(``benchmarks/realsize_families.py`` holds the shapes; ``qwen3``, the default, is the one above) and exports it with
that recipe; the memory rows then give each cache kind's state (``inspect-core --memory``), and with the second,
one-slot core (max_seq_len 2,112; exported unless ``--skip-long``, also with ``--skip-prefill``), each kind's bytes
per slot and layer at both lengths: a sliding layer's pools hold the blocks of its window plus a step's rows - 1
(at most max_seq_len, so a family with sliding layers exports its decode core at ``decode_max_seq_len``, past that:
768 for Gemma-3-1B's window of 512), a full layer's every position. ``--vocab N`` replaces the vocabulary size (quick
runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ignition  # noqa: F401  (first: its allocator setting, HUGE_PAGES_VARIABLE, precedes torch's allocations)
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from benchmarks import llama_cpp
from benchmarks._steps import (StepRow, alternating_costs, decode_rates, hf_step_profile, paired_costs, spread,
                               step_profile, step_row, timed, write_rows)
from benchmarks.machine import (BandwidthProbe, cpu_flags, cpu_model, floor_bandwidths, floor_fraction, floor_line,
                                floor_targets, header, relied_flags, weight_bytes)
from benchmarks.realsize_families import FAMILIES, Family, memory_rows
from benchmarks.realsize_families import make_checkpoint as make_family_checkpoint
from ignition.recipes.base import ExportOptions

SHAPE = FAMILIES["qwen3"].shape
DECODE_TOKENS = 16
PROMPT = 4  # decode runs start from short prompts, as the first table row
PREFILL_ROWS = ((8, 512), (8, 4), (8, 64))
"""(prompts, tokens each) of the prefill rows; the first is the one the issue's prefill target judges."""
MAX_SEQ_LEN, LONG_MAX_SEQ_LEN, LONG_PROMPT = 640, 2112, 2048
"""The decode core's max_seq_len (raised past a sliding ring, ``decode_max_seq_len``), the second, one-slot core's
and the prompt the 1 x 2,048 prefill row runs on it."""
CHUNK_LIMIT = next(f.default for f in dataclasses.fields(ExportOptions) if f.name == "chunk_limit")
"""export-core's default --chunk-limit: the rows a step writes, which a sliding ring holds beside its window."""


def decode_max_seq_len(family: Family) -> int:
    """The decode core's max_seq_len: ``MAX_SEQ_LEN``, or more where a sliding layer's window (its window plus a
    step's rows - 1 positions) would otherwise be capped at max_seq_len, so the memory rows compare two lengths at
    which the window is the same."""
    window = family.shape.get("sliding_window")
    return MAX_SEQ_LEN if window is None else max(MAX_SEQ_LEN, window + CHUNK_LIMIT)


def make_checkpoint(directory: Path, layers: int, dtype: str, family: Family = FAMILIES["qwen3"],
                    overrides: dict | None = None) -> Path:
    return make_family_checkpoint(family, directory, layers, dtype, overrides)


def export(checkpoint: Path, out: Path, dtype: str, extra: list[str],
           recipe: str = "qwen3") -> tuple[float, dict[str, float]]:
    """``ignition export-core`` in its own process: (its wall seconds, the stage seconds it printed)."""
    command = [sys.executable, "-m", "ignition.cli", "export-core", str(checkpoint), "--recipe", recipe, "--out",
               str(out), "--dtype", dtype, "--overwrite", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - started, export_stages(done.stdout + "\n" + done.stderr)  # the table goes to stderr


_STAGE_LINE = re.compile(r"^  (\S.*?)\s+(\d+(?:\.\d+)?) s$")


def export_stages(printed: str) -> dict[str, float]:
    """The stage table ``export-core`` prints after ``exported ... in N s``: stage -> seconds."""
    return {m.group(1): float(m.group(2)) for m in map(_STAGE_LINE.match, printed.splitlines()) if m}


def export_cell(stages: dict[str, float]) -> str:
    """Where an export's seconds went: the capture (its workers, its longest variant), the weights' write and the
    validation."""
    parts = []
    capture = next(((name, seconds) for name, seconds in stages.items() if name.startswith("capture (")), None)
    variants = {name.removeprefix("capture:"): seconds for name, seconds in stages.items()
                if name.startswith("capture:")}
    if capture is not None:
        parts.append(f"{capture[0]} {capture[1]:.1f} s")
    elif variants:
        parts.append(f"capture {sum(variants.values()):.1f} s")
    if variants:
        longest = max(variants, key=variants.get)
        parts.append(f"longest variant {longest} {variants[longest]:.1f} s")
    parts += [f"{name} {stages[name]:.1f} s" for name in ("write:weights", "validate") if name in stages]
    return "; ".join(parts)


def ours(core, prompts: list[list[int]], tokens: int, logprobs: int | None,
         packed: bool | None = None, steps: list[float] | None = None) -> tuple[float, list[list[int]]]:
    """``packed``: None leaves the engine's default (the packed prefill when the core has it); False: serial.
    ``steps`` gets the seconds of each decode step: an engine step that every running lane enters with a token
    already generated (the prefill and the first token are not one)."""
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    requests = [Request(p, max_tokens=tokens, logprobs=logprobs, ignore_eos=True) for p in prompts]
    engine = Engine(core) if packed is None else Engine(core, packed=packed)

    def run():
        ids = [sample for request in requests for sample in engine.samples(engine.submit(request))]
        while True:
            decoding = bool(engine.running) and all(state.generated for state in engine.running)
            started = time.perf_counter()
            if not engine.step():
                break
            if decoding and steps is not None:
                steps.append(time.perf_counter() - started)
        return [engine.result(request_id) for request_id in ids]

    seconds, results = timed(run)
    return seconds, [list(r.token_ids) for r in results]


def prefill_rows(core, model, prompts, short_generator,
                 args) -> tuple[list[tuple[str, str, str, str]], int, dict[tuple[int, int], float]]:
    """Prefill rows (8 x 512, 8 x 4, 8 x 64; one generated token, no logprobs): tokens/s, medians of ``--repeats``
    interleaved runs, against HF; with ``--compare-serial`` the serial schedule too. Returns (rows, mismatches: the
    sequences whose greedy token differs from HF's, (count, length) -> our speed over HF's)."""
    rows, mismatches, ratios = [], 0, {}
    for count, length in PREFILL_ROWS:
        batch = prompts(count, length) if (count, length) == PREFILL_ROWS[0] else prompts(count, length,
                                                                                          short_generator)
        sides = {"ours": lambda: ours(core, batch, 1, None), "hf": lambda: hf(model, batch, 1, None)}
        if args.compare_serial:
            sides["serial"] = lambda: ours(core, batch, 1, None, packed=False)
        times: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, side in sides.items():
                seconds, tokens[name] = side()
                times[name].append(seconds)
        differ = sum(sum(a != b for a, b in zip(tokens[name], tokens["hf"])) for name in sides if name != "hf")
        mismatches += differ
        median = {name: statistics.median(values) for name, values in times.items()}
        total = count * length
        ratios[count, length] = median["hf"] / median["ours"]
        rows.append((f"prefill {count} x {length} tokens{_differ(differ)}", f"{total / median['ours']:.1f} tok/s",
                     f"{total / median['hf']:.1f} tok/s", f"{ratios[count, length]:.2f}x"))
        if args.compare_serial:
            rows.append((f"prefill {count} x {length} tokens, one chunk per submission",
                         f"{total / median['serial']:.1f} tok/s", "",
                         f"{median['serial'] / median['ours']:.2f}x slower than packed"))
        print(f"prefill {count} x {length}: seconds per run: " + "; ".join(
            f"{name} {', '.join(f'{v:.2f}' for v in values)}" for name, values in times.items()), file=sys.stderr)
    return rows, mismatches, ratios


def _differ(count: int) -> str:
    """A row label's note of the sequences whose greedy tokens differ from HF's (none: nothing)."""
    return f" ({count} sequence{'s' if count > 1 else ''} differ from HF)" if count else ""


class _StepClock(StoppingCriteria):
    """Never stops ``generate``; notes the time each generated token is appended (after its step's forward, logits
    processors and selection), so consecutive notes bound one decode step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Logprobs(LogitsProcessor):
    """Each step's logprobs, as a client of ``generate`` computes them: ``log_softmax`` of the FP32 logits, the top
    ``k`` and the greedy token's value; the scores pass through unchanged."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, input_ids, scores):
        values = torch.log_softmax(scores.float(), dim=-1)
        values.topk(self.k, dim=-1)
        values.gather(1, scores.argmax(-1, keepdim=True))
        return scores


def hf(model, prompts: list[list[int]], tokens: int, logprobs: int | None,
       steps: list[float] | None = None) -> tuple[float, list[list[int]]]:
    """``generate`` + ``log_softmax`` + ``topk`` in each step; ``steps`` gets the seconds of each decode step (between
    consecutive tokens, so the prefill and the first token are not one)."""
    clock = _StepClock()

    def run():
        with torch.no_grad():
            out = model.generate(torch.tensor(prompts), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([_Logprobs(logprobs)] if logprobs else []),
                                 stopping_criteria=StoppingCriteriaList([clock]), return_dict_in_generate=True)
        return out.sequences[:, len(prompts[0]):].tolist()

    seconds, sequences = timed(run)
    if steps is not None:
        steps.extend(later - earlier for earlier, later in zip(clock.times, clock.times[1:]))
    return seconds, sequences


FIDELITY_TOKENS = 16
"""Greedy tokens a sequence of the BF16 fidelity row (``bf16_fidelity``) generates."""


def bf16_fidelity(core, model, reference, prompts: list[list[int]]) -> tuple[float, float, int]:
    """BF16 fidelity as issue 53 measures it, no bits promised: each side's greedy tokens (ours, logprobs 1; HF's
    BF16 ``generate``), each token's logprob as that side computed it, against the FP32 reference's logprob of the
    same token after the same tokens (``reference``: the checkpoint's BF16 values in FP32, teacher-forced). Returns
    (our mean absolute deviation, HF's, the sequences whose tokens differ from HF's)."""
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    results = Engine(core).generate([Request(p, max_tokens=FIDELITY_TOKENS, logprobs=1, ignore_eos=True)
                                     for p in prompts])
    our_tokens = [[e.id for e in r.entries] for r in results]
    our_values = torch.tensor([[e.logprob for e in r.entries] for r in results], dtype=torch.float64)
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts), max_new_tokens=FIDELITY_TOKENS, min_new_tokens=FIDELITY_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        hf_tokens = out.sequences[:, len(prompts[0]):]
        hf_values = torch.stack([torch.log_softmax(step.float(), -1).gather(1, hf_tokens[:, i:i + 1])[:, 0]
                                 for i, step in enumerate(out.logits)], 1).double()

        def expected(tokens: torch.Tensor) -> torch.Tensor:  # the FP32 reference's logprob of each generated token
            logits = reference(torch.cat([torch.tensor(prompts), tokens], 1)).logits.float()
            steps = torch.log_softmax(logits[:, len(prompts[0]) - 1:-1], -1)
            return steps.gather(2, tokens[:, :, None])[:, :, 0].double()

        ours_deviation = float((our_values - expected(torch.tensor(our_tokens))).abs().mean())
        hf_deviation = float((hf_values - expected(hf_tokens)).abs().mean())
    return ours_deviation, hf_deviation, sum(a != b for a, b in zip(our_tokens, hf_tokens.tolist()))


FIDELITY_SLACK = 1.05
"""The BF16 fidelity target: our mean deviation from the FP32 reference at most this times transformers' own (the
two sides' tokens part ways on a random-weight checkpoint, so each mean covers other positions)."""


def stages(timings: dict[str, float]) -> str:
    """``LoadedCore.timings`` as one cell: the seconds of each load stage."""
    return ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in timings.items())


FAULT_PROBE_BYTES = 512 << 20
"""Fresh memory ``fault_seconds_per_gib`` touches to read the host's state."""
FRESH_LOADS = 3
"""Fresh-process loads, one after another: the first right after this process's own load, the others after it."""


def fault_seconds_per_gib(threads: int) -> float:
    """Seconds per GiB to fault in fresh memory here and now (``FAULT_PROBE_BYTES``, zeroed by torch's threads).

    NOTE: what a load costs on this project's VM depends most on this: memory the guest handed back to the host faults
    in at 2-10 s a GiB (right after an export, which frees many GiB), memory it still holds at about 0.25 s, and a load
    of the Qwen3-0.6B-shaped core touches about 3.1 GiB (the packed weights and the tied embedding). Each load row
    prints the rate measured right after it, so a slow load can be told from a slow host."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    probe = torch.empty(FAULT_PROBE_BYTES, dtype=torch.uint8).zero_()
    seconds = time.perf_counter() - started
    del probe
    return seconds * 2**30 / FAULT_PROBE_BYTES


def fresh_load(core: Path, threads: int) -> tuple[float, float, dict[str, float], float, float]:
    """(peak RSS GiB, ``load_core`` seconds, its stages' seconds, GiB of pages it faulted in, the host's fault rate
    right after it) of a fresh process that imports Ignition and loads ``core``, nothing else (this process's own peak
    also holds the checkpoint it built and transformers' model)."""
    # NOTE: VmHWM, not ru_maxrss: Linux carries a parent's peak into a forked child's ru_maxrss across exec, so
    # the child would report this process's peak; VmHWM is the peak of the child's own address space.
    script = ("import sys, ignition, torch; torch.set_num_threads(int(sys.argv[2])); "
              "import time; from ignition.runtime.core import load_core; "
              "from benchmarks.realsize import fault_seconds_per_gib, faulted_gib, memory_counters; "
              "before = memory_counters(); started = time.perf_counter(); "
              "core = load_core(sys.argv[1]); seconds = time.perf_counter() - started; faulted = faulted_gib(before); "
              "peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')); "
              "import json; print(json.dumps([peak, seconds, core.timings, faulted, "
              "fault_seconds_per_gib(int(sys.argv[2]))]))")
    done = subprocess.run([sys.executable, "-c", script, str(core), str(threads)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        sys.exit(f"loading {core} in a fresh process failed:\n{done.stderr[-2000:]}")
    peak_kib, seconds, timings, faulted, rate = json.loads(done.stdout.strip().splitlines()[-1])
    return peak_kib / 2**20, seconds, timings, faulted, rate


def memory_counters() -> tuple[int, int]:
    """(this process's minor page faults, its anonymous memory on huge pages in KiB): a fault on a 2 MiB huge page
    counts once in the first, so ``faulted_gib`` adds the second's growth (``ignition.HUGE_PAGES_VARIABLE`` puts
    torch's large blocks on huge pages)."""
    huge = next((int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")),
                0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt, huge


def faulted_gib(before: tuple[int, int]) -> float:
    """GiB of memory faulted in since ``before`` (``memory_counters``): 4 KiB faults plus the growth of huge pages."""
    faults, huge = memory_counters()
    return ((faults - before[0]) * resource.getpagesize() + max(huge - before[1], 0) * 1024) / 2**30


def load_cell(timings: dict[str, float], faulted: float, rate: float) -> str:
    """A load row's detail: its stages, the memory it faulted in, and the host's fault rate right after it."""
    return f"{stages(timings)}; faulted in {faulted:.2f} GiB; the host then faulted fresh pages at {rate:.2f} s/GiB"


def targets(export_s: float, loads: list[float], rss_ratio: float, prefill_ratio: float | None,
            rates: dict[tuple[int, int | None], tuple[float, float]], matrix_shares: dict[int, float],
            mismatches: int, logprob_costs: dict[int, list[float]],
            fidelity: tuple[float, float, int] | None = None) -> list[tuple[str, str, bool]]:
    """The issue's targets against this run: (target, what was measured, whether it is met), for the rows it ran.
    ``logprob_costs``: batch -> logprobs 20's cost over off, step pair by step pair (``alternating_costs``); the
    target reads their median."""
    found = [("export at most 60 s", f"{export_s:.1f} s", export_s <= 60.0) if export_s == export_s else None,
             ("load at most 10 s (every load row)", ", ".join(f"{s:.1f}" for s in loads) + " s",
              max(loads) <= 10.0),
             ("peak RSS while loading at most 1.2x weights + KV", f"{rss_ratio:.2f}x", rss_ratio <= 1.2)]
    if prefill_ratio is not None:
        found.append(("prefill 8 x 512 at least 1.0x HF", f"{prefill_ratio:.2f}x", prefill_ratio >= 1.0))
    if (8, 5) in rates:
        ours, hf = rates[8, 5]
        found.append(("decode batch 8, logprobs 5, at least 1.0x HF", f"{ours / hf:.2f}x", ours >= hf))
    if 8 in matrix_shares:
        found.append(("batch 8 step: matrix products at least 85%", f"{100 * matrix_shares[8]:.1f}%",
                      matrix_shares[8] >= 0.85))
    batch_one = [(k, ours / hf) for (size, k), (ours, hf) in rates.items() if size == 1]
    if batch_one:
        worst = min(ratio for _, ratio in batch_one)
        found.append(("decode batch 1 at least 1.3x HF (every logprobs setting)", f"{worst:.2f}x at worst",
                      worst >= 1.3))
    for size, costs in sorted(logprob_costs.items()):
        cost, low, high = spread(costs)
        found.append((f"batch {size}: logprobs 20 costs at most 1.05x of logprobs off",
                      f"{cost:.3f}x (median of {len(costs)} step pairs, quartiles {low:.3f}-{high:.3f})",
                      cost <= 1.05))
    if fidelity is None:
        found.append(("greedy tokens equal HF's", f"{mismatches} sequences differ", mismatches == 0))
    else:  # BF16: no bits promised against transformers (issue 53), the deviation from FP32 instead
        ours_deviation, hf_deviation, _ = fidelity
        found.append((f"BF16 logprobs' mean deviation from the FP32 reference at most {FIDELITY_SLACK:.2f}x HF's BF16",
                      f"{ours_deviation:.4f} against {hf_deviation:.4f} ({ours_deviation / hf_deviation:.2f}x)",
                      ours_deviation <= FIDELITY_SLACK * hf_deviation))
    return [row for row in found if row is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3",
                        help="the real model whose shape the random checkpoint takes (benchmarks/realsize_families.py)")
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the family's real depth)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the family's real one)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--logprobs", default="0,5,20", help="0 means logprobs off")
    parser.add_argument("--skip-prefill", action="store_true", help="skip the prefill rows (8 x 512, 8 x 4, 8 x 64, "
                        "1 x 2048)")
    parser.add_argument("--skip-long", action="store_true", help="skip the second, one-slot core at max_seq_len "
                        "2112 (an export): its 1 x 2048 prefill row and the memory rows at two lengths")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and cores here")
    parser.add_argument("--repeats", type=int, default=3, help="prefill rows: median of this many interleaved runs")
    parser.add_argument("--decode-repeats", type=int, default=5, help="decode rows: the median step of this many runs "
                        "of each setting, the logprobs settings alternated")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    parser.add_argument("--compare-serial", action="store_true",
                        help="prefill rows: also time the serial schedule (one prompt chunk per submission)")
    parser.add_argument("--core", type=Path, default=None, help="use this exported core (no export)")
    parser.add_argument("--onnx", action="store_true", help="export with --onnx and also time every decode row on "
                        "--runtime onnxruntime")
    parser.add_argument("--compile", action="store_true", help="export with --compile inductor and also time every "
                        "decode row on the AOTInductor packages (loaded trusted)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp anchor rows (the checkpoint "
                        "as an F32 or BF16 GGUF, decoded by llama-batched-bench; benchmarks/llama_cpp.py)")
    parser.add_argument("--hf-attention", choices=("sdpa", "eager"), default=None,
                        help="transformers' attention implementation (default: sdpa for float32, its own default; "
                             "eager for bfloat16, the one whose rounding the cores' BF16 attention reproduces, so "
                             "greedy tokens can be compared)")
    parser.add_argument("--csv", type=Path, default=None, help="also add every decode row's steps to this CSV of "
                        "data rows (benchmarks/_steps.py write_rows)")
    args = parser.parse_args()
    family = FAMILIES[args.family]
    args.layers = args.layers or family.layers
    overrides = {} if args.vocab is None else {"vocab_size": args.vocab}
    vocab = overrides.get("vocab_size", family.shape["vocab_size"])
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the export subprocess too
    probe = BandwidthProbe()  # before anything else holds memory or threads
    bandwidth = probe.measure("start")
    floors: dict[int, float] = {}  # each decode batch's floor bandwidth, from the probes beside its rows
    batches = [int(b) for b in args.batches.split(",")]
    settings = [int(k) or None for k in args.logprobs.split(",")]

    from ignition.runtime.core import load_core

    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        checkpoint = make_checkpoint(work / "checkpoint", args.layers, args.dtype, family, overrides)
        slots = max(batches)
        if args.core is None:
            args.core = work / "core"
            export_s, stages = export(checkpoint, args.core, args.dtype,
                              ["--capacities", ",".join(map(str, sorted({1, 8, *batches}))), "--max-seq-len",
                               str(decode_max_seq_len(family)),
                               *(["--onnx"] if args.onnx else []), *(["--compile", "inductor"] if args.compile else [])],
                              family.recipe)
        else:
            export_s, stages = float("nan"), {}
        before = memory_counters()
        load_s, core = timed(lambda: load_core(args.core))
        faulted = faulted_gib(before)
        rate = fault_seconds_per_gib(args.threads)
        streamed = weight_bytes(core.weights)  # what every decode step reads
        weights_gib = streamed / 2**30
        state_gib = sum(t.numel() * t.element_size() for t in core.state.values()) / 2**30
        fresh = [fresh_load(args.core, args.threads) for _ in range(FRESH_LOADS)]
        rows += [("export (default variants + capacities %s, max_seq_len %d)" % (",".join(map(str, batches)),
                                                                                  decode_max_seq_len(family)),
                  "not run (--core)" if export_s != export_s else f"{export_s:.1f} s", "", export_cell(stages)),
                 ("load_core (this process, the first load after the export)", f"{load_s:.1f} s", "",
                  load_cell(core.timings, faulted, rate))]
        rows += [(f"load_core in a fresh process, {ordinal} of {FRESH_LOADS}", f"{seconds:.1f} s", "",
                  load_cell(timings, faulted, rate))
                 for ordinal, (_, seconds, timings, faulted, rate) in enumerate(fresh, 1)]
        load_rss = max(peak for peak, *_ in fresh)
        rows.append(("peak RSS of a process that only loads (weights %.2f GiB + KV %.2f GiB)"
                     % (weights_gib, state_gib), f"{load_rss:.2f} GiB", "",
                     f"{load_rss / (weights_gib + state_gib):.2f}x of weights+KV"))
        attention = args.hf_attention or ("sdpa" if args.dtype == "float32" else "eager")
        hf_load, model = timed(lambda: family.pretrained(checkpoint, args.dtype, attention))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        rows.append(("HF from_pretrained", f"{hf_load:.1f} s", "", ""))
        generator = torch.Generator().manual_seed(1)

        short_generator = torch.Generator().manual_seed(2)  # short prefill rows: the decode prompts stay as they were

        def prompts(count, length, source=generator):
            return torch.randint(0, vocab, (count, length), generator=source).tolist()

        mismatches = 0
        prefill_ratio = None
        if not args.skip_prefill:
            prefill, mismatches, ratios = prefill_rows(core, model, prompts, short_generator, args)
            rows += prefill
            prefill_ratio = ratios[PREFILL_ROWS[0]]
        hf_runs = {}  # batch -> logprobs -> HF's rate and tokens, measured once for every runtime's rows
        data_rows: list[StepRow] = []  # every decode row's steps, for --csv
        config = {"family": args.family, "layers": args.layers, "vocab": vocab, "dtype": args.dtype,
                  "threads": args.threads, "decode_tokens": DECODE_TOKENS, "prompt": PROMPT}

        def decode_rows(label: str, loaded) -> int:
            differing = 0
            for size in batches if not args.prefill_only else ():
                batch = prompts_for[size]
                # NOTE: one untimed run per batch first: the first run at a batch faults in its lanes' KV cache and
                # its buffers, which the first timed setting would otherwise carry alone (with a one-token baseline
                # subtracted, the first setting of each batch read up to 2x too fast)
                ours(loaded, batch, DECODE_TOKENS + 1, None)
                before = probe.measure(f"before batch {size}{label}")["best"]
                if size not in hf_runs:  # HF's rates once, for every runtime's rows
                    hf(model, batch, DECODE_TOKENS + 1, None)
                    hf_runs[size] = decode_rates(lambda p, n, k, t: hf(model, p, n, k, t), batch, settings,
                                                 DECODE_TOKENS + 1, args.decode_repeats)
                    data_rows.extend(step_row("realsize", "hf", "batch", size, hf_runs[size][k].steps,
                                              config | {"logprobs": k or 0}) for k in settings)
                measured = decode_rates(lambda p, n, k, t: ours(loaded, p, n, k, steps=t), batch, settings,
                                       DECODE_TOKENS + 1, args.decode_repeats)
                data_rows.extend(step_row("realsize", f"ours{label}", "batch", size, measured[k].steps,
                                          config | {"logprobs": k or 0}) for k in settings)
                print(f"decode batch {size}{label}: median step of each round, ms: " + "; ".join(
                    f"{side} logprobs {k or 'off'} " + ", ".join(f"{1e3 * step:.1f}" for step in runs[k].rounds)
                    for side, runs in (("ours", measured), ("hf", hf_runs[size])) for k in settings), file=sys.stderr)
                if not label and None in settings and 20 in settings:
                    logprob_costs[size] = alternating_costs(loaded, batch, 20, args.decode_repeats, DECODE_TOKENS)
                    print(f"decode batch {size}: logprobs 20 over off, the rounds' runs "
                          + ", ".join(f"{cost:.3f}" for cost in paired_costs(measured, 20))
                          + f"; {len(logprob_costs[size])} alternating step pairs, median "
                          f"{statistics.median(logprob_costs[size]):.3f}", file=sys.stderr)
                after = probe.measure(f"after batch {size}{label}")["best"]
                read = floor_bandwidths({size: before}, {size: after})[size]
                if not label:
                    floors[size] = read
                for logprobs in settings:
                    rate_hf, tokens_hf = hf_runs[size][logprobs].rate, hf_runs[size][logprobs].tokens
                    rate_ours, tokens_ours = measured[logprobs].rate, measured[logprobs].tokens
                    differ = sum(a != b for a, b in zip(tokens_ours, tokens_hf))
                    differing += differ
                    if not label:
                        rates[size, logprobs] = rate_ours, rate_hf
                    ours_floor, hf_floor = (floor_fraction(rate, size, streamed, read)
                                            for rate in (rate_ours, rate_hf))
                    rows.append((f"decode batch {size}, logprobs {logprobs or 'off'}{label}{_differ(differ)}",
                                 f"{rate_ours:.2f} tok/s ({ours_floor:.0%} of floor)",
                                 f"{rate_hf:.2f} tok/s ({hf_floor:.0%} of floor)", f"{rate_ours / rate_hf:.2f}x"))
                if not label:
                    shares, walls, others = step_profile(loaded, batch, 5)
                    hf_shares, hf_walls, hf_others, _ = hf_step_profile(model, batch, 5)
                    matrix_shares[size] = statistics.median(shares)
                    rows.append((f"decode batch {size}, logprobs 5: {len(shares)} steps under torch.profiler, median",
                                 f"{statistics.median(walls):.0f} ms", f"{statistics.median(hf_walls):.0f} ms",
                                 f"matrix products {100 * matrix_shares[size]:.1f}% of operator time "
                                 f"({100 * min(shares):.1f}-{100 * max(shares):.1f}%), other operators "
                                 f"{statistics.median(others):.1f} ms; HF's own "
                                 f"{100 * statistics.median(hf_shares):.1f}% "
                                 f"({100 * min(hf_shares):.1f}-{100 * max(hf_shares):.1f}%), other operators "
                                 f"{statistics.median(hf_others):.1f} ms"))
            return differing

        rates: dict[tuple[int, int | None], tuple[float, float]] = {}  # (batch, logprobs) -> (ours, HF) tok/s
        matrix_shares: dict[int, float] = {}
        logprob_costs: dict[int, list[float]] = {}  # batch -> logprobs 20's cost over off, step pair by step pair
        prompts_for = {size: prompts(size, PROMPT) for size in batches}
        mismatches += decode_rows("", core)
        fidelity = None
        if args.dtype == "bfloat16":
            reference = family.pretrained(checkpoint, "float32", attention)
            fidelity = bf16_fidelity(core, model, reference, prompts_for[max(batches)])
            del reference
            rows.append((f"BF16 fidelity: mean |logprob - FP32 reference's| over {max(batches)} x {FIDELITY_TOKENS} "
                         "greedy tokens", f"{fidelity[0]:.4f}", f"{fidelity[1]:.4f}",
                         f"{fidelity[0] / fidelity[1]:.2f}x HF's; {fidelity[2]} sequences' tokens differ from HF's"))
        manifest = core.manifest
        anchor_targets: list[tuple[str, str, bool]] = []
        if not args.prefill_only and not args.no_llama_cpp and family.recipe == "qwen3":
            anchor, anchor_targets = llama_cpp.anchor(
                checkpoint, work, args.dtype, batches, PROMPT, DECODE_TOKENS, args.threads, args.decode_repeats,
                {size: ours_rate for (size, logprobs), (ours_rate, _) in rates.items() if logprobs is None})
            rows += anchor
        del core
        if not args.skip_long:  # the memory rows at two lengths, and the long prefill row unless --skip-prefill
            long_export, _ = export(checkpoint, work / "core-long", args.dtype,
                                 ["--capacities", "1", "--max-seq-len", str(LONG_MAX_SEQ_LEN)], family.recipe)
            long_core = load_core(work / "core-long")
            rows += memory_rows(manifest, long_core.manifest)
            if not args.skip_prefill:
                batch = prompts(1, LONG_PROMPT)
                t_ours, _ = ours(long_core, batch, 1, None)
                t_hf, _ = hf(model, batch, 1, None)
                rows.append((f"prefill 1 x {LONG_PROMPT} tokens (one-slot core, export {long_export:.0f} s)",
                             f"{LONG_PROMPT / t_ours:.1f} tok/s", f"{LONG_PROMPT / t_hf:.1f} tok/s",
                             f"{t_hf / t_ours:.2f}x"))
            del long_core
        else:
            rows += memory_rows(manifest)
        # NOTE: the other runtimes last, one at a time: AOTInductor's native code stays loaded in the process (with
        # both cores loaded, the torch rows of a --layers 2 run fell from 163 to 68 tok/s at batch 8)
        if args.onnx:
            mismatches += decode_rows(", onnxruntime", load_core(args.core, runtime="onnxruntime"))
        if args.compile:
            compiled = load_core(args.core, trust_compiled=True)
            mismatches += decode_rows(f", AOTInductor ({compiled.backend})", compiled)
            del compiled
    print(header(args.threads, bandwidth))
    print(f"read bandwidth over the run: {probe.spread()}; each decode batch's rows against the faster probe "
          "beside them")
    print(floor_line(streamed, bandwidth["best"]) + " (the start's probe)")
    for size, read in floors.items():
        print(f"decode batch {size}: " + floor_line(streamed, read))
    print(f"HF attention: {attention}")
    vocabulary = "" if args.vocab is None else f", vocabulary {vocab}"
    print(f"{family.label} shape, {args.layers} layers{vocabulary}, {args.dtype}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, decode {DECODE_TOKENS} tokens from {PROMPT}-token prompts")
    print("| measure | Ignition | HF eager | ratio |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"greedy tokens equal to HF: {'yes' if mismatches == 0 else f'NO ({mismatches} sequences differ)'}"
          + (" (BF16: no bits promised; the fidelity row and target measure it)" if fidelity else ""))
    verdicts = targets(export_s, [load_s, *(seconds for _, seconds, *_ in fresh)], load_rss / (weights_gib + state_gib),
                       prefill_ratio, rates, matrix_shares, mismatches, logprob_costs, fidelity)
    verdicts += floor_targets(rates, streamed, floors)
    verdicts += anchor_targets
    print(f"\n| target (issue 23; this run: {args.dtype}) | measured | met |\n|---|---|---|")
    for target, measured, met in verdicts:
        print(f"| {target} | {measured} | {'yes' if met else '**no**'} |")
    print(json.dumps({"cpu": cpu_model(), "isa": relied_flags(cpu_flags()), "read_bandwidth": bandwidth,
                      "probes": [[label, rates["best"]] for label, rates in probe.samples],
                      "weight_bytes": streamed, "rows": rows, "greedy_mismatches": mismatches, "bf16_fidelity": fidelity,
                      "targets": [[t, m, bool(ok)] for t, m, ok in verdicts]}))
    if args.csv is not None:
        write_rows(args.csv, data_rows)
        print(f"{len(data_rows)} decode step rows written to {args.csv}")
    if (mismatches and fidelity is None) or (fidelity and fidelity[0] > FIDELITY_SLACK * fidelity[1]):
        sys.exit(1)


if __name__ == "__main__":
    main()
