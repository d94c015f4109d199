"""Regenerate or check ``ignition/catalog/operators.py``: the operators the recipes' graphs call.

``python -m benchmarks.operator_table [--recipes R,...]`` exports tiny cores of every recipe (toy, qwen3, llama, gemma3,
qwen3_moe, deepseek_v3, qwen3_5, gpt_oss, deepseek_v4) with generation and prompt logprobs, speculative verify and mixed
variants, and a tensor-parallel qwen3 core, reads every graph's ``models/model.json`` and prints
the exact operators (``namespace.name.overload``) the graphs call that validate-core would refuse: neither in
``ALLOWED_OPERATORS`` (``EMITTED_OPERATORS`` and ``TENSOR_OPERATORS``) nor an ``_operator`` function on
shape symbols (exit 1 when any). ``--all`` prints every captured packet. An addition to the table is a reviewed change:
validate-core refuses any other operator (GRAPH-OPERATOR).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from ignition.catalog import operators
from ignition.catalog.operators import ALLOWED_OPERATORS, operator_entry
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.validate.program_json import SYMBOLIC_OPERATORS


def graph_targets(pt2: Path) -> set[str]:
    """Every node target of the graph (nested subgraphs included), as written in the program JSON."""
    with zipfile.ZipFile(pt2) as archive:
        name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        document = json.loads(archive.read(name))
    targets, stack = set(), [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if "inputs" in node and "outputs" in node and isinstance(node.get("target"), str):
                targets.add(node["target"])
            stack.extend(node.values())
    return targets


EXAMPLES = {  # recipe -> (examples/ script, make_checkpoint keyword arguments)
    "qwen3": ("make_tiny_qwen3", {}),
    "llama": ("make_tiny_llama", {}),
    "qwen3_moe": ("make_tiny_moe", {"family": "qwen3_moe"}),
    "deepseek_v3": ("make_tiny_moe", {"family": "deepseek_v3"}),
    "gemma3": ("make_tiny_gemma3", {}),
    "qwen3_5": ("make_tiny_qwen3_5", {}),
    "gpt_oss": ("make_tiny_gpt_oss", {}),
    "deepseek_v4": ("make_tiny_deepseek_v4", {}),
}


def _checkpoints(root: Path, recipes) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    made = {}
    for recipe in recipes:
        script, arguments = EXAMPLES[recipe]
        made[recipe] = importlib.import_module(script).make_checkpoint(root / recipe, **arguments)
    return made


class _Anything(frozenset):
    """An allow-list that allows every entry (``in`` is always true): the name-based refusals still apply."""

    def __contains__(self, entry) -> bool:
        return True


@contextmanager
def _recording():
    """Export with every operator allowed (in this process: one capture job), so every captured operator is
    collected rather than refused at save or at the export's validation; files, storage and process operators are
    still refused by name (``refused_by_name``)."""
    original = operators.ALLOWED_OPERATORS
    operators.ALLOWED_OPERATORS = _Anything()
    try:
        yield
    finally:
        operators.ALLOWED_OPERATORS = original


def captured_packets(root: Path, recipes=tuple(EXAMPLES)) -> set[str]:
    """Export every configuration of ``recipes`` (and the toy's) into ``root`` and collect the exact operators of
    all their graphs."""
    checkpoints = _checkpoints(root / "checkpoints", recipes)
    small = dict(capacities=(1, 2), chunk_limit=8, max_seq_len=32, capture_jobs=1)
    configurations = {"toy": ExportOptions(recipe="toy", capacities=(1, 4)),
                      "toy-scored": ExportOptions(recipe="toy", capacities=(1, 4), prompt_logprobs=True),
                      "toy-nolp": ExportOptions(recipe="toy", capacities=(1, 4), logprobs=False),
                      "toy-natural": ExportOptions(recipe="toy", capacities=(1, 4), k=5, logprob_ids=False)}
    for family, checkpoint in checkpoints.items():
        configurations[family] = ExportOptions(recipe=family, checkpoint=checkpoint, prompt_logprobs=True,
                                               speculative_tokens=(2,), mixed=True, **small)
    if "qwen3" in checkpoints:
        configurations["qwen3-tp2"] = ExportOptions(recipe="qwen3", checkpoint=checkpoints["qwen3"],
                                                    prompt_logprobs=True, tensor_parallel=2, targets=("cuda:90",),
                                                    **small)
    packets = set()
    for name, options in configurations.items():
        out = root / name
        with _recording():
            export_core(options, out)
        for pt2 in sorted(out.rglob("*.pt2")):
            packets |= {operator_entry(t) for t in graph_targets(pt2)}
        print(f"{name}: {len(packets)} packets so far", file=sys.stderr)
    return packets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every captured packet, not only the new ones")
    parser.add_argument("--recipes", default=",".join(EXAMPLES),
                        help=f"comma-separated recipes to export beside the toy (default: {','.join(EXAMPLES)})")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    if unknown := sorted(set(recipes) - set(EXAMPLES)):
        parser.error(f"--recipes: unknown {', '.join(unknown)}; expected some of {', '.join(EXAMPLES)}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="ignition-operators-") as tmp:
        packets = captured_packets(Path(tmp), recipes)
    missing = sorted(packets - ALLOWED_OPERATORS - {f"_operator.{name}" for name in SYMBOLIC_OPERATORS})
    for packet in sorted(packets) if args.all else missing:
        print(packet)
    if missing:
        print(f"{len(missing)} captured operator(s) that ignition/catalog/operators.py does not allow", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
