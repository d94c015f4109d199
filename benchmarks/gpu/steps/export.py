"""Export the ``FRESH`` cores on this machine (its torch and Triton), side by side in two processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.gpu.record import ROOT, step_main


def run(context, record) -> None:
    import torch

    from benchmarks.gpu.cores import FRESH

    if not record.check("CUDA is available", torch.cuda.is_available()):
        return
    major, minor = torch.cuda.get_device_capability()
    target = f"cuda:{major * 10 + minor}"
    started, processes = time.perf_counter(), {}
    for name in FRESH:
        out = context.fresh(name)
        command = [sys.executable, "-m", "benchmarks.gpu.cores", name, str(out), "--targets", target,
                   "--checkpoints", str(context.work / "checkpoints")]
        print("$ " + " ".join(command), flush=True)
        processes[name] = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True)
    for name, process in processes.items():
        output, _ = process.communicate()
        print(f"--- export {name}\n{output[-3000:]}", flush=True)
        seconds = round(time.perf_counter() - started, 1)
        core = context.fresh(name)
        targets = json.loads((core / "manifest.json").read_text()).get("targets", []) \
            if process.returncode == 0 else []
        record.check(f"export {name} with kernels for {target}", process.returncode == 0 and target in targets,
                     f"exit {process.returncode}, {seconds} s since the exports started, targets {targets}")


if __name__ == "__main__":
    step_main(run)
