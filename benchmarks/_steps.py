"""Engine decode steps, timed and profiled, and the data rows the step benchmarks write.

The benchmarks that time decode steps (``realsize``, ``decode_steps``, ``core_ab``, ``step_nodes``) build their
engines and time their steps here: ``warmed_engine`` admits requests, prefills them and runs 3 decode rounds, so
the next ``step`` is a steady decode round of every lane; ``timed_steps``, ``decode_rates`` and
``alternating_costs`` time steps; ``profiled_step``, ``step_profile`` and ``hf_step_profile`` split a step's
operator time into the matrix products' and the rest.

A run's measurements are data rows (``StepRow``: one side at one x, the 20th, 50th and 80th percentile of its
steps), which ``write_rows`` adds to a CSV file that many runs and benchmarks share, a row replacing an earlier one
of the same key, as Liger-Kernel's benchmark utilities write ``all_benchmark_data.csv``.
"""

from __future__ import annotations

import csv
import datetime
import inspect
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import ignition  # noqa: F401  (first: its allocator setting, HUGE_PAGES_VARIABLE, precedes torch's allocations)
import numpy as np
import torch

from ignition.runtime.backends import blocked_linear

WARM_ROUNDS = 3
"""Decode rounds ``warmed_engine`` runs after the prefill, before any timed step."""


def timed(fn) -> tuple[float, object]:
    """(wall seconds of ``fn()``, its value)."""
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def lane_prompts(batch: int) -> list[list[int]]:
    """The 4-token prompt of each of ``batch`` lanes, one per lane."""
    return [[lane + 1, 7, 9, 11] for lane in range(batch)]


def decode_requests(prompts: list[list[int]], logprobs: int | None, steps: int) -> list:
    """Greedy requests for ``prompts`` asking ``logprobs``, each with room for ``steps`` decode steps after
    ``warmed_engine``'s prefill and warm-up rounds."""
    from ignition.runtime.requests import Request

    return [Request(prompt, max_tokens=steps + WARM_ROUNDS + 5, logprobs=logprobs, ignore_eos=True)
            for prompt in prompts]


def warmed_engine(core, requests):
    """An ``Engine`` over ``core`` with ``requests`` admitted, every prompt prefilled and ``WARM_ROUNDS`` decode
    rounds run: the next ``step`` is a steady decode round of every lane."""
    from ignition.runtime.engine import Engine

    engine = Engine(core)
    for request in requests:
        engine.submit(request)
    while not engine.running or any(s.prefilled < len(s.context()) for s in engine.running):
        engine.step()
    for _ in range(WARM_ROUNDS):
        engine.step()
    return engine


def timed_steps(engine, steps: int) -> list[float]:
    """Seconds of each of ``steps`` engine steps."""
    return [timed(engine.step)[0] for _ in range(steps)]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of ``values``; a single value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return statistics.median(values), low, high


class Rate(NamedTuple):
    """One logprobs setting's decode measurement (``decode_rates``)."""

    rate: float  # tokens/s: the lanes over the median of every decode step of the setting's runs
    tokens: list[list[int]]  # its first run's generated tokens
    rounds: list[float]  # each run's median decode step, seconds, round by round
    steps: list[float]  # every decode step of its runs, seconds


def decode_rates(side, prompts, settings, tokens: int, repeats: int = 1) -> dict[int | None, Rate]:
    """Each logprobs setting's decode rate from its decode steps' median: ``side(prompts, tokens, logprobs, steps)``
    generates ``tokens`` tokens and appends the seconds of each step after the first token (the prefill's) to
    ``steps``. The settings alternate ``repeats`` rounds, each round starting one setting later, so each sees the same
    drift of the host and none always follows the same one; the median of every step of a setting's runs is robust
    to a disturbed step (the host's speed moves by 10-20% between runs seconds apart)."""
    steps: dict[int | None, list[float]] = {k: [] for k in settings}
    rounds: dict[int | None, list[float]] = {k: [] for k in settings}
    generated: dict[int | None, list[list[int]]] = {}
    for round_ in range(repeats):
        turn = round_ % len(settings)  # each round starts one setting later: none always runs first or last
        for logprobs in settings[turn:] + settings[:turn]:
            run: list[float] = []
            _, ids = side(prompts, tokens, logprobs, run)
            generated.setdefault(logprobs, ids)
            steps[logprobs] += run
            rounds[logprobs].append(statistics.median(run))
    return {k: Rate(len(prompts) / max(statistics.median(steps[k]), 1e-9), generated[k], rounds[k], steps[k])
            for k in settings}


def paired_costs(rates: dict[int | None, Rate], setting: int | None, base: int | None = None) -> list[float]:
    """``setting``'s cost over ``base`` round by round: its run's median step over the base's run of the same round.
    The two runs of a round are at most a round's length apart, so the host's slower drift leaves their ratio alone
    (a decode step's speed moved 10-20% between rounds; the runs of one round, far less)."""
    return [mine / theirs for mine, theirs in zip(rates[setting].rounds, rates[base].rounds)]


def alternating_costs(core, prompts: list[list[int]], logprobs: int, rounds: int, steps: int) -> list[float]:
    """``logprobs``' cost over logprobs off, step pair by step pair. Each of ``rounds`` rounds builds two engines on
    ``prompts`` (``warmed_engine``), one over ``core`` and one over ``core.replica()`` (the weights and programs
    shared, each its own KV cache and buffers), one with ``logprobs`` and one without (the core that has logprobs
    alternates round by round), and steps them in turn ``steps`` times, the engine that goes first alternating pair
    by pair. Returns every pair's ratio, the logprobs step's seconds over the other's. A pair's two steps run a
    fraction of a second apart, so the host's drift, 10-20% between runs seconds apart, leaves the ratio alone."""
    twin = core.replica()
    ratios = []
    for round_ in range(rounds):
        owners = (core, twin) if round_ % 2 == 0 else (twin, core)
        engines = {setting: warmed_engine(owner, decode_requests(prompts, setting, steps))
                   for setting, owner in zip((logprobs, None), owners)}
        for pair in range(steps):
            seconds = {}
            for setting in (logprobs, None) if pair % 2 == 0 else (None, logprobs):
                seconds[setting], _ = timed(engines[setting].step)
            ratios.append(seconds[logprobs] / seconds[None])
    return ratios


MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
                   *blocked_linear.GRAPH_CALLS.values(), "aten::_scaled_dot_product_flash_attention_for_cpu")
"""The profiler names of the matrix products: torch's GEMMs, oneDNN's packed linear, the blocked product and its
row-parallel leaves, summed or not (the names its graph calls record, ``blocked_linear.GRAPH_CALLS``) and the
attention kernel."""

PROFILED_STEPS = 5
"""Decode steps profiled one after another for each batch's row: the row reports their medians (one step can catch
the host's drift: single steps of one engine measured from 71% to 86%)."""


def operator_split(events) -> tuple[float, float]:
    """A profile's operator self time in ms: (the matrix products', every other operator's)."""
    products = sum(e.self_cpu_time_total for e in events if e.key in MATRIX_PRODUCTS)
    return products / 1e3, (sum(e.self_cpu_time_total for e in events) - products) / 1e3


def _keep_step(events, wall: float, shares: list[float], walls: list[float], others: list[float]) -> None:
    """Append one profiled step's matrix share, wall ms and other operators' self ms (``operator_split``)."""
    products, other = operator_split(events)
    shares.append(products / (products + other))
    walls.append(wall * 1e3)
    others.append(other)


def profiled_step(engine, record_shapes: bool = False) -> tuple[object, float, float]:
    """One ``engine.step`` under torch.profiler: (its operator events, by input shape with ``record_shapes``; the
    step's wall seconds; the matrix products' share of its operator self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as trace:
        wall, _ = timed(engine.step)
    events = trace.key_averages(group_by_input_shape=record_shapes)
    products, other = operator_split(events)
    return events, wall, products / (products + other)


def step_profile(core, prompts: list[list[int]], logprobs: int | None,
                 steps: int = PROFILED_STEPS) -> tuple[list[float], list[float], list[float]]:
    """``steps`` engine decode steps of ``prompts`` (``warmed_engine``), each under its own torch.profiler: (the
    matrix products' share of each step's operator self time, each step's wall ms, each step's self ms in every
    other operator)."""
    engine = warmed_engine(core, decode_requests(prompts, logprobs, steps))
    shares, walls, others = [], [], []
    for _ in range(steps):
        events, wall, _ = profiled_step(engine)
        _keep_step(events, wall, shares, walls, others)
    while engine.running:
        engine.step()
    return shares, walls, others


def hf_step_profile(model, prompts: list[list[int]], logprobs: int, steps: int = PROFILED_STEPS,
                    record_shapes: bool = False,
                    events: list | None = None) -> tuple[list[float], list[float], list[float], list[list[int]]]:
    """``steps`` of HF's own decode of ``prompts``, each under its own torch.profiler, as ``step_profile`` measures
    ours: one forward of a token per sequence over its cache (with the attention mask and cache positions
    ``generate`` passes), then ``log_softmax`` and ``topk``, after the prompt and 3 unprofiled steps. Returns the
    matrix products' share of each step's operator self time, each step's wall ms, each step's self ms in every
    other operator, and the greedy tokens (the prompt's, then every step's: ``generate``'s first ``4 + steps``).
    ``events``: each step's operator events are appended (by input shape with ``record_shapes``)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.tensor(prompts)
    batch, length = ids.shape
    shares, walls, others = [], [], []
    # transformers 5 names the cache argument and output ``cache``; 4.x (which pyproject allows) ``past_key_values``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        for step in range(3 + steps):
            position = length + step

            def forward(token=token, position=position):
                logits = model(token, **{name: cache}, use_cache=True, logits_to_keep=1,
                               attention_mask=torch.ones(batch, position + 1, dtype=torch.long),
                               cache_position=torch.tensor([position])).logits[:, -1]
                torch.log_softmax(logits.float(), dim=-1).topk(logprobs, dim=-1)
                return logits.argmax(-1, keepdim=True)

            if step < 3:
                token = forward()
                tokens.append(token)
                continue
            with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as trace:
                wall, token = timed(forward)
            tokens.append(token)
            step_events = trace.key_averages(group_by_input_shape=record_shapes)
            if events is not None:
                events.append(step_events)
            _keep_step(step_events, wall, shares, walls, others)
    return shares, walls, others, torch.cat(tokens, dim=1).tolist()


@dataclass(frozen=True, slots=True)
class StepRow:
    """One measured side at one x: the percentiles of its steps (Liger's ``BenchmarkData``, one x a row)."""

    benchmark: str  # the module that measured it: realsize, decode_steps, core_ab
    side: str  # what was measured: ours, hf, a core's path, a load option
    metric: str  # decode step
    unit: str  # ms
    x_name: str  # batch
    x_value: int
    p20: float
    p50: float
    p80: float
    samples: int
    config: str  # the rest of the setting, canonical JSON (threads, logprobs, core, ...)
    device: str  # the CPU model
    timestamp: str  # UTC, ISO 8601, seconds
    version: str  # Ignition's version


ROW_FIELDS = tuple(f.name for f in fields(StepRow))
ROW_KEY = ("benchmark", "side", "metric", "unit", "x_name", "x_value", "config", "device")
"""A later row of the same key replaces an earlier one in the file."""


def step_row(benchmark: str, side: str, x_name: str, x_value: int, seconds: list[float], config: dict,
             metric: str = "decode step") -> StepRow:
    """The row of ``seconds`` (each step's wall seconds), in ms: its 20th, 50th and 80th percentiles."""
    if not seconds:
        raise ValueError(f"{benchmark} {side} at {x_name} {x_value}: no steps to make a row of")
    from ignition.runtime.backends.gemm_calibration import cpu_model

    p20, p50, p80 = (round(float(v), 4) for v in np.percentile(np.asarray(seconds) * 1e3, [20, 50, 80]))
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return StepRow(benchmark, side, metric, "ms", x_name, int(x_value), p20, p50, p80, len(seconds),
                   json.dumps(config, sort_keys=True, separators=(",", ":")), cpu_model(), now, ignition.__version__)


def write_rows(path: Path, rows: list[StepRow]) -> None:
    """Add ``rows`` to the CSV file ``path`` (created with a header when absent), replacing the file's rows of the
    same key (``ROW_KEY``); the file is replaced whole, so a failed run leaves the previous one."""
    path = Path(path)
    kept: list[dict[str, str]] = []
    if path.exists():
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            if tuple(reader.fieldnames or ()) != ROW_FIELDS:
                raise ValueError(f"{path}: not a step-row file (columns {reader.fieldnames}, expected "
                                 f"{list(ROW_FIELDS)})")
            kept = list(reader)
    key = lambda row: tuple(row[name] for name in ROW_KEY)  # noqa: E731
    new = {key(row): row for row in ({name: str(value) for name, value in asdict(r).items()} for r in rows)}
    kept = [row for row in kept if key(row) not in new]  # a later row of a key wins, in the file and in ``rows``
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(kept + list(new.values()))
    os.replace(partial, path)
