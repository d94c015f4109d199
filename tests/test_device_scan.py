"""The device-scan proof (issue 25, GPU defect 1): a program moved for a device names no other device anywhere.

``torch.export`` burns the capture device into every graph (``arange(device=cpu)``, ``zeros(device=cpu)``,
``_assert_tensor_metadata(device=cpu)``), and routed experts are ``cond`` branches, graph modules of their own.
The toy core and tiny dense and MoE cores are exported and every variant moved to ``meta`` (shapes only, no GPU
needed): before the move the scan finds the capture device in graphs, generated code and branches; after it,
neither the program nor the module that runs (every submodule's graph and ``GraphModule.code``) names anything
but the target. A planted ``arange(device='cpu')`` is caught in a branch's graph and in stale generated code,
and re-materialization rewrites one. The reduction's arguments in every core meet the 16-byte alignment the
prepared binaries are compiled for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ignition.catalog.contract import POINTER_DIVISIBILITY
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime import device as D
from ignition.runtime.device import foreign_devices, graph_modules, move_program
from ignition.validate.graphs import read_graph

META, CPU = torch.device("meta"), torch.device("cpu")


@pytest.fixture(scope="module")
def cores(tmp_path_factory, toy_core, moe_cores) -> dict[str, Path]:
    """The toy core, a tiny dense qwen3 core exported here, and the session's MoE cores (tests/conftest.py
    ``moe_cores``: qwen3_moe and deepseek_v3, which test_moe_recipes.py checks against transformers); all but the toy
    with decode capacity 2 and prompt scoring."""
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("scan")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 96), root / "ckpt-qwen3", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt-qwen3", capacities=(2,), chunk_limit=16,
                              max_seq_len=32, prompt_logprobs=True), root / "qwen3")
    return {"toy": toy_core, "qwen3": root / "qwen3"} | {recipe: core for recipe, (_, core) in moe_cores.items()}


def _programs(core: Path, entries: bool = False):
    """Each variant's program as the loader reads it (``read_graph``: the program reader, which the ``.pt2``
    backend moves to its device), not ``torch.export.load``'s."""
    catalog = json.loads((core / "catalog.json").read_text())
    for entry in catalog["variants"]:
        problems, program = read_graph(core / entry["graph"], entry)
        assert program is not None and problems == [], problems
        yield entry["name"], program, *((entry,) if entries else ())


def _meta_buffers(core: Path, entry: dict) -> dict[str, torch.Tensor]:
    from ignition.catalog.model import BufferDecl

    manifest = json.loads((core / "manifest.json").read_text())
    state = {d["name"]: BufferDecl.from_json(d).empty(META) for d in manifest["state"]}
    return {a["name"]: state[a["name"]] if a["role"] == "state" else BufferDecl.from_json(a).empty(META)
            for a in entry["arguments"]}


def _moe_program(cores, exported: bool = False):
    """The MoE core's first program: the loader's, or ``torch.export.load``'s (``move_program`` takes both)."""
    if exported:
        entry = json.loads((cores["qwen3_moe"] / "catalog.json").read_text())["variants"][0]
        return torch.export.load(cores["qwen3_moe"] / entry["graph"])
    return next(program for _, program in _programs(cores["qwen3_moe"]))


def test_moved_programs_name_no_other_device_in_any_graph_or_code(cores):
    """And the dense ones run there (meta: shapes only; routed experts read a predicate on the host, which a meta
    tensor has not)."""
    branches = 0
    for name, core in cores.items():
        for variant, program, entry in _programs(core, entries=True):
            before = foreign_devices(program, META)
            assert any("generated code names device(type='cpu')" in f for f in before), (name, variant)
            assert any("aten.arange" in f or "aten.zeros" in f for f in before), (name, variant)
            move_program(program, META)
            assert foreign_devices(program, META) == [], (name, variant)
            runnable = program.module()
            modules = dict(graph_modules(runnable))
            assert foreign_devices(runnable, META) == [], (name, variant)
            assert all("cpu" not in module.code for module in modules.values()), (name, variant)
            branches += len(modules) - 1
            if len(modules) == 1:
                runnable(_meta_buffers(core, entry))
    assert branches > 0, "the MoE cores' cond branches must be among the scanned modules"


def test_the_scan_sees_inside_branches_before_the_move(cores):
    found = foreign_devices(_moe_program(cores), META)
    assert any(f.startswith("true_graph") and "names cpu" in f for f in found)
    assert any(f.startswith("true_graph") and "generated code names" in f for f in found)


def _branch(module: torch.nn.Module) -> torch.fx.GraphModule:
    return next(m for name, m in graph_modules(module) if name != "<root>")


def _plant_arange(branch: torch.fx.GraphModule, device) -> torch.fx.Node:
    output = next(n for n in branch.graph.nodes if n.op == "output")
    with branch.graph.inserting_before(output):
        return branch.graph.call_function(torch.ops.aten.arange.default, (4,), {"device": device})


def test_a_planted_cpu_arange_is_caught_in_the_graph_and_in_stale_code(cores):
    program = move_program(_moe_program(cores), META)
    runnable = program.module()
    branch = _branch(runnable)
    node = _plant_arange(branch, CPU)
    branch.recompile()
    found = foreign_devices(runnable, META)
    assert any("names cpu" in f and "arange" in f for f in found), found
    assert any("generated code names device(type='cpu')" in f for f in found), found
    branch.graph.erase_node(node)  # the graph is clean again, but its code was not regenerated
    assert [f for f in foreign_devices(runnable, META) if "generated code" in f], "stale code must be caught"


def test_rematerializing_rewrites_a_planted_device_anywhere(cores):
    program = _moe_program(cores)
    branch = _branch(program.graph_module)
    _plant_arange(branch, CPU)
    output = next(n for n in branch.graph.nodes if n.op == "output")
    placeholder = next(n for n in branch.graph.nodes if n.op == "placeholder")
    with branch.graph.inserting_before(output):  # a positional Device argument, found by the op's schema
        branch.graph.call_function(torch.ops.aten.to.device, (placeholder, "cpu", torch.float32))
    branch.recompile()
    move_program(program, META)
    assert foreign_devices(program, META) == [] and foreign_devices(program.module(), META) == []


def test_a_program_left_on_another_device_is_refused(cores, monkeypatch):
    monkeypatch.setattr(D, "retarget_graphs", lambda root, device: None)
    with pytest.raises(ValueError, match=r"still refers to other devices: node arange \(aten\.arange"):
        move_program(_moe_program(cores), META)  # the loader's program: nothing else rewrites its nodes
    with pytest.raises(ValueError, match=r"still refers to other devices: .*generated code names"):
        move_program(_moe_program(cores, exported=True), META)  # torch's pass alone misses the code


class PointerAlignment(TorchDispatchMode):
    """The tensor arguments of every prepared-kernel op whose address is not a multiple of the divisibility."""

    supports_higher_order_operators = True  # routed experts: cond runs its branches unwatched (no reduction there)
    OPS = ("reduce_logprobs", "vocab_shard_statistics", "vocab_shard_candidates", "merge_vocabulary_logprobs",
           "score_shard_statistics", "score_shard_candidates", "merge_prompt_scores")

    def __init__(self):
        super().__init__()
        self.calls, self.misaligned = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if func.namespace == "ignition" and func.overloadpacket.__name__ in self.OPS:
            self.calls += 1
            for argument, value in zip(func._schema.arguments, args):
                # chosen ids are widened into the aligned workspace when they are not (components/workspaces.py)
                if isinstance(value, torch.Tensor) and argument.name != "chosen" \
                        and value.data_ptr() % POINTER_DIVISIBILITY:
                    self.misaligned.append(f"{func}: {argument.name} at {value.data_ptr():#x}")
        return func(*args, **(kwargs or {}))


def test_every_core_passes_its_reduction_aligned_pointers(cores):
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    for name, core in cores.items():
        loaded = load_core(core)
        watch = PointerAlignment()
        requests = [Request([1, 2, 3, 4, 5], max_tokens=3, logprobs=5, ignore_eos=True),
                    Request([6, 7], max_tokens=2, logprob_token_ids=[0, 3], ignore_eos=True)]
        with watch:
            results = Engine(loaded).generate(requests)
        assert all(r.error is None for r in results), name
        assert watch.calls and watch.misaligned == [], (name, watch.misaligned[:5])
