"""The cost of one ATen call through its ``torch.ops`` overload and through the Python binding that replaces it in a
CPU replay (``runtime/backends/direct_calls.py``), on a decode step's operands at Qwen3-0.6B's width.

``python -m benchmarks.direct_calls --threads 2`` times each call of ``CALLS`` both ways, alternated, the best of
``--repeats`` loops of ``--number`` calls, in microseconds a call, and checks that both ways return the same bits.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from ignition.runtime.backends.direct_calls import BINDINGS
from ignition.runtime.backends.gemm_calibration import cpu_model

aten = torch.ops.aten


def _operands() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"hidden": torch.randn(1, 1024, generator=generator), "other": torch.randn(1, 1024, generator=generator),
            "cache": torch.randn(640, 8, 128, generator=generator), "index": torch.tensor([3])}


CALLS = (
    ("mul [1, 1024]", aten.mul.Tensor, lambda t: (t["hidden"], t["other"])),
    ("add [1, 1024]", aten.add.Tensor, lambda t: (t["hidden"], t["other"])),
    ("sum over 1024", aten.sum.dim_IntList, lambda t: (t["hidden"], [-1], True)),
    ("rsqrt [1, 1024]", aten.rsqrt.default, lambda t: (t["hidden"].abs(),)),
    ("view as [1, 8, 128]", aten.view.default, lambda t: (t["hidden"], [1, 8, 128])),
    ("select a layer", aten.select.int, lambda t: (t["cache"], 0, 5)),
    ("index_select a position", aten.index_select.default, lambda t: (t["cache"], 0, t["index"])),
    ("transpose", aten.transpose.int, lambda t: (t["cache"], 0, 1)),
)
"""(what, overload, its arguments from the operands): calls a decode step makes hundreds of times."""


def measure(number: int, repeats: int) -> list[tuple[str, float, float, bool]]:
    """(what, us through the overload, us through the binding, same bits) for each of ``CALLS``."""
    operands = _operands()
    rows = []
    for what, overload, arguments in CALLS:
        args, binding = arguments(operands), BINDINGS[overload]
        ways = {"overload": lambda: overload(*args), "binding": lambda: binding(*args)}
        best = {name: float("inf") for name in ways}
        for _ in range(repeats):
            for name, call in ways.items():
                best[name] = min(best[name], timeit.timeit(call, number=number) / number)
        same = torch.equal(ways["overload"](), ways["binding"]())
        rows.append((what, best["overload"] * 1e6, best["binding"] * 1e6, same))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--number", type=int, default=20000, help="calls a timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops a way (the best is kept)")
    args = parser.parse_args()
    if args.threads < 1 or args.number < 1 or args.repeats < 1:
        parser.error("--threads, --number and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    rows = measure(args.number, args.repeats)
    print(f"CPU: {cpu_model()}; {args.threads} threads; best of {args.repeats} loops of {args.number} calls")
    print("| call | overload (us) | binding (us) | binding / overload | same bits |")
    print("|---|---|---|---|---|")
    for what, through_overload, through_binding, same in rows:
        print(f"| {what} | {through_overload:.2f} | {through_binding:.2f} | {through_binding / through_overload:.2f}x "
              f"| {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
