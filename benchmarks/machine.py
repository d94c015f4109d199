"""What a CPU benchmark says about the machine it ran on: the CPU model, the ISA flags the kernels rely on, the read
bandwidth a streaming GEMV reaches, and each decode row's fraction of the weight-streaming floor.

A decode step reads every weight once whatever the batch (the LM head included), so no step can take less than
``weight bytes / bandwidth``: the floor. The bandwidth is measured the way a decode step reads, by one-row products
(``x [1, K] @ W.T``) over a weight far larger than the caches, on ``aten.linear`` and on oneDNN's packed weight, the
faster of the two (a plain sum over a tensor reads slower than either, so it would flatter every row).
``python -m benchmarks.machine --threads 2`` prints the header alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from ignition.runtime.backends.gemm_calibration import cpu_model

RELIED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_bf16", "amx_int8")
"""The flags oneDNN and MKL choose their FP32 and BF16 kernels by: AVX2/FMA, AVX-512, VNNI, BF16 and AMX."""
PROBE_BYTES = 512 << 20  # many times any L3 cache here
PROBE_WIDTH = 1024  # Qwen3-0.6B's hidden size: the reduction length of most of its products
PROBE_REPEATS = 7


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first CPU in ``/proc/cpuinfo`` (``cpuinfo``: its text, for tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def relied_flags(flags: set[str]) -> list[str]:
    return [flag for flag in RELIED_FLAGS if flag in flags]


def gemv_bandwidth(nbytes: int = PROBE_BYTES, width: int = PROBE_WIDTH, repeats: int = PROBE_REPEATS) -> dict:
    """Bytes per second that one-row FP32 products read from a ``nbytes`` weight: ``{"aten": .., "packed": ..,
    "best": ..}`` (``packed`` absent where this torch has no oneDNN packed linear), each the median of ``repeats``."""
    from ignition.runtime.backends.packed_linear import packing_available

    rows = max(1, nbytes // (4 * width))
    weight = torch.empty(rows, width).uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(1))
    products = {"aten": lambda: torch.nn.functional.linear(x, weight)}
    if packing_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        products["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    rates = {}
    for name, product in products.items():
        product()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            product()
            times.append(time.perf_counter() - started)
        rates[name] = weight.numel() * 4 / sorted(times)[len(times) // 2]
    rates["best"] = max(rates.values())
    return rates


def weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """What a decode step streams: every weight once (a tied embedding is the LM head's, read whole)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in weights.values())


def floor_fraction(tokens_per_s: float, batch: int, nbytes: int, bandwidth: float) -> float:
    """The measured steps per second over the floor's (``bandwidth / nbytes``): 1.0 is weight streaming at the
    measured bandwidth, with nothing else in the step."""
    return (tokens_per_s / batch) * nbytes / bandwidth


def floor_line(nbytes: int, bandwidth: float) -> str:
    return (f"weight-streaming floor: {nbytes / 1e9:.3f} GB of weights at {bandwidth / 1e9:.1f} GB/s = "
            f"{1e3 * nbytes / bandwidth:.1f} ms a decode step")


def floor_targets(rates: dict[tuple[int, int | None], tuple[float, float]], nbytes: int,
                  bandwidth: float) -> list[tuple[str, str, bool]]:
    """Issue 53's decode targets against a run's ``rates`` ((batch, logprobs) -> (ours, HF) tok/s): at batch 1 at
    least 85% of the floor and 1.2x HF, at batch 8 at least 1.5x HF, every logprobs setting; the rows it ran."""
    found = []
    for size, floor, ratio in ((1, 0.85, 1.2), (8, None, 1.5)):
        measured = [(ours, hf) for (batch, _), (ours, hf) in rates.items() if batch == size]
        if not measured:
            continue
        if floor is not None:
            worst = min(floor_fraction(ours, size, nbytes, bandwidth) for ours, _ in measured)
            found.append((f"decode batch {size} at least {floor:.0%} of the weight-streaming floor",
                          f"{worst:.0%} at worst", worst >= floor))
        slowest = min(ours / hf for ours, hf in measured)
        found.append((f"decode batch {size} at least {ratio}x HF eager (every logprobs setting)",
                      f"{slowest:.2f}x at worst", slowest >= ratio))
    return found


def header(threads: int, bandwidth: dict | None = None) -> str:
    """The lines a benchmark prints before its tables."""
    bandwidth = bandwidth or gemv_bandwidth()
    flags = relied_flags(cpu_flags())
    probes = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in bandwidth.items() if name != "best")
    return (f"CPU: {cpu_model()}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"{threads} threads\nISA flags relied on: {' '.join(flags) or 'none of ' + ' '.join(RELIED_FLAGS)}"
            f"{'' if 'amx_bf16' in flags else ' (no AMX)'}\nread bandwidth (streaming one-row FP32 GEMV over "
            f"{PROBE_BYTES >> 20} MiB, median of {PROBE_REPEATS}): {bandwidth['best'] / 1e9:.1f} GB/s ({probes})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(header(args.threads))


if __name__ == "__main__":
    main()
