"""The prepared launcher's exact driver calls, executed on the CPU by an emulated CUDA driver.

Started in a subprocess by tests/test_launcher_emulation.py with TRITON_INTERPRET=1 (the
interpreter must be set before Triton is imported). ``PreparedReduction`` is loaded from a
real core's kernel table and called as the CUDA op would call it; the emulated driver
identifies each cubin it is handed by content, decodes the ``cuLaunchKernel`` parameter
array by the kernel table's signature, checks grid, threads, shared memory and the null
scratch pointers, and runs the named kernel in Triton's interpreter on the tensors those
pointers address. The packed output must equal the reference's, word for word.

A sharded core (``--tensor-parallel N``) loads one ``PreparedVocabulary`` per simulated rank (each its
own workspace, as each rank is its own process) and runs the three stage ops with the all-gathers
emulated by concatenation (``run_sharded_case``): exchange 1 must equal the reference's except the
mass word (tile-wise sum, within MASS_TOLERANCE), exchange 2 and the packed output exactly, each
stage fed the reference's gathered exchanges.

A scoring directory (``--scoring DIR``: manifest.json, catalog.json and kernels.json of the smallest
sharded scored core, built by tests/test_triton_vocabulary.py from the export's own plan, with only
the scoring launches compiled) loads one ``PreparedVocabulary`` per rank without generation shapes
and runs its ``scoring`` stage ops the same way (``run_scoring_case``).

Cores side by side (``--cores DIR...``, ``emulate_cores``): every core is loaded in one process, each prepared
one gets its own launcher (``load_launcher``) bound to its own variants (``launcher.bound``), and the CPU replay
of ``ignition::reduce_logprobs`` takes the CUDA op's path (``device_reduction``), so each core's exported graphs
reach the launcher bound to them. The cores then generate in turn, a core without logprobs in between and one
core on a fresh thread: every launch must come from the modules of the running core's own launcher, on a thread
with the primary context current, and every result must equal the plain CPU replay's.

    python tests/_launcher_emulation.py CORE_DIR  -> prints one JSON object {case: [problems]}
    python tests/_launcher_emulation.py --scoring DIR
    python tests/_launcher_emulation.py --cores DIR DIR ...
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
import threading
from pathlib import Path

import torch

from ignition.catalog.contract import MAX_SELECTED_IDS, SCRATCH_POINTERS, packed_width
from ignition.catalog.manifest import Manifest
from ignition.components import triton_logprobs as T
from ignition.components import triton_scoring as TS
from ignition.components import triton_vocabulary as TV
from ignition.components import vocabulary_logprobs as V
from ignition.components.logprobs import reduce_logprobs_reference
from ignition.runtime.launchers.reduction import PreparedReduction, load_launcher

KERNELS = {k.fn.__name__: k for k in (T.tile_stats_kernel, T.row_normalization_kernel, T.tile_candidates_kernel,
                                      T.merge_kernel, TV.shard_statistics_kernel, TV.global_normalization_kernel,
                                      TV.shard_candidates_kernel, TV.merge_shards_kernel, TS.score_statistics_kernel,
                                      TS.score_normalization_kernel, TS.tile_greater_kernel,
                                      TS.score_candidates_kernel, TS.score_merge_kernel)}
POINTER_DTYPES = {"*i32": torch.int32, "*i64": torch.int64, "*fp32": torch.float32, "*bf16": torch.bfloat16,
                  "*fp16": torch.float16}
MASS_TOLERANCE = 2.0**-18


class EmulatedModule:
    """A loaded module (and its function): the table entries of its binary."""

    def __init__(self, entries: list[dict]):
        self.entries = entries


class EmulatedDriver:
    """The slice of ``cuda.bindings.driver`` the launcher uses; launches run in the interpreter.

    Contexts are per thread, as the driver's are: a thread starts with none current, the primary context
    (handle ``PRIMARY``) is current only where ``cuCtxSetCurrent`` bound it, and a module load or a launch
    on a thread without it is recorded as a problem (CUDA_ERROR_INVALID_CONTEXT on a GPU)."""

    PRIMARY = 0xC0

    class CUresult:
        CUDA_SUCCESS = 0

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self, core: Path, table: dict, *others: tuple[Path, dict]):
        """Identifies the binaries of ``table`` under ``core``, and of each (core, table) of ``others``: one
        driver per process, whatever the cores it loads."""
        self.binaries = {}
        for root, kernels in ((core, table), *others):
            for entry in kernels["kernels"]:
                self.binaries.setdefault((root / entry["file"]).read_bytes(), []).append(entry)
        self.tensors: dict[int, torch.Tensor] = {}
        self.problems: list[str] = []
        self.launched: list[str] = []
        self.launched_modules: list[EmulatedModule] = []  # the module of each launch: which load it came from
        self.retained = 0  # primary-context references held
        self._thread = threading.local()

    def CUstream(self, handle):  # noqa: N802 - the driver's name
        return handle

    def cuGetErrorName(self, error):  # noqa: N802
        return 0, b"EMULATED_ERROR"

    def cuInit(self, flags):  # noqa: N802
        return (0,)

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return 0, ordinal

    def cuDevicePrimaryCtxRetain(self, device):  # noqa: N802
        self.retained += 1
        return 0, self.PRIMARY

    def cuDevicePrimaryCtxRelease(self, device):  # noqa: N802
        self.retained -= 1
        return (0,)

    def cuCtxGetCurrent(self):  # noqa: N802
        return 0, getattr(self._thread, "context", 0)

    def cuCtxSetCurrent(self, context):  # noqa: N802
        self._thread.context = int(context)
        return (0,)

    def _needs_context(self, call: str) -> None:
        if getattr(self._thread, "context", 0) != self.PRIMARY:
            self.problems.append(f"{call} on thread {threading.current_thread().name} without the primary context "
                                 f"current (CUDA_ERROR_INVALID_CONTEXT)")

    def cuModuleLoadData(self, address: int):  # noqa: N802
        self._needs_context("cuModuleLoadData")
        header = ctypes.string_at(address, 64)
        shoff, = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        prefix = ctypes.string_at(address, shoff + shentsize * shnum)  # within every ELF image
        matches = [entries for binary, entries in self.binaries.items() if binary.startswith(prefix)]
        if len(matches) != 1:
            raise AssertionError(f"module image matches {len(matches)} prepared cubins")
        return 0, EmulatedModule(matches[0])  # a new handle per load, as the driver's

    def cuModuleGetFunction(self, module, name: bytes):  # noqa: N802
        if any(entry["kernel_name"] != name.decode() for entry in module.entries):
            raise AssertionError(f"function {name!r} is not the module's kernel")
        return 0, module  # every table entry of this binary: they differ only in grid

    def cuFuncSetAttribute(self, function, attribute, value):  # noqa: N802
        return (0,)

    def cuLaunchKernel(self, module, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # noqa: N802
        self._needs_context("cuLaunchKernel")
        self.launched_modules.append(module)
        entries = module.entries
        padded = [tuple(e["grid"]) + (1,) * (3 - len(e["grid"])) for e in entries]
        if (gx, gy, gz) not in padded:
            self.problems.append(f"{entries[0]['name']}: grid {(gx, gy, gz)} is none of the table's {padded}")
            return (0,)
        entry = entries[padded.index((gx, gy, gz))]
        runtime = [p for p in entry["signature"] if p["type"] != "constexpr"]
        slots = (ctypes.c_void_p * (len(runtime) + SCRATCH_POINTERS)).from_address(params)
        args = {}
        for index, param in enumerate(runtime):
            if param["type"].startswith("*"):
                pointer = ctypes.c_void_p.from_address(slots[index]).value
                if pointer is not None and pointer % param.get("divisibility", 1):
                    self.problems.append(f"{entry['name']}: {param['name']} = {pointer:#x} breaks the binary's "
                                         f"divisibility {param['divisibility']}")
                if pointer not in self.tensors:
                    self.problems.append(f"{entry['name']}: {param['name']} = {pointer:#x} addresses no known tensor")
                    return (0,)
                tensor = self.tensors[pointer]  # viewed as the parameter's type (exchanges are fp32 words)
                args[param["name"]] = tensor.view(POINTER_DTYPES[param["type"]])
            else:
                args[param["name"]] = ctypes.c_int32.from_address(slots[index]).value
        scratch = [ctypes.c_void_p.from_address(slots[len(runtime) + i]).value for i in range(SCRATCH_POINTERS)]
        grid = tuple(entry["grid"]) + (1,) * (3 - len(entry["grid"]))
        expected = (grid, (entry["num_warps"] * 32, 1, 1), entry["shared_bytes"], [None] * SCRATCH_POINTERS, 0)
        found = ((gx, gy, gz), (bx, by, bz), shared, scratch, extra)
        if found != expected:
            self.problems.append(f"{entry['name']}: launched with {found}, expected {expected}")
        KERNELS[entry["kernel_name"]][tuple(entry["grid"])](**args, **entry["constexprs"],
                                                           num_warps=entry["num_warps"], num_stages=entry["num_stages"])
        self.launched.append(entry["name"])
        return (0,)


def run_case(launcher: PreparedReduction, driver: EmulatedDriver, rows: int, chosen_dtype, seed: int) -> list[str]:
    shape = next(s for s in launcher.launches if s.rows == rows)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, shape.vocab_padded, generator=g) * 3
    logits[:, shape.vocab_size:] = 1e4  # padded lanes hold huge values: they must never enter
    logits[0, :40] = logits[0, 40]  # ties at the top of row 0
    chosen = torch.randint(0, shape.vocab_size, (rows,), generator=g)
    chosen = torch.stack([chosen, -chosen], 1)[:, 0] if chosen_dtype == "strided" else chosen.to(chosen_dtype)
    requested = (torch.arange(rows) % 3 != 2).to(torch.int32)
    requested[0] = 1
    token_ids = torch.randint(-2, shape.vocab_size + 3, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32)
    counts = torch.where(torch.arange(rows) % 2 == 1, torch.arange(rows) * 7 % 129, 0).to(torch.int32)
    width = packed_width(shape.k, True)
    outs = {name: torch.full((2, rows, 3, width), 0x5A5A5A5A, dtype=torch.int32) for name in ("launcher", "reference")}
    out_rows = torch.arange(rows, dtype=torch.int64) * 3 + rows * 3  # frame 1, position 0 of each lane
    workspace = launcher.workspaces[shape]
    driver.tensors = {t.data_ptr(): t for t in (logits, chosen, requested, token_ids, counts, outs["launcher"],
                                                out_rows, *workspace.tensors())}
    launcher(logits, chosen, requested, outs["launcher"], out_rows, token_ids, counts, shape.vocab_size, shape.k)
    reduce_logprobs_reference(logits, chosen, requested, outs["reference"], out_rows, token_ids, counts,
                              shape.vocab_size, shape.k)
    problems = list(driver.problems)
    if not torch.equal(outs["launcher"], outs["reference"]):
        diff = (outs["launcher"] != outs["reference"]).nonzero()[:5].tolist()
        problems.append(f"packed words differ from the reference at {diff}")
    if not (outs["launcher"][0] == 0x5A5A5A5A).all():
        problems.append("the launcher wrote outside the addressed frame")
    return problems


def run_sharded_case(launchers: list, driver: EmulatedDriver, shape, seed: int) -> list[str]:
    """Every rank's stage ops through its launcher, fed the reference's gathered exchanges."""
    ranks, rows, width = shape.ranks, shape.rows, shape.vocab_shard
    vocab_size = launchers[0].vocab_size
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, ranks * width, generator=g) * 3
    logits[:, vocab_size:] = 1e4  # padded lanes hold huge values: they must never enter
    logits[0, :40] = logits[0, 40]  # ties at the top of row 0, across the shards of a small vocabulary
    logits = logits.to(getattr(torch, shape.logits_dtype))
    parts = [logits[:, r * width:(r + 1) * width].contiguous() for r in range(ranks)]
    chosen = torch.randint(0, vocab_size, (rows,), generator=g, dtype=torch.int32)  # int32: the launcher widens
    requested = torch.ones(rows, dtype=torch.int32)
    token_ids = counts = None
    if shape.explicit_ids:
        token_ids = torch.randint(-2, vocab_size + 3, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32)
        counts = torch.where(torch.arange(rows) % 2 == 1, torch.arange(rows) * 7 % 129 + 1, 0).to(torch.int32)
    width_out = packed_width(shape.k, shape.explicit_ids)
    outs = {name: torch.full((2, rows, width_out), 0x5A5A5A5A, dtype=torch.int32) for name in ("launcher", "reference")}
    out_rows = torch.arange(rows, dtype=torch.int64) + rows  # frame 1
    stats = torch.cat([V.shard_statistics(x, requested, r * width, vocab_size) for r, x in enumerate(parts)])
    cands = torch.cat([V.shard_candidates(x, stats, chosen, requested, token_ids, counts, r * width, vocab_size)
                       for r, x in enumerate(parts)])
    V.merge_vocabulary_logprobs(stats, cands, chosen, requested, outs["reference"], out_rows, token_ids, counts,
                                vocab_size, width, shape.k)
    known = [logits, *parts, chosen, requested, token_ids, counts, outs["launcher"], out_rows, stats, cands]
    for launcher in launchers:
        known += list(launcher.workspaces[(rows, width)].tensors())
    driver.tensors = {t.data_ptr(): t for t in known if t is not None}
    problems = []
    for r, (launcher, x) in enumerate(zip(launchers, parts)):
        got = launcher.statistics(x, requested, r * width, vocab_size).view(torch.int32)
        want = stats[r * rows:(r + 1) * rows].view(torch.int32)
        mass, expected = got[:, 1].view(torch.float32), want[:, 1].view(torch.float32)
        if not torch.equal(torch.cat([got[:, :1], got[:, 2:]], 1), torch.cat([want[:, :1], want[:, 2:]], 1)) \
                or not ((mass - expected).abs() <= MASS_TOLERANCE * expected.abs()).all():
            problems.append(f"rank {r}: exchange 1 differs from the reference")
        got = launcher.candidates(x, stats, chosen, requested, token_ids, counts, r * width, vocab_size)
        if not torch.equal(got.view(torch.int32), cands[r * rows:(r + 1) * rows].view(torch.int32)):
            problems.append(f"rank {r}: exchange 2 differs from the reference")
    launchers[-1].merge(stats, cands, chosen, requested, outs["launcher"], out_rows, token_ids, counts, vocab_size,
                        width, shape.k)
    if not torch.equal(outs["launcher"], outs["reference"]):
        diff = (outs["launcher"] != outs["reference"]).nonzero()[:5].tolist()
        problems.append(f"packed words differ from the reference at {diff}")
    return list(driver.problems) + problems


def _register_exchanges(launcher, driver: EmulatedDriver) -> None:
    """The launcher's exchange outputs are fresh tensors: make their addresses known to the emulated driver."""
    allocate = launcher.new_exchange

    def new_exchange(rows, device):
        tensor = allocate(rows, device)
        driver.tensors[tensor.data_ptr()] = tensor
        return tensor
    launcher.new_exchange = new_exchange


def emulate(core: Path) -> dict[str, list[str]]:
    """{case: [problems]} for every reduction shape of the core (single-rank or sharded)."""
    manifest = json.loads((core / "manifest.json").read_text())
    catalog = json.loads((core / manifest["catalog"]).read_text())
    table = json.loads((core / manifest["kernels"]).read_text())
    driver = EmulatedDriver(core, table)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    results = {}
    if "tensor_parallel" in manifest:
        ranks = manifest["tensor_parallel"]["ranks"]
        launchers = [load_launcher(core, Manifest.from_json(manifest), catalog, table, torch.device("cpu"), driver=driver)
                     for _ in range(ranks)]  # one process per rank: one workspace each
        for launcher in launchers:
            launcher.current_stream = lambda: 0
            launcher.vocab_size = manifest["vocab_size"]
            _register_exchanges(launcher, driver)
        from _triton_vocabulary_check import _numpy_normalization  # the interpreter's expf/logf (see there)
        V.global_normalization = _numpy_normalization
        for shape in sorted(launchers[0].shapes, key=str):
            driver.problems = []
            results[f"sharded-rows{shape.rows}-k{shape.k}"] = run_sharded_case(launchers, driver, shape, shape.rows)
        if launchers[0].scoring.shapes:  # a scored core: its scoring row blocks too
            for launcher in launchers:
                _register_exchanges(launcher.scoring, driver)
            for shape in sorted(launchers[0].scoring.shapes, key=str):
                driver.problems = []
                results[f"scoring-rows{shape.rows}"] = run_scoring_case(launchers, driver, shape,
                                                                        manifest["vocab_size"], shape.rows)
        issued = sum(launcher.launch_count for launcher in launchers)
        results["launches"] = [] if issued == len(driver.launched) else [
            f"launch_count {issued} != {len(driver.launched)} emulated launches"]
        return results
    launcher = load_launcher(core, Manifest.from_json(manifest), catalog, table, torch.device("cpu"), driver=driver)
    launcher.current_stream = lambda: 0
    for rows in sorted({s.rows for s in launcher.launches}):
        for dtype in (torch.int64, torch.int32, "strided"):  # strided: a column view of the records
            driver.problems = []
            results[f"rows{rows}-{str(dtype).removeprefix('torch.')}"] = run_case(launcher, driver, rows, dtype, rows)
    results["launches"] = [] if launcher.launch_count == len(driver.launched) else [
        f"launch_count {launcher.launch_count} != {len(driver.launched)} emulated launches"]
    return results


def run_scoring_case(launchers: list, driver: EmulatedDriver, shape, vocab_size: int, seed: int) -> list[str]:
    """Every rank's scoring stage ops through its launcher, fed the reference's gathered exchanges."""
    ranks, rows, width = shape.ranks, shape.rows, shape.vocab_shard
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, ranks * width, generator=g) * 3
    logits[:, vocab_size:] = 1e4  # padded lanes hold huge values: they must never enter
    logits[0, :40] = logits[0, 40]  # ties at the top of row 0
    logits = logits.to(getattr(torch, shape.logits_dtype))
    parts = [logits[:, r * width:(r + 1) * width].contiguous() for r in range(ranks)]
    targets = (torch.arange(rows, dtype=torch.int32) * 389 + 7) % vocab_size  # owners alternate
    targets[-1], targets[rows // 2] = -1, vocab_size  # invalid: the prompt's end, past the vocabulary
    outs = {name: torch.full((2, rows, 43), 0x5A5A5A5A, dtype=torch.int32) for name in ("launcher", "reference")}
    out_rows = torch.arange(rows, dtype=torch.int64) + rows  # frame 1
    stats = torch.cat([V.score_shard_statistics(x, targets, r * width, vocab_size) for r, x in enumerate(parts)])
    cands = torch.cat([V.score_shard_candidates(x, stats, targets, r * width, vocab_size) for r, x in enumerate(parts)])
    V.merge_prompt_scores(stats, cands, targets, outs["reference"], out_rows, vocab_size, width)
    known = [logits, *parts, targets, outs["launcher"], out_rows, stats, cands]
    for launcher in launchers:
        known += list(launcher.scoring.workspaces[(rows, width)].tensors())
    driver.tensors = {t.data_ptr(): t for t in known}
    problems = []
    for r, (launcher, x) in enumerate(zip(launchers, parts)):
        got, want = launcher.scoring.statistics(x, targets, r * width, vocab_size), stats[r * rows:(r + 1) * rows]
        mass, expected = got[:, 1].view(torch.float32), want[:, 1].view(torch.float32)
        if not torch.equal(torch.cat([got[:, :1], got[:, 2:]], 1), torch.cat([want[:, :1], want[:, 2:]], 1)) \
                or not ((mass - expected).abs() <= MASS_TOLERANCE * expected.abs()).all():
            problems.append(f"rank {r}: scoring exchange 1 differs from the reference")
        got = launcher.scoring.candidates(x, stats, targets, r * width, vocab_size)
        if not torch.equal(got, cands[r * rows:(r + 1) * rows]):
            problems.append(f"rank {r}: scoring exchange 2 differs from the reference")
    launchers[0].scoring.merge(stats, cands, targets, outs["launcher"], out_rows, vocab_size, width)
    if not torch.equal(outs["launcher"], outs["reference"]):
        diff = (outs["launcher"] != outs["reference"]).nonzero()[:5].tolist()
        problems.append(f"prompt rows differ from the reference at {diff}")
    return list(driver.problems) + problems


def emulate_scoring(root: Path) -> dict[str, list[str]]:
    """{case: [problems]} for every scoring row block of the directory's scored variants, one launcher per rank."""
    from _triton_vocabulary_check import _numpy_normalization  # the interpreter's expf/logf (see there)
    from ignition.runtime.launchers.vocabulary import PreparedVocabulary, scoring_shapes

    V.global_normalization = _numpy_normalization
    manifest, catalog, table = (json.loads((root / f"{name}.json").read_text())
                                for name in ("manifest", "catalog", "kernels"))
    driver = EmulatedDriver(root, table)
    shapes = scoring_shapes(Manifest.from_json(manifest), catalog)
    launchers = [PreparedVocabulary.load(root, Manifest.from_json(manifest), table, {}, torch.device("cpu"), "cuda:90", driver, shapes)
                 for _ in range(manifest["tensor_parallel"]["ranks"])]
    for launcher in launchers:
        launcher.current_stream = lambda: 0
        _register_exchanges(launcher.scoring, driver)
    results = {}
    for shape in sorted(shapes, key=str):
        driver.problems = []
        results[f"scoring-rows{shape.rows}"] = run_scoring_case(launchers, driver, shape, manifest["vocab_size"],
                                                                shape.rows)
    issued = sum(launcher.launch_count for launcher in launchers)
    results["launches"] = [] if issued == len(driver.launched) else [
        f"launch_count {issued} != {len(driver.launched)} emulated launches"]
    return results


CORE_REQUESTS = [dict(prompt_ids=[1, 2, 3], max_tokens=3, logprobs=5, ignore_eos=True),
                 dict(prompt_ids=[9, 8], max_tokens=2, logprob_token_ids=[0, 7, 3], ignore_eos=True),
                 dict(prompt_ids=[4], max_tokens=2, ignore_eos=True)]


def _generated(core) -> list:
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    plain = not core.features["allow_logprobs"]  # a core without logprobs serves the requests without them
    requests = [{k: v for k, v in r.items() if not (plain and k.startswith("logprob"))} for r in CORE_REQUESTS]
    results = Engine(core).generate([Request(**request) for request in requests])
    return [(r.error, r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries]) for r in results]


VALUE_TOLERANCE = 1e-5  # the interpreter's expf/logf are numpy's, not torch's: values may differ by an ulp or so


def _same_results(got: list, want: list) -> bool:
    """Errors, token ids and every reported id identical; every reported value within VALUE_TOLERANCE."""
    def ids(results):
        return [(error, tokens, [(i, [t for t, _ in top]) for i, _, top in entries])
                for error, tokens, entries in results]

    def values(results):
        return [v for _, _, entries in results for _, value, top in entries for v in [value] + [x for _, x in top]]
    return ids(got) == ids(want) and all(a == b or a is not None and b is not None and abs(a - b) <= VALUE_TOLERANCE
                                         for a, b in zip(values(got), values(want)))


def emulate_cores(roots: list[Path]) -> dict[str, list[str]]:
    """{check: [problems]} for cores loaded side by side, each prepared one with its own launcher."""
    import threading

    from ignition.components import device_reduction as D
    from ignition.components.logprobs import reduce_logprobs_op
    from ignition.runtime.core import load_core

    tables = {}
    for root in roots:
        manifest = json.loads((root / "manifest.json").read_text())
        tables[root] = (manifest, json.loads((root / manifest["catalog"]).read_text()),
                        json.loads((root / manifest["kernels"]).read_text()) if manifest["kernels"] else None)
    prepared = [(root, table) for root, (_, _, table) in tables.items() if table is not None]
    driver = EmulatedDriver(*prepared[0], *prepared[1:])
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    cores, launchers, expected = {}, {}, {}
    for root in roots:  # the plain CPU replay first: the oracle
        cores[root.name] = load_core(root)
        expected[root.name] = _generated(cores[root.name])
    reduce_logprobs_op.register_kernel("cpu")(D._reduce_on_device)  # from here on, the CUDA op's path
    for root in roots:  # all loaded before any runs: a later load must not displace an earlier core's launcher
        manifest, catalog, table = tables[root]
        launcher = load_launcher(root, Manifest.from_json(manifest), catalog, table, torch.device("cpu"), driver=driver)
        launchers[root.name] = launcher
        if launcher is None:
            continue
        launcher.current_stream = lambda: 0
        launch = launcher.launch

        def registering(launches, args, launch=launch):  # the emulator resolves each pointer to its tensor
            driver.tensors.update({v.data_ptr(): v for v in args.values() if isinstance(v, torch.Tensor)})
            return launch(launches, args)
        launcher.launch = registering
        for variant in cores[root.name].variants.values():
            variant.run = launcher.bound(variant.run)
    results = {}
    order = [root.name for root in roots] + [roots[0].name]
    for index, name in enumerate(order):
        launcher, before, issued = launchers[name], len(driver.launched_modules), {}
        counts = {other: (x.launch_count if x else 0) for other, x in launchers.items()}
        if index == len(order) - 1:  # the first core again, from a thread that has never touched the driver
            thread = threading.Thread(target=lambda: issued.setdefault("got", _generated(cores[name])), name="engine")
            thread.start()
            thread.join()
            got = issued["got"]
        else:
            got = _generated(cores[name])
        problems = [] if _same_results(got, expected[name]) else [f"{name}: results differ from the CPU replay"]
        ran = driver.launched_modules[before:]
        own = [] if launcher is None else launcher.table.modules
        if launcher is not None and not ran:
            problems.append(f"{name}: no prepared launch ran")
        if any(not any(module is mine for mine in own) for module in ran):
            problems.append(f"{name}: launched modules of another core's launcher")
        grown = {other: (x.launch_count if x else 0) - counts[other] for other, x in launchers.items()}
        if any(n for other, n in grown.items() if other != name) or (launcher and grown[name] != len(ran)):
            problems.append(f"{name}: launch counts moved {grown}, the driver saw {len(ran)} launches")
        results[f"run{index}-{name}"] = problems
    results["driver"] = list(driver.problems)
    probe = threading.Thread(target=lambda: driver._needs_context("probe"), name="bare")
    probe.start()
    probe.join()  # the emulator does refuse a thread without the context: the runs above were checked
    results["probe"] = [] if driver.problems[-1:] and "thread bare" in driver.problems[-1] else ["no refusal"]
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--scoring":
        print(json.dumps(emulate_scoring(Path(sys.argv[2]))))
    elif sys.argv[1] == "--cores":
        print(json.dumps(emulate_cores([Path(arg) for arg in sys.argv[2:]])))
    else:
        print(json.dumps(emulate(Path(sys.argv[1]))))
