"""The CUDA driver, through NVIDIA's ``cuda-python``: the one module that calls it, and the runtime's device choices.

- ``load_driver``: ``cuda.bindings.driver`` (cuda-python 12.6 and later) or its older home ``cuda.cuda``.
- ``check``: a driver result ``(CUresult, *values)`` -> its values, or ``LauncherError`` naming the driver error.
- ``pack_params``: the ``cuLaunchKernel`` parameter array of a kernel-table signature, refusing a pointer that breaks the
  alignment the binary was compiled for (``tt.divisibility``).
- ``load_function`` and ``launch``: ``cuModuleLoadData`` / ``cuModuleGetFunction`` / ``cuLaunchKernel``.
- ``PrimaryContext``: torch's primary context of a device, made current on whichever thread calls the driver. The CUDA
  runtime (torch) binds it to a thread lazily, the driver API never does, so a thread that has run no torch CUDA call
  yet (the engine's, a server worker's) would otherwise launch with no context at all.
- ``pitched_copy_to_host``: one ``cuMemcpy2DAsync`` of evenly spaced rows from the device into pinned host memory.
- ``resolve_device``, ``is_cuda``, ``device_capability``: which device a load runs on, decided here once.

Nothing here imports Triton or compiles.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import numpy as np
import torch

from ignition.catalog.contract import SCRATCH_POINTERS

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class LauncherError(RuntimeError):
    """The core's prepared kernels cannot serve this device (target, file, alignment or driver failure)."""


# ---- device decisions --------------------------------------------------------------------------
def resolve_device(spec: str | torch.device) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``; ValueError otherwise."""
    text = str(spec).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {spec!r}; expected {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"unsupported device {spec!r}; expected {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} was asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {spec!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def is_cuda(device: torch.device) -> bool:
    """Whether ``device`` replays through CUDA: prepared launches, pinned readback, CUDA graphs."""
    return torch.device(device).type == "cuda"


def device_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability (major, minor) of a CUDA device."""
    return torch.cuda.get_device_capability(device)


# ---- the driver --------------------------------------------------------------------------------
@functools.cache
def load_driver():
    """``cuda.bindings.driver``; LauncherError naming the package when cuda-python is absent."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:  # cuda-python before 12.6 kept the driver bindings here
            from cuda import cuda as driver
        except ImportError:
            raise LauncherError("CUDA replay needs NVIDIA's cuda-python driver bindings: "
                                "pip install cuda-bindings (or cuda-python)") from None
    return driver


def check(result, driver=None):
    """Unwrap a cuda-python ``(CUresult, *values)`` tuple: its value(s), or LauncherError naming the driver error."""
    driver = driver or load_driver()
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        raise LauncherError(f"CUDA driver call failed: {name.decode() if name else int(error)}")
    return values[0] if len(values) == 1 else (values or None)


class PrimaryContext:
    """The primary context of one CUDA device (the one torch uses), retained while this object lives.

    ``make_current`` binds it to the calling thread when another context (or none) is current there and returns what
    to ``restore`` afterwards, so a launch from any thread runs in torch's context and leaves the thread as it was."""

    def __init__(self, device: torch.device, driver=None):
        self.driver = driver or load_driver()
        self.device = device
        torch.zeros(1, device=device)  # torch's lazy CUDA init: the runtime creates the primary context
        check(self.driver.cuInit(0), self.driver)
        ordinal = check(self.driver.cuDeviceGet(device.index or 0), self.driver)
        self.handle = check(self.driver.cuDevicePrimaryCtxRetain(ordinal), self.driver)
        if int(self.handle) == 0:
            raise LauncherError(f"no CUDA primary context for {device}")
        weakref.finalize(self, self.driver.cuDevicePrimaryCtxRelease, ordinal)

    def make_current(self):
        """Bind the context to this thread; returns the context to restore (None when it already was current)."""
        current = check(self.driver.cuCtxGetCurrent(), self.driver)
        if current is not None and int(current) == int(self.handle):
            return None
        check(self.driver.cuCtxSetCurrent(self.handle), self.driver)
        return current

    def restore(self, previous) -> None:
        """Undo ``make_current``: rebind the thread's previous context (none: leave this one current)."""
        if previous is not None and int(previous) != 0:
            check(self.driver.cuCtxSetCurrent(previous), self.driver)


@functools.cache
def primary_context(device: torch.device) -> PrimaryContext:
    """The real driver's PrimaryContext of ``device``, one per process."""
    return PrimaryContext(device)


# ---- modules, parameters, launches -------------------------------------------------------------
_PARAM_TYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
                "fp32": ctypes.c_float, "fp64": ctypes.c_double}


def pack_params(signature: list[dict], values: dict[str, int | float], label: str = "kernel"
                ) -> tuple[ctypes.Array, list]:
    """``cuLaunchKernel`` parameters: the non-constexpr arguments in order, then the null scratch pointers.

    A parameter recorded with ``divisibility`` (the binary was compiled assuming ``tt.divisibility``) must be a
    multiple of it: LauncherError naming ``label`` and the parameter otherwise, since the kernel would read
    misaligned vectors. Returns the ``void*[]`` array and the objects it points into (keep both alive until the
    launch)."""
    holders = []
    for param in signature:
        kind = param["type"]
        if kind == "constexpr":
            continue
        value = values[param["name"]]
        divisibility = param.get("divisibility")
        if divisibility and value % divisibility:
            raise LauncherError(f"{label}: {param['name']} = {value:#x} is not a multiple of {divisibility}, but the "
                                f"prepared binary was compiled assuming it is (tt.divisibility={divisibility})")
        holders.append(ctypes.c_void_p(value) if kind.startswith("*") else _PARAM_TYPES[kind](value))
    holders += [ctypes.c_void_p(0) for _ in range(SCRATCH_POINTERS)]
    array = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    return array, holders


def load_function(driver, image: bytes, kernel_name: str, shared_bytes: int) -> tuple[object, object]:
    """(CUmodule, CUfunction) of a cubin image loaded into the current context; above 48 KiB of dynamic shared
    memory the function opts in to it, as Triton's own launcher does."""
    data = np.frombuffer(image, dtype=np.uint8)
    module = check(driver.cuModuleLoadData(data.ctypes.data), driver)
    function = check(driver.cuModuleGetFunction(module, kernel_name.encode()), driver)
    if shared_bytes > 48 * 1024:
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver.cuFuncSetAttribute(function, attribute, shared_bytes), driver)
    return module, function


def launch(driver, function, grid: tuple[int, int, int], threads: int, shared_bytes: int, stream: int,
           params: ctypes.Array) -> None:
    """One ``cuLaunchKernel`` of ``function`` on ``stream`` (a CUDA stream handle) with packed ``params``."""
    check(driver.cuLaunchKernel(function, *grid, threads, 1, 1, shared_bytes, driver.CUstream(stream),
                                ctypes.addressof(params), 0), driver)


# ---- readback ----------------------------------------------------------------------------------
def pitched_copy_to_host(host_address: int, host_pitch: int, device_address: int, device_pitch: int, row_bytes: int,
                         rows: int, stream: int, driver=None) -> None:
    """``rows`` rows of ``row_bytes`` each, ``device_pitch`` apart on the device, into pinned host memory
    ``host_pitch`` apart, enqueued on ``stream`` (``cuMemcpy2DAsync``; the offsets are in the base addresses,
    so srcXInBytes, srcY, dstXInBytes and dstY stay 0). The driver requires each pitch to be at least
    ``row_bytes``; ValueError before any driver call otherwise."""
    if rows == 0 or row_bytes == 0:
        return
    if row_bytes > device_pitch or row_bytes > host_pitch:
        raise ValueError(f"a pitched copy of {row_bytes}-byte rows needs pitches of at least {row_bytes} bytes, got "
                         f"device {device_pitch} and host {host_pitch}")
    driver = driver or load_driver()
    copy = driver.CUDA_MEMCPY2D()
    copy.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    copy.srcDevice = device_address
    copy.srcPitch = device_pitch
    copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
    copy.dstHost = host_address
    copy.dstPitch = host_pitch
    copy.WidthInBytes = row_bytes
    copy.Height = rows
    check(driver.cuMemcpy2DAsync(copy, driver.CUstream(stream)), driver)
