"""What the CUDA steps share: requests sized to a core, result comparison, capture and launch accounting.

Everything goes through the public runtime (``load_core``, ``Engine``, ``Request``) and the core's own
files (``catalog.json`` lists each variant's prepared launches).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

TOLERANCE = 2e-5  # CUDA vs CPU, per logprob value (tests/test_cuda_replay.py holds the same)
LOW_PRECISION_TOLERANCE = 2 * 2**-5
"""BF16/FP16 cores, CUDA vs CPU: the two devices' GEMMs sum in other orders, so a BF16 logit may round one ulp
apart (2**-5 at |logit| in [4, 8)), which moves logit - logsumexp by at most two; tests/test_transformer.py holds
BF16 logits to the same bound. A wrong dtype, row or normalization moves a logprob by O(1)."""
MAX_TOKENS = 12


def catalog(core: Path) -> dict:
    return json.loads((Path(core) / "catalog.json").read_text())


def variant_launches(core: Path) -> dict[str, int]:
    """Prepared launches per forward of each variant, from the core's catalog."""
    return {v["name"]: len(v.get("launches") or []) for v in catalog(core)["variants"]}


def context_of(loaded) -> int | None:
    """The core's context in tokens (None: the recipe declares none, as the toy's)."""
    return loaded.manifest["model"].get("max_seq_len")


def requests_for(loaded, max_tokens: int = MAX_TOKENS) -> list:
    """Greedy requests that fit ``loaded``: natural alternatives, explicit ids and prompt scoring where the
    core supports them. ValueError (naming the core's context) when one would not fit."""
    from ignition.runtime.requests import Request

    vocab, features, context = loaded.vocab_size, loaded.features, context_of(loaded)
    prompts = [[1, 2, 3], [7] * 20, [(5 + i) % vocab for i in range(60)]]
    requests = [Request(prompt_ids=p, max_tokens=max_tokens, logprobs=5, ignore_eos=True) for p in prompts]
    if features.get("explicit_ids"):
        requests.append(Request(prompt_ids=[11 % vocab, 13 % vocab], max_tokens=max_tokens, ignore_eos=True,
                                logprob_token_ids=[0, vocab - 1, 5 % vocab, 3 % vocab]))
    if features.get("prompt_logprobs"):
        requests.append(Request(prompt_ids=[(3 + 7 * i) % vocab for i in range(40)], max_tokens=2,
                                prompt_logprobs=5, ignore_eos=True))
    for request in requests:
        if context is not None and len(request.prompt_ids) + request.max_tokens > context:
            raise ValueError(f"{loaded.path}: a {len(request.prompt_ids)}-token prompt plus {request.max_tokens} "
                             f"tokens exceeds the core's context of {context}")
    return requests


def compare(cuda_results, cpu_results, tolerance: float = TOLERANCE) -> tuple[bool, str, float]:
    """CUDA results against CPU ones: same tokens, alternative ids and order, values within ``tolerance``;
    prompt scores: same ids, values within ``tolerance``, ranks within 1 and the same first alternative
    (near-ties within the tolerance may swap a rank). (ok, first difference or summary, max |difference|)."""
    worst = 0.0
    for number, (cuda, cpu) in enumerate(zip(cuda_results, cpu_results, strict=True)):
        where = f"request {number}"
        if cuda.error or cpu.error:
            return False, f"{where}: error cuda={cuda.error!r} cpu={cpu.error!r}", worst
        if cuda.token_ids != cpu.token_ids:
            return False, f"{where}: tokens {cuda.token_ids} vs cpu {cpu.token_ids}", worst
        for index, (a, b) in enumerate(zip(cuda.entries, cpu.entries, strict=True)):
            if [i for i, _ in a.top] != [i for i, _ in b.top]:
                return False, f"{where} token {index}: alternatives {a.top} vs cpu {b.top}", worst
            pairs = [(a.logprob, b.logprob)] + [(x, y) for (_, x), (_, y) in zip(a.top, b.top)]
            worst = max([worst] + [abs(x - y) for x, y in pairs if x is not None and y is not None])
        for index, (a, b) in enumerate(zip(cuda.prompt_entries or [], cpu.prompt_entries or [], strict=True)):
            if (a is None) != (b is None):
                return False, f"{where} prompt position {index}: {a} vs cpu {b}", worst
            if a is None:
                continue
            if a["id"] != b["id"] or abs(a["rank"] - b["rank"]) > 1 or \
                    [t["id"] for t in a["top_logprobs"]][:1] != [t["id"] for t in b["top_logprobs"]][:1]:
                return False, f"{where} prompt position {index}: {a} vs cpu {b}", worst
            worst = max(worst, abs(a["logprob"] - b["logprob"]))
    ok = worst <= tolerance
    return ok, f"max |difference| {worst:.3g} (tolerance {tolerance:g})", worst


def compare_low_precision(cuda_results, cpu_results,
                          tolerance: float = LOW_PRECISION_TOLERANCE) -> tuple[bool, str, float]:
    """A BF16/FP16 core's CUDA results against its CPU ones, step by step while the tokens agree: the chosen and
    every shared alternative's logprob within ``tolerance``. Where the tokens part, CUDA's token must be a near tie
    on the CPU (its CPU logprob within ``2 * tolerance`` of the CPU's choice), and the request is not compared past
    it; prompt scores: the same ids, values within ``tolerance``. (ok, first difference or summary, max |diff|)."""
    worst, parted = 0.0, 0
    for number, (cuda, cpu) in enumerate(zip(cuda_results, cpu_results, strict=True)):
        where = f"request {number}"
        if cuda.error or cpu.error:
            return False, f"{where}: error cuda={cuda.error!r} cpu={cpu.error!r}", worst
        for index, (a, b) in enumerate(zip(cuda.entries, cpu.entries)):
            cpu_values = dict(b.top)
            if a.id != b.id:
                near = cpu_values.get(a.id)
                if near is None or abs(near - b.logprob) > 2 * tolerance:
                    return False, f"{where} token {index}: {a.id} vs cpu {b.id}, not a near tie ({b.top})", worst
                parted += 1
                break
            shared = [(x, cpu_values[i]) for i, x in a.top if i in cpu_values]
            worst = max([worst] + [abs(x - y) for x, y in [(a.logprob, b.logprob)] + shared
                                   if x is not None and y is not None])
        for index, (a, b) in enumerate(zip(cuda.prompt_entries or [], cpu.prompt_entries or [], strict=True)):
            if (a is None) != (b is None) or (a is not None and a["id"] != b["id"]):
                return False, f"{where} prompt position {index}: {a} vs cpu {b}", worst
            if a is not None:
                worst = max(worst, abs(a["logprob"] - b["logprob"]))
    ok = worst <= tolerance
    return ok, f"max |difference| {worst:.3g} (tolerance {tolerance:g}); {parted} requests parted at a near tie", worst


def capture_coverage(loaded) -> tuple[bool, str]:
    """Every variant is captured or replays eagerly for a stated reason, and at least one is captured."""
    report = loaded.capture
    if report is None:
        return False, "no capture report: the core was loaded eagerly or capture did not run"
    names = set(loaded.variants)
    captured, eager = set(report.captured), dict(report.eager)
    unaccounted = names - captured - set(eager)
    detail = f"{len(captured)} of {len(names)} captured" + (f"; eager: {eager}" if eager else "")
    if unaccounted:
        return False, f"{detail}; neither captured nor eager: {sorted(unaccounted)}"
    return bool(captured), detail


def launch_count(loaded) -> int:
    reduction = getattr(loaded, "reduction", None)
    if reduction is None or not hasattr(reduction, "launch_count"):
        raise RuntimeError(f"{loaded.path}: LoadedCore.reduction.launch_count is not there (no prepared "
                           f"reduction loaded, or the runtime's API changed)")
    return int(reduction.launch_count)


class Submissions:
    """Counts an engine's submissions per variant (``Engine.decode_hook`` sees each one)."""

    def __init__(self, engine):
        self.counts: Counter[str] = Counter()
        engine.decode_hook = lambda variant, reader, pending: self.counts.update([variant.name])

    def launches(self, per_variant: dict[str, int], only: set[str] | None = None) -> int:
        """The prepared launches these submissions make, counting only variants in ``only`` when given."""
        return sum(per_variant.get(name, 0) * n for name, n in self.counts.items() if only is None or name in only)


def generate(loaded, requests) -> tuple[list, Submissions, float]:
    """Results of ``requests`` on a fresh engine, its submissions and the wall seconds."""
    from ignition.runtime.engine import Engine

    engine = Engine(loaded)
    submissions = Submissions(engine)
    started = time.perf_counter()
    results = engine.generate(requests)
    return results, submissions, time.perf_counter() - started
