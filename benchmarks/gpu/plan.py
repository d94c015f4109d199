"""The steps of `make gpu-check`, their budgets, and the deadline they share.

Each step is one subprocess (``python -m benchmarks.gpu.steps.<step>``) killed, with every process it
started, when its timeout passes. A step's timeout is its budget; the last (``elastic``) step also gets
whatever the steps before it left unused. The budgets sum to less than ``DEADLINE_S``, so the whole
check ends inside the deadline however each step behaves.
"""

from __future__ import annotations

from dataclasses import dataclass

DEADLINE_S = 560
"""The device tool's 600-second limit on one command, less 40 s of margin (the runner's own start, the results)."""
SMOKE_S = 30
PYTEST_CUDA_S = 250
"""pytest -m cuda needs 150-280 s on an H200 (collection, the module's exports, CUDA-graph capture); the step is
last and elastic, so it also gets whatever the steps before it leave unused (usually 40 s or more)."""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    module: str  # run as python -m MODULE (benchmarks.gpu.steps.*)
    budget_s: int
    summary: str
    asserts: tuple[str, ...]
    elastic: bool = False  # may also use the time earlier steps left unused

    def __post_init__(self):
        if self.budget_s <= 0:
            raise ValueError(f"step {self.name}: budget_s must be positive, got {self.budget_s}")


PLAN: tuple[Step, ...] = (
    Step("install", "benchmarks.gpu.steps.install", 40,
         "pip install --no-index --find-links build/wheelhouse -r build/wheelhouse/requirements.txt (only what the "
         "image lacks; --target fallback)",
         ("every wheel matches manifest.json", "pip install (or its --target fallback) exits 0", "every requirement "
          "is installed at a version its specifier allows", "ignition's CLI, exporter, runtime and server import")),
    Step("smoke", "benchmarks.gpu.steps.smoke", SMOKE_S,
         "the carried toy core on CUDA: load, one forward, one prepared launch",
         ("load_core(device='cuda', eager=True) puts the weights on CUDA with a prepared reduction",
          "one request returns one token with 5 alternatives",
          "the forward made exactly the prepared launches its catalog lists")),
    Step("environment", "benchmarks.gpu.steps.environment", 15,
         "versions, device, driver and clocks (nvidia-smi)",
         ("CUDA is available", "the carried cores hold kernels for this device's target")),
    Step("export", "benchmarks.gpu.steps.export", 80,
         "export the tiny Qwen3 core (FP32 and BF16) and a vocabulary-151,936 core here, on the image's torch and "
         "Triton",
         ("every export succeeds, with prepared kernels for this device",)),
    Step("parity", "benchmarks.gpu.steps.parity", 60,
         "carried (torch 2.13) and fresh cores, FP32 and BF16: CUDA graphs vs CPU, capture coverage, launch counts",
         ("FP32: same token and logprob ids as CPU, values within 2e-5; BF16: tokens up to near ties, values "
          "within two BF16 ulps", "every capturable variant is captured",
          "replays add only the launches of eager variants", "two cores loaded eagerly at once: each forward makes "
          "exactly its catalog's launches, results still match CPU")),
    Step("serve", "benchmarks.gpu.steps.serve", 30,
         "`ignition serve` on CUDA answers a completion; its process never imported Triton",
         ("the server answers /v1/completions with logprobs, Triton unimportable",
          "no triton module in the serving process")),
    Step("vocabulary", "benchmarks.gpu.steps.vocabulary", 50,
         "vocabulary 151,936: prepared launches vs the CPU reference, tokens vs Hugging Face on this GPU, "
         "prefill and decode timed per logprobs setting (0, 5, 20), each row recorded as it is measured",
         ("same ids as the CPU reference, values within 2e-5", "every capturable variant is captured",
          "greedy tokens equal HF's")),
    Step("pytest-cuda", "benchmarks.gpu.steps.pytest_cuda", PYTEST_CUDA_S,
         "pytest -m cuda over the test files holding cuda-marked tests",
         ("pytest exits 0", "at least one test ran", "no test skipped for want of CUDA"), elastic=True),
)


def budget_problems(plan: tuple[Step, ...] = PLAN, deadline_s: float = DEADLINE_S) -> list[str]:
    """Why ``plan`` cannot keep ``deadline_s`` (empty when it can)."""
    problems = []
    total = sum(step.budget_s for step in plan)
    if total >= deadline_s:
        problems.append(f"the step budgets sum to {total} s, not under the {deadline_s:g} s deadline")
    names = [step.name for step in plan]
    if len(set(names)) != len(names):
        problems.append(f"step names repeat: {names}")
    if sum(step.elastic for step in plan) > 1 or any(step.elastic for step in plan[:-1]):
        problems.append("only the last step may be elastic")
    return problems


def step_timeout(plan: tuple[Step, ...], index: int, elapsed_s: float, deadline_s: float = DEADLINE_S) -> float:
    """Seconds step ``index`` may run when ``elapsed_s`` have passed: its budget (an elastic step: up to the
    deadline), never more than the deadline minus the budgets of the steps after it; 0 when none is left."""
    later = sum(step.budget_s for step in plan[index + 1:])
    room = max(0.0, deadline_s - elapsed_s - later)
    step = plan[index]
    return room if step.elastic else min(float(step.budget_s), room)


def render(plan: tuple[Step, ...] = PLAN, deadline_s: float = DEADLINE_S) -> str:
    """The plan as the dry run prints it."""
    lines = [f"gpu-check plan: {len(plan)} steps, deadline {deadline_s:g} s, budgets sum to "
             f"{sum(s.budget_s for s in plan)} s"]
    for number, step in enumerate(plan):
        extra = " + unused time" if step.elastic else ""
        lines.append(f"  {number}. {step.name:<12} {step.budget_s:>4} s{extra}  {step.summary}")
        lines += [f"       asserts: {a}" for a in step.asserts]
    return "\n".join(lines)
