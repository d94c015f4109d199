"""The blocked product of this checkout against another commit's, oneDNN's packed product and ``aten.linear``.

``python -m benchmarks.blocked_builds --threads 2 --old da7a7e8 --rows 1,8`` builds ``blocked_linear.c`` as this
checkout has it and as commit ``--old`` had it (``blocked_linear.FLAGS``, into a scratch directory), packs
``--layers`` layers of Qwen3-0.6B's linear weights for each (q, k, v, o, gate, up, down: every product of a decode
step but the LM head, too many to stay in cache), and times one pass of plain products over them at each row count,
the paths alternated, the median of ``--repeats`` passes: milliseconds, and weight bytes read per second. oneDNN's
packed product (the eight-row layout; absent where this CPU has no packed path for the dtype) and ``aten.linear``
run the same pass. The two builds' last product of each output width must be bit-identical: a build changes the
speed, never the order of a sum.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import ignition  # noqa: F401  (huge pages for the weights, as a load has them)
import torch

from ignition.runtime.backends import blocked_linear, native_build

SHAPES = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
"""Qwen3-0.6B's linear weights of one layer, [N, K]: q, k, v, o, gate, up, down."""


def build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    path = directory / f"{name}.c"
    path.write_text(source)
    command = [native_build.compiler(), *blocked_linear.FLAGS, str(path), "-o", str(directory / f"{name}.so")]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building {name} failed:\n{done.stderr[-2000:]}")
    return ctypes.CDLL(str(directory / f"{name}.so"))


def blocked_pass(library: ctypes.CDLL, suffix: str, packs, xs, ys, rows: int, threads: int):
    linear = getattr(library, f"blocked_linear_{suffix}")
    for packed, (n, k) in packs:
        if linear(ctypes.c_void_p(xs[k].data_ptr()), ctypes.c_void_p(packed.data_ptr()), None,
                  ctypes.c_void_p(ys[n].data_ptr()), ctypes.c_long(rows), ctypes.c_long(n), ctypes.c_long(k),
                  ctypes.c_long(1), ctypes.c_int(0), ctypes.c_int(threads)):
            raise SystemExit("the blocked product refused its arguments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit whose blocked_linear.c to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    suffix = "f32" if dtype == torch.float32 else "bf16"
    relative = blocked_linear.SOURCE.relative_to(Path(blocked_linear.__file__).parents[3])
    shown = subprocess.run(["git", "show", f"{args.old}:{relative}"], capture_output=True, text=True,
                           cwd=Path(blocked_linear.__file__).parents[3])
    if shown.returncode != 0:
        raise SystemExit(f"git show {args.old}:{relative} failed: {shown.stderr.strip()}")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).to(dtype) for _ in range(args.layers) for shape in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    with tempfile.TemporaryDirectory() as scratch:
        libraries = {"blocked (this checkout)": build(blocked_linear.SOURCE.read_text(), Path(scratch), "new"),
                     f"blocked ({args.old})": build(shown.stdout, Path(scratch), "old")}
        packs = {}
        for name, library in libraries.items():
            packs[name] = []
            for weight in weights:
                packed = torch.empty(-(-weight.shape[0] // blocked_linear.LANES), weight.shape[1],
                                     blocked_linear.LANES, dtype=dtype)
                getattr(library, f"blocked_pack_{suffix}")(ctypes.c_void_p(weight.data_ptr()),
                                                           ctypes.c_void_p(packed.data_ptr()),
                                                           ctypes.c_long(weight.shape[0]),
                                                           ctypes.c_long(weight.shape[1]))
                packs[name].append((packed, tuple(weight.shape)))
        onednn = None
        try:
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        except RuntimeError as exc:  # no oneDNN packed path for this dtype on this CPU
            print(f"oneDNN packed {args.dtype}: unavailable here ({str(exc).splitlines()[0]})")
        print(f"{args.layers} layers of Qwen3-0.6B's linear weights, {nbytes / 1e9:.3f} GB, {args.dtype}, "
              f"{args.threads} threads, median of {args.repeats} passes")
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in (1024, 2048, 3072)}
            outputs = {name: {n: torch.empty(rows, n, dtype=dtype) for n in (1024, 2048, 3072)} for name in libraries}
            passes = {name: (lambda name=name, library=library: blocked_pass(
                library, suffix, packs[name], xs, outputs[name], rows, args.threads))
                for name, library in libraries.items()}
            if onednn is not None:
                passes["oneDNN packed (eight-row layout)"] = lambda: [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(weights, onednn)]
            passes["aten.linear"] = lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]
            seconds = {name: [] for name in passes}
            for _ in range(args.repeats):  # the paths alternated, so a change in the host's bandwidth hits them alike
                for name, one_pass in passes.items():
                    started = time.perf_counter()
                    one_pass()
                    seconds[name].append(time.perf_counter() - started)
            names = list(libraries)
            same = all(torch.equal(outputs[names[0]][n], outputs[names[1]][n]) for n in (1024, 2048, 3072))
            for name, times in seconds.items():
                median = statistics.median(times)
                print(f"rows {rows:4d}  {name:36s} {median * 1e3:8.2f} ms  {nbytes / median / 1e9:6.1f} GB/s")
            print(f"rows {rows:4d}  the two builds' outputs bit-identical: {'yes' if same else 'NO'}")
            if not same:
                raise SystemExit("the builds' outputs differ")


if __name__ == "__main__":
    main()
