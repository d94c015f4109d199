"""What a CPU benchmark says about the machine it ran on: the CPU model, the ISA flags the kernels rely on, the read
bandwidth a streaming GEMV reaches, and each decode row's fraction of the weight-streaming floor.

A decode step reads every weight once whatever the batch (the LM head included), so no step can take less than
``weight bytes / bandwidth``: the floor. The bandwidth is measured the way a decode step reads, by one-row products
(``x [1, K] @ W.T``) over a weight far larger than the caches, on ``aten.linear`` and on oneDNN's packed weight, the
faster of the two (a plain sum over a tensor reads slower than either, so it would flatter every row).

NOTE: on a shared host the bandwidth is not a constant: sixteen probes of one weight in one process, 4 s apart,
read 28.0-43.3 GB/s on the AMD EPYC these tables were measured on (``python -m benchmarks.machine --threads 2
--probes 16``). So a run probes again beside each
decode batch (``BandwidthProbe.measure``, on the same weight), and each batch's rows are put against the faster of
the probes just before and just after them (``floor_bandwidths``): a floor measured once, minutes away, would
flatter or wrong a row by up to half.
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
PROBE_PAUSE = 4.0  # seconds between ``--probes``


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


class BandwidthProbe:
    """The read bandwidth of one-row FP32 products over one ``nbytes`` weight, measured as often as a run asks, on
    the same weight each time: ``measure`` returns ``{"aten": .., "packed": .., "best": ..}`` bytes per second, each
    the median of ``repeats`` products (``packed`` absent where this torch has no oneDNN packed linear), and keeps it
    in ``samples`` under its label."""

    def __init__(self, nbytes: int = PROBE_BYTES, width: int = PROBE_WIDTH, repeats: int = PROBE_REPEATS):
        from ignition.runtime.backends.packed_linear import packing_available

        rows = max(1, nbytes // (4 * width))
        self.weight = torch.empty(rows, width).uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(0))
        x = torch.randn(1, width, generator=torch.Generator().manual_seed(1))
        self.products = {"aten": lambda: torch.nn.functional.linear(x, self.weight)}
        if packing_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
            self.products["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        self.repeats = repeats
        self.samples: list[tuple[str, dict]] = []

    def measure(self, label: str = "") -> dict:
        rates = {}
        for name, product in self.products.items():
            product()
            times = []
            for _ in range(self.repeats):
                started = time.perf_counter()
                product()
                times.append(time.perf_counter() - started)
            rates[name] = self.weight.numel() * 4 / sorted(times)[len(times) // 2]
        rates["best"] = max(rates.values())
        self.samples.append((label, rates))
        return rates

    def spread(self) -> str:
        """The probes' fastest reads, lowest to highest, in GB/s: ``26.0-35.3 GB/s over 7 probes``."""
        best = [rates["best"] / 1e9 for _, rates in self.samples]
        return f"{min(best):.1f}-{max(best):.1f} GB/s over {len(best)} probes"


def gemv_bandwidth(nbytes: int = PROBE_BYTES, width: int = PROBE_WIDTH, repeats: int = PROBE_REPEATS) -> dict:
    """One ``BandwidthProbe`` measurement: bytes per second that one-row FP32 products read from a ``nbytes`` weight,
    ``{"aten": .., "packed": .., "best": ..}``."""
    return BandwidthProbe(nbytes, width, repeats).measure()


def floor_bandwidths(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    """Each decode batch's floor bandwidth: the faster of the probes just before and just after its rows (a floor is
    the least time a step could take, so the faster read the host gave while the rows ran)."""
    return {size: max(before[size], after.get(size, before[size])) for size in before}


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
                  bandwidth: float | dict[int, float]) -> list[tuple[str, str, bool]]:
    """Issue 53's decode targets against a run's ``rates`` ((batch, logprobs) -> (ours, HF) tok/s): at batch 1 at
    least 85% of the floor and 1.2x HF, at batch 8 at least 1.5x HF, every logprobs setting; the rows it ran.
    ``bandwidth``: one for every batch, or each batch's (``floor_bandwidths``)."""
    found = []
    for size, floor, ratio in ((1, 0.85, 1.2), (8, None, 1.5)):
        measured = [(ours, hf) for (batch, _), (ours, hf) in rates.items() if batch == size]
        if not measured:
            continue
        if floor is not None:
            read = bandwidth[size] if isinstance(bandwidth, dict) else bandwidth
            worst = min(floor_fraction(ours, size, nbytes, read) for ours, _ in measured)
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
    parser.add_argument("--probes", type=int, default=1, help="probe this many times, 4 s apart, on one weight")
    args = parser.parse_args()
    if args.probes < 1:
        parser.error(f"--probes must be at least 1, got {args.probes}")
    torch.set_num_threads(args.threads)
    probe = BandwidthProbe()
    print(header(args.threads, probe.measure("1")))
    for index in range(2, args.probes + 1):
        time.sleep(PROBE_PAUSE)
        print(f"probe {index}: {probe.measure(str(index))['best'] / 1e9:.1f} GB/s")
    if args.probes > 1:
        print(f"read bandwidth over the run: {probe.spread()}")


if __name__ == "__main__":
    main()
