"""Step 0, second half: the 30-second CUDA smoke test on the carried toy core (load, one forward, one launch)."""

from __future__ import annotations

import time

from benchmarks.gpu.record import step_main


def run(context, record) -> None:
    import torch

    if not record.check("CUDA is available", torch.cuda.is_available(), f"torch {torch.__version__}"):
        return
    from ignition.runtime.core import load_core
    from ignition.runtime.requests import Request

    from benchmarks.gpu.replay import generate, launch_count, variant_launches

    core = context.carried("toy")
    started = time.perf_counter()
    loaded = load_core(core, device="cuda", eager=True)  # eager: the forward itself launches the cubins
    record.metric("load_seconds", round(time.perf_counter() - started, 2))
    on_device = {tensor.device.type for tensor in [*loaded.weights.values(), *loaded.state.values()]}
    record.check("load_core(carried toy core, device='cuda', eager=True): weights on CUDA, a prepared reduction",
                 loaded.device.type == "cuda" and on_device == {"cuda"} and loaded.reduction is not None,
                 f"device {loaded.device}, weights on {sorted(on_device)}, reduction {type(loaded.reduction).__name__}")
    before = launch_count(loaded)
    (result,), submissions, seconds = generate(loaded, [Request(prompt_ids=[1, 2, 3], max_tokens=1, logprobs=5)])
    record.metric("forward_seconds", round(seconds, 3))
    record.check("one forward returns one token with 5 alternatives",
                 result.error is None and len(result.entries) == 1 and len(result.entries[0].top) == 5,
                 f"error={result.error!r} tokens={result.token_ids} submissions={dict(submissions.counts)}")
    expected = submissions.launches(variant_launches(core))
    launched = launch_count(loaded) - before
    record.check("the forward made the prepared launches its catalog lists", launched == expected > 0,
                 f"{launched} launches, expected {expected} for submissions {dict(submissions.counts)}")


if __name__ == "__main__":
    step_main(run)
