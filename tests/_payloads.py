"""Test helpers: live payloads that write a canary file when a loader executes them.

Each payload is planted in a copy of a real graph ``.pt2``; ``tests/test_pt2_archive.py`` proves
it is live (plain ``torch.export.load`` runs it) before asserting that Ignition never does.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch


class Canary:
    """Unpickling this object writes ``path``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('executed')",)


def code(canary: Path) -> str:
    """A Python expression that writes the canary (single quotes only: torch pastes it into double-quoted code)."""
    return f"open({str(canary)!r}, 'w').write('executed')"


def rewrite(data: bytes, edit: Callable[[dict[str, bytes]], None]) -> bytes:
    """Rewrite a .pt2: ``edit`` changes the members (names relative to the archive root) in place."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        root = archive.namelist()[0].split("/", 1)[0]
        members = {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}
    edit(members)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, content in members.items():
            archive.writestr(f"{root}/{name}", content)
    return out.getvalue()


def _constant(path_name: str, use_pickle: bool, payload: bytes):
    def edit(members):
        config = {"config": {"planted": {"path_name": path_name, "is_param": False, "use_pickle": use_pickle,
                                         "tensor_meta": None}}}
        members["data/constants/model_constants_config.json"] = json.dumps(config).encode()
        members[f"data/constants/{path_name}"] = payload
    return edit


def _model_json(change: Callable[[dict], None]):
    def edit(members):
        document = json.loads(members["models/model.json"])
        change(document)
        members["models/model.json"] = json.dumps(document).encode()
    return edit


def _symbolic(canary: Path):
    def change(document):
        values = document["graph_module"]["graph"]["tensor_values"]
        first = next(iter(values.values()))
        first["sizes"][0] = {"as_expr": {"expr_str": code(canary), "hint": {"as_int": 1}}}
    return _model_json(change)


def _torch_saved(canary: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(Canary(canary), buffer)
    return buffer.getvalue()


def _guards(canary: Path, example_inputs: dict[str, torch.Tensor]):
    """Benign sample inputs (tensors only) make ``.module()`` exec the guards; the planted guard runs on call."""
    def edit(members):
        _model_json(lambda d: d.update(guards_code=[code(canary) + " > 0"]))(members)
        buffer = io.BytesIO()
        torch.save(((example_inputs,), {}), buffer)
        members["data/sample_inputs/model.pt"] = buffer.getvalue()
    return edit


def legacy_archive(model_json: bytes, canary: Path) -> bytes:
    """The pre-2.7 zip layout torch.export.load falls back to when the pt2 reader fails: its state dict
    is read with torch.load, retried with weights_only=False."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("version", "8.20")
        archive.writestr("serialized_exported_program.json", model_json)
        for name in ("serialized_state_dict.pt", "serialized_constants.pt"):
            archive.writestr(name, _torch_saved(canary))
        archive.writestr("serialized_example_inputs.pt", b"")
    return out.getvalue()


def pt2_payloads(canary: Path, example_inputs: dict[str, torch.Tensor]) -> dict[str, Callable[[dict[str, bytes]], None]]:
    """name -> edit planting a payload that plain torch.export.load executes (guards-code: when the
    loaded program's module is called with ``example_inputs``)."""
    return {
        "pickled-constant": _constant("tensor_0", True, pickle.dumps(Canary(canary))),
        "opaque-object": _constant("opaque_obj_0", True, pickle.dumps(Canary(canary))),
        "sample-inputs": lambda members: members.update({"data/sample_inputs/model.pt": _torch_saved(canary)}),
        "symbolic-expression": _symbolic(canary),
        "guards-code": _guards(canary, example_inputs),
    }


EXPECTED_RULES = {"pickled-constant": {"PT2-PICKLE", "PT2-MEMBER"}, "opaque-object": {"PT2-PICKLE", "PT2-MEMBER"},
                  "sample-inputs": {"PT2-PICKLE"}, "symbolic-expression": {"PT2-PROGRAM"},
                  "guards-code": {"PT2-PICKLE", "PT2-PROGRAM"}}


def shared_library(canary: Path, out: Path) -> Path | None:
    """A shared library whose constructor writes the canary when it is dlopened; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    source = out.with_suffix(".c")
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE *f = fopen("{canary}", "w"); if (f) {{ fputs("executed", f); fclose(f); }}\n}}\n')
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out), str(source)], check=True, capture_output=True)
    return out


def file_write(victim: Path, size: int, byte: int = 65):
    """A graph whose first nodes map ``victim`` with ``aten.from_file(path, shared=True, size=N)`` and
    overwrite it with ``fill_``: code execution by file write when ``victim`` is a .py file run later.
    Built from nodes torch serializes itself (a uint8 ``zeros`` and its ``fill_``), retargeted."""
    class Planted(torch.nn.Module):
        def forward(self, x):
            planted = torch.zeros(size, dtype=torch.uint8)
            planted.fill_(byte)
            return x

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(Planted(), (torch.zeros(1),)), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        graph = json.loads(archive.read(name))["graph_module"]["graph"]
    opened, filled = graph["nodes"][:2]
    values = {}
    for node, name in ((opened, "planted_file"), (filled, "planted_fill")):  # names no real graph uses
        values[name] = graph["tensor_values"][node["outputs"][0]["as_tensor"]["name"]]
        node["outputs"][0]["as_tensor"]["name"] = node["name"] = name
    opened["target"] = "torch.ops.aten.from_file.default"
    opened["inputs"] = [{"name": "filename", "arg": {"as_string": str(victim)}, "kind": 1},
                        {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
                        {"name": "size", "arg": {"as_int": size}, "kind": 1},
                        {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2}]
    filled["inputs"][0]["arg"]["as_tensor"]["name"] = "planted_file"

    def change(document):
        target = document["graph_module"]["graph"]
        target["nodes"][:0] = [opened, filled]
        target["tensor_values"].update(values)
    return _model_json(change)
