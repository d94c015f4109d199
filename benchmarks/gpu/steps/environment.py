"""Versions, the device, its driver and clocks; and whether the carried cores can serve this device."""

from __future__ import annotations

import platform
import shutil
import subprocess
from importlib import metadata

from benchmarks.gpu.record import step_main

SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "clocks.applications.graphics", "power.draw", "temperature.gpu", "pstate", "memory.total")
DISTRIBUTIONS = ("torch", "triton", "cuda-bindings", "transformers", "tokenizers", "safetensors", "numpy", "fastapi",
                 "uvicorn", "pytest")


def nvidia_smi() -> dict[str, str]:
    """One ``nvidia-smi --query-gpu`` reading of ``SMI_FIELDS`` for GPU 0 ({"error": ...} when it cannot)."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi is not on PATH"}
    done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()[-500:]}
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS, values))


def run(context, record) -> None:
    import torch

    from benchmarks.gpu.cores import read_prepared

    versions = {"python": platform.python_version(), "torch_cuda": torch.version.cuda}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    record.metric("versions", versions)
    if not record.check("CUDA is available", torch.cuda.is_available()):
        return
    from cuda.bindings import driver

    capability = torch.cuda.get_device_capability()
    properties = torch.cuda.get_device_properties(0)
    _, cuda_driver = driver.cuDriverGetVersion()
    target = f"cuda:{capability[0] * 10 + capability[1]}"  # the exporter's --targets name
    record.metric("device", {"name": properties.name, "capability": f"{capability[0]}.{capability[1]}",
                             "target": target, "multiprocessors": properties.multi_processor_count,
                             "memory_gib": round(properties.total_memory / 2**30, 1),
                             "driver_cuda_version": cuda_driver, "count": torch.cuda.device_count()})
    record.metric("nvidia_smi", nvidia_smi())
    prepared = read_prepared(context.cores)
    record.metric("carried_cores", prepared)
    record.check("the carried cores hold kernels for this device", prepared is not None and target in
                 prepared["targets"], f"device target {target}; carried "
                 + (f"{prepared['targets']} (torch {prepared['torch']})" if prepared else
                    f"nothing at {context.cores}: run `make gpu-check DRY=1` there and carry build/gpu-check-cores"))


if __name__ == "__main__":
    step_main(run)
