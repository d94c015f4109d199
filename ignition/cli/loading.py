"""Loading a core for ``run`` and ``serve``: the shared options, LoadOptions, the load itself with its
stage log, the request checks against the manifest before loading, and ``--speculative``."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

import typer

from ignition.cli.checks import (RUNTIME_HELP, TRUST_COMPILED_HELP, TRUSTED_KEY_HELP, not_a_core_message,
                                 read_manifest, runtime_name, trusted_key)
from ignition.cli.console import StageLog, console
from ignition.cli.errors import CoreError, UsageError
from ignition.runtime.parallel.rendezvous import LOOPBACK
from ignition.serve.defaults import (GPU_MEMORY_UTILIZATION, KV_CACHE_MEMORY, KV_HOST_MEMORY, PREFIX_CACHING,
                                     STATE_SNAPSHOT_MEMORY)

DEVICE_OPTION = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda or cuda:N")
EAGER_OPTION = typer.Option(False, "--eager", help="CUDA: replay variants eagerly instead of as CUDA graphs")
PACK_LINEARS_OPTION = typer.Option(True, "--pack-linears/--no-pack-linears",
                                   help="CPU: run FP32 projections, and BF16 ones where the packed product keeps "
                                        "aten.linear's bits, on weights packed once for oneDNN (--no-pack-linears: "
                                        "torch's own aten.linear)")
DROP_FILE_CACHE_OPTION = typer.Option(True, "--drop-file-cache/--keep-file-cache",
                                      help="Drop the weights file's pages from the page cache as the loader reads "
                                           "them: its own copy is the one used (--keep-file-cache: a later load "
                                           "reads the file from the cache instead of the disk)")
BATCH_INVARIANT_OPTION = typer.Option(False, "--batch-invariant",
                                      help="Decode in the largest variant: results independent of co-batching")
TRUST_COMPILED_OPTION = typer.Option(False, "--trust-compiled", help=TRUST_COMPILED_HELP)
TRUSTED_KEY_OPTION = typer.Option(None, "--trusted-key", help=TRUSTED_KEY_HELP)
RUNTIME_OPTION = typer.Option("torch", "--runtime", callback=runtime_name, help=RUNTIME_HELP)
TENSOR_PARALLEL_OPTION = typer.Option(1, "--tensor-parallel", min=1, help="Ranks of a sharded core to start (gloo on "
                                      "CPU, NCCL on CUDA); this process is rank 0")
TP_HOST_OPTION = typer.Option(LOOPBACK, "--tp-host", help="Address the tensor-parallel store and ranks listen on "
                              "(loopback unless set; another one is warned about)")
SPECULATIVE_OPTION = typer.Option(None, "--speculative",
                                  help="Speculative decoding: ngram:S (prompt lookup) or draft:CORE:S (a draft core); "
                                  "mtp:S is refused (no core carries multi-token-prediction draft graphs)")


def _cache_option(option):
    """The typer option of a KV cache option (serve/defaults.py ``KV_CACHE_OPTIONS``)."""
    return typer.Option(option.default, option.flag, help=option.meaning.replace("`", "") +
                        f" (default: {option.shown_default})")


PREFIX_CACHING_OPTION = _cache_option(PREFIX_CACHING)
KV_CACHE_MEMORY_OPTION = _cache_option(KV_CACHE_MEMORY)
KV_HOST_MEMORY_OPTION = _cache_option(KV_HOST_MEMORY)
STATE_SNAPSHOT_MEMORY_OPTION = _cache_option(STATE_SNAPSHOT_MEMORY)
GPU_MEMORY_UTILIZATION_OPTION = _cache_option(GPU_MEMORY_UTILIZATION)



@dataclass(frozen=True)
class SharedOptions:
    """The options ``run`` and ``serve`` both take (``with_shared_options``), each field's default its typer
    option."""

    device: str = DEVICE_OPTION
    eager: bool = EAGER_OPTION
    pack_linears: bool = PACK_LINEARS_OPTION
    drop_file_cache: bool = DROP_FILE_CACHE_OPTION
    batch_invariant: bool = BATCH_INVARIANT_OPTION
    trust_compiled: bool = TRUST_COMPILED_OPTION
    trusted_key: Optional[Path] = TRUSTED_KEY_OPTION
    runtime: str = RUNTIME_OPTION
    tensor_parallel: int = TENSOR_PARALLEL_OPTION
    tp_host: str = TP_HOST_OPTION
    speculative: Optional[str] = SPECULATIVE_OPTION
    enable_prefix_caching: bool = PREFIX_CACHING_OPTION
    kv_cache_memory: Optional[int] = KV_CACHE_MEMORY_OPTION
    kv_host_memory: int = KV_HOST_MEMORY_OPTION
    state_snapshot_memory: int = STATE_SNAPSHOT_MEMORY_OPTION
    gpu_memory_utilization: Optional[float] = GPU_MEMORY_UTILIZATION_OPTION

    def load_options(self, core: Path):
        """LoadOptions for ``core``; --gpu-memory-utilization becomes a KV byte budget here (CUDA only)."""
        check_cache_options(self.kv_cache_memory, self.kv_host_memory, self.gpu_memory_utilization,
                            self.state_snapshot_memory)
        options = load_options(self.device, self.eager, self.trust_compiled, self.trusted_key, self.runtime,
                               self.tensor_parallel, self.tp_host, self.pack_linears, self.drop_file_cache,
                               self.kv_cache_memory, self.kv_host_memory)
        if self.gpu_memory_utilization is None or self.kv_cache_memory is not None:
            return options
        if not options.cuda:
            raise UsageError(f"--gpu-memory-utilization sizes the KV cache from a CUDA device's memory, and this load "
                             f"runs on {options.device}; give the KV cache's size as --kv-cache-memory BYTES")
        import torch

        from ignition.runtime.paging import kv_budget
        free, total = torch.cuda.mem_get_info(options.device)
        weights = sum(path.stat().st_size for path in core.glob("*.safetensors"))
        try:
            budget = kv_budget(self.gpu_memory_utilization, total, free, weights)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return replace(options, kv_cache_memory=budget)

    def engine_options(self, loaded) -> dict:
        """The Engine arguments of --speculative, --enable-prefix-caching and --state-snapshot-memory."""
        return speculative(self.speculative, loaded) | {"prefix_caching": self.enable_prefix_caching,
                                                        "state_snapshot_memory": self.state_snapshot_memory}


def check_cache_options(kv_cache_memory: Optional[int], kv_host_memory: int,
                        gpu_memory_utilization: Optional[float], state_snapshot_memory: int = 0) -> None:
    """The KV cache options' ranges, as usage errors naming the option."""
    if kv_cache_memory is not None and kv_cache_memory < 1:
        raise UsageError(f"--kv-cache-memory must be a positive number of bytes, got {kv_cache_memory}")
    if kv_host_memory < 0:
        raise UsageError(f"--kv-host-memory must be 0 (no host tier) or a positive number of bytes, got {kv_host_memory}")
    if state_snapshot_memory < 0:
        raise UsageError(f"--state-snapshot-memory must be 0 (no snapshots) or a positive number of bytes, got "
                         f"{state_snapshot_memory}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {gpu_memory_utilization}")


def with_shared_options(command):
    """``command`` as typer sees it: its own parameters, then ``SharedOptions``' fields as options; it is called
    with those gathered into its ``shared`` parameter."""
    own = [param for name, param in inspect.signature(command, eval_str=True).parameters.items() if name != "shared"]
    hints = inspect.get_annotations(SharedOptions, eval_str=True)
    added = [inspect.Parameter(item.name, inspect.Parameter.KEYWORD_ONLY, default=item.default,
                               annotation=hints[item.name]) for item in fields(SharedOptions)]

    @functools.wraps(command)
    def wrapper(**kwargs):
        shared = SharedOptions(**{item.name: kwargs.pop(item.name) for item in fields(SharedOptions)})
        return command(**kwargs, shared=shared)

    wrapper.__signature__ = inspect.Signature(own + added)
    return wrapper

def load_options(device: str, eager: bool, trust_compiled: bool, trusted_key_path: Optional[Path],
                 runtime: str = "torch", tensor_parallel: int = 1, tp_host: str = LOOPBACK, pack_linears: bool = True,
                 drop_file_cache: bool = True, kv_cache_memory: Optional[int] = None, kv_host_memory: int = 0):
    """The one LoadOptions of run and serve, validated before anything loads; a choice that cannot work here
    (--device, --runtime, --tensor-parallel, --trusted-key) is a usage error naming it."""
    from ignition.runtime.options import LoadOptions
    from ignition.runtime.verified import LoadOptionError

    try:
        return LoadOptions.create(device, runtime, tensor_parallel, eager=eager, trust_compiled=trust_compiled,
                                  trusted_key=trusted_key(trusted_key_path), tp_host=tp_host,
                                  pack_linears=pack_linears, drop_file_cache=drop_file_cache,
                                  kv_cache_memory=kv_cache_memory, kv_host_memory=kv_host_memory)
    except LoadOptionError as exc:
        raise UsageError(str(exc)) from None


def load(core: Path, options):
    """load_core for run and serve, its stages on stderr and a last line with the seconds of each; a
    core that cannot load is a CoreError (a path that is no core at all: a UsageError). With
    ``options.ranks`` > 1 the other ranks start too and stop when this process exits
    (ignition/runtime/parallel/group.py)."""
    from ignition.runtime.core import CoreLoadError, LoadOptionError, NotACoreError, load_core
    from ignition.runtime.parallel.group import ParallelError, ParallelOptionError, start_for_process
    from ignition.runtime.parallel.rendezvous import torchrun_follower

    if options.ranks > 1 and torchrun_follower():  # a torchrun rank >= 1 replays rank 0's submissions, then exits
        from ignition.runtime.parallel.rank_worker import torchrun_worker
        raise typer.Exit(torchrun_worker(core, options))
    try:
        with StageLog("load") as progress:
            if options.ranks > 1:
                loaded = start_for_process(core, options)
            else:
                loaded = load_core(core, options, progress=progress)
    except NotACoreError as exc:
        raise UsageError(not_a_core_message(exc, core)) from None
    except (LoadOptionError, ParallelOptionError) as exc:  # --device, --runtime or --tensor-parallel that cannot work
        raise UsageError(str(exc)) from None
    except ParallelError as exc:
        raise CoreError(str(exc)) from None
    except CoreLoadError as exc:
        raise CoreError(str(exc), label="cannot load core") from None
    stages = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in loaded.timings.items())
    pool = getattr(loaded, "kv_pool", None)  # a tensor-parallel rank group has none of its own
    kv = f"; KV capacity {pool.capacity_tokens:,} tokens ({pool.num_blocks:,} blocks of {pool.block_size})" \
        if pool is not None and pool.paged else ""
    console.print(f"loaded {core} on {loaded.device} in {loaded.load_seconds:.2f} s ({stages}){kv}",
                  markup=False, highlight=False, soft_wrap=True)
    return loaded


def check_run_options(core: Path, request, text_prompt: bool) -> None:
    """``run``'s request against the core's manifest, before loading: logprob options beyond the core's K
    or features, and (with --prompt-ids) the whole admission check; a usage error naming the option."""
    from ignition.runtime.requests import AdmissionError, check_admission, check_options

    spec = read_manifest(core)
    if spec is None:
        return  # loading reports what is wrong with the core
    if text_prompt and spec.tokenizer is None:
        raise UsageError("this core has no tokenizer; pass --prompt-ids")
    try:
        if text_prompt:
            check_options(request, spec)
        else:
            check_admission(request, spec, spec.model.max_seq_len)
    except AdmissionError as exc:
        option = "--" + {"prompt": "prompt_ids"}.get(exc.param, exc.param).replace("_", "-")
        raise UsageError(f"{option}: {exc}") from None


def check_speculative(text: Optional[str]) -> None:
    """--speculative's syntax, before anything loads."""
    from ignition.runtime.drafters import SpeculativeError, parse_speculative

    if text is not None:
        try:
            parse_speculative(text)
        except SpeculativeError as exc:
            raise UsageError(str(exc)) from None


def speculative(text: Optional[str], loaded) -> dict:
    """Engine options for --speculative; a bad option or draft core is a usage error (a draft core that cannot
    load: a CoreError). ``--trust-compiled`` names the target core only: a draft core's compiled packages load
    only when its own signature verifies against ``--trusted-key``."""
    from ignition.runtime.drafters import SpeculativeError, engine_options, parse_speculative

    try:
        speculation = parse_speculative(text) if text is not None else None
        return engine_options(speculation, loaded, lambda path: load(path, loaded.options.for_draft()))
    except SpeculativeError as exc:
        raise UsageError(str(exc)) from None

