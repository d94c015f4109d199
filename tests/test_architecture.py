"""The folders are the architecture: data flows one way, no module imports in a circle, and every device or
backend decision of the runtime lives in runtime/options.py, runtime/backends/ or runtime/cuda_driver.py.

Imports are read from the source (module level and inside functions alike: a lazy import is still an arrow).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ignition"

LAYERS = {
    "catalog": set(),
    "schemas": set(),
    "components": {"catalog"},
    "recipes": {"catalog", "components"},
    "validate": {"catalog", "schemas"},
    "exporter": {"catalog", "components", "recipes", "validate", "schemas"},
    "runtime": {"catalog", "components", "validate", "schemas"},
    "serve": {"catalog", "runtime"},
    "cli": {"catalog", "components", "recipes", "exporter", "validate", "runtime", "serve"},
    "__main__": {"cli"},
}
"""Subpackage -> the subpackages it may import (besides itself and the top-level ``ignition`` package)."""

DECIDERS = ("runtime/options.py", "runtime/backends/", "runtime/cuda_driver.py")
"""Where the runtime may ask which device or backend it has."""

DECISION = re.compile(r"device\.type\b|\.is_cuda\b|runtime\s*==|==\s*\"onnxruntime\"|backend\s*==\s*\"")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` is an arrow to the submodule, not to the package
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ignition"


def test_data_flows_one_way():
    arrows = sorted({(a, b) for a, targets in _imports().items() for b in targets
                     if _subpackage(a) != _subpackage(b) and "ignition" not in (_subpackage(a), _subpackage(b))
                     and _subpackage(b) not in LAYERS[_subpackage(a)]})
    assert not arrows, "imports against the flow: " + ", ".join(f"{a} -> {b}" for a, b in arrows)


def test_no_import_circles():
    edges = _imports()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_device_and_backend_decisions_live_in_one_place():
    strays = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(DECIDERS):
            continue
        strays += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                   if DECISION.search(line)]
    assert not strays, "device or backend decided outside options/backends/cuda_driver:\n" + "\n".join(strays)


NAME_CHECK = re.compile(r"\bbackend\.name\s*(==|!=|\bin\b)|(==|!=)\s*\w*[Bb]ackend\.name\b|\bBackend\.name\b")
"""A comparison with a backend's name: what a backend can do is a property of the protocol (backends/protocol.py)."""


def test_no_code_outside_the_backends_asks_a_backend_its_name():
    strays = [f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}" for path in sorted(ROOT.rglob("*.py"))
              if not path.relative_to(ROOT).as_posix().startswith("runtime/backends/")
              for n, line in enumerate(path.read_text().splitlines(), 1) if NAME_CHECK.search(line)]
    assert not strays, "a backend's name decides, not the protocol:\n" + "\n".join(strays)
    assert NAME_CHECK.search('windowed = backend.name != "onnx"') and NAME_CHECK.search("if name == Pt2Backend.name:")
    assert not NAME_CHECK.search("backend=backend.name, transfer=...")  # naming it in a result is no decision


FRAME_RECORDS = re.compile(r"\bdecode_record\b|\brecords_host\b|\bPendingFrame\b|\bdecode_hook\b|\bFrameReader\b")
"""What reads a frame's records: the runtime's alone (runtime/runner.py, frames.py, outputs.py)."""


def test_serve_never_decodes_frame_records():
    strays = [f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}" for path in sorted((ROOT / "serve").rglob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1) if FRAME_RECORDS.search(line)]
    assert not strays, "serve/ reads frame records (runtime/outputs.py interprets them):\n" + "\n".join(strays)


RUNTIME_LINES = 400


def test_runtime_files_stay_small():
    large = {path.relative_to(ROOT).as_posix(): n for path in sorted((ROOT / "runtime").rglob("*.py"))
             if (n := len(path.read_text().splitlines())) > RUNTIME_LINES}
    assert not large, f"runtime/ modules over {RUNTIME_LINES} lines: {large}"


def test_the_runtime_package_exports_the_public_api():
    import ignition.runtime as runtime
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.options import LoadOptions
    from ignition.runtime.requests import Request, SamplingParams

    assert runtime.__all__ == ["load_core", "LoadOptions", "Engine", "Request", "SamplingParams"]
    assert [getattr(runtime, name) for name in runtime.__all__] == [load_core, LoadOptions, Engine, Request,
                                                                   SamplingParams]
    try:
        runtime.Scheduler  # noqa: B018 (the scheduler is no public name)
    except AttributeError as exc:
        assert "has no attribute 'Scheduler'" in str(exc)
    else:
        raise AssertionError("ignition.runtime exports Scheduler")


RAW_READ = re.compile(r"\bmanifest(\[[^\]]+\](?!\s*=[^=])|\.get\()")
"""A read of the raw manifest JSON: ``manifest[...]`` (an assignment writes it) or ``manifest.get(...)``."""

RAW_READERS = ("catalog/", "validate/")
"""Where the raw manifest is read; everything else reads the typed ``catalog.manifest.Manifest`` (``LoadedCore.spec``)."""

PENDING_RAW_READS: dict[str, str] = {}
"""Raw reads still allowed outside catalog/ and validate/, each line with the typed read that replaces it: none."""


def test_only_catalog_and_validate_read_the_raw_manifest():
    strays = [f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}" for path in sorted(ROOT.rglob("*.py"))
              if not path.relative_to(ROOT).as_posix().startswith(RAW_READERS)
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if RAW_READ.search(line) and line.strip() not in PENDING_RAW_READS]
    assert not strays, "raw manifest reads (read LoadedCore.spec, the typed Manifest):\n" + "\n".join(strays)
    assert RAW_READ.search('model = core.manifest["model"]') and RAW_READ.search('core.manifest.get("eos_token_id")')
    assert RAW_READ.search('if manifest["k"] == 0:')
    assert not RAW_READ.search('manifest["tensor_parallel"] = section') and not RAW_READ.search("core.spec.model")


CONFTEST = Path(__file__).with_name("conftest.py")


def _fixtures(tree: ast.Module, run_scoped: bool) -> dict[str, ast.FunctionDef]:
    def fixture(decorator) -> bool:
        call = decorator if isinstance(decorator, ast.Call) else None
        name = ast.unparse(call.func if call else decorator)
        if name not in ("pytest.fixture", "fixture"):
            return False
        return not run_scoped or call is not None and any(
            k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value == "session" for k in call.keywords)
    return {node.name: node for node in tree.body
            if isinstance(node, ast.FunctionDef) and any(fixture(d) for d in node.decorator_list)}


def test_every_shared_core_is_checked_unchanged():
    """A session-scoped core is exported through ``shared_core``, which fingerprints it, and the autouse
    ``shared_cores_stay_unchanged`` fails the test run when a test or fixture changed one in place; a fixture that
    takes a shared core and writes files (``served_eos`` sets an EOS id) writes into a copy."""
    tree = ast.parse(CONFTEST.read_text())
    fixtures = _fixtures(tree, run_scoped=False)
    calls = {name: {n.func.id for n in ast.walk(body) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
             for name, body in fixtures.items()}
    session = _fixtures(tree, run_scoped=True)
    exporting = {name for name, called in calls.items() if "export_core" in called}
    assert exporting <= set(session), exporting - set(session)
    assert exporting and all("shared_core" in calls[name] for name in exporting), calls
    guard = session["shared_cores_stay_unchanged"]
    assert any(k.arg == "autouse" and getattr(k.value, "value", False) for d in guard.decorator_list
               if isinstance(d, ast.Call) for k in d.keywords)
    shared = {name for name, called in calls.items() if "shared_core" in called}
    writes = re.compile(r"\.(write_text|write_bytes|unlink|rename|replace)\(|dump_json|shutil\.(rmtree|move)")
    for name, body in fixtures.items():  # a fixture that takes a shared core and writes: into a copy only
        uses = {a.arg for a in body.args.args} & shared
        source = ast.get_source_segment(CONFTEST.read_text(), body)
        if uses and writes.search(source):
            assert "copytree" in source, f"{name} writes next to shared core(s) {uses} without copying one"


def test_the_core_fingerprint_sees_every_edit(tmp_path):
    from conftest import core_fingerprint

    core = tmp_path / "core"
    (core / "graphs").mkdir(parents=True)
    (core / "manifest.json").write_text('{"eos_token_id": 3}\n')
    (core / "graphs" / "decode.c1.pt2").write_bytes(b"\x00" * 16)
    before = core_fingerprint(core)
    assert core_fingerprint(core) == before
    for edit, undo in ((lambda: (core / "manifest.json").write_text('{"eos_token_id": 4}\n'),  # same size
                        lambda: (core / "manifest.json").write_text('{"eos_token_id": 3}\n')),
                       (lambda: (core / "graphs" / "x.pt2").write_bytes(b""),
                        lambda: (core / "graphs" / "x.pt2").unlink()),
                       (lambda: (core / "graphs" / "decode.c1.pt2").rename(core / "graphs" / "decode.c2.pt2"),
                        lambda: (core / "graphs" / "decode.c2.pt2").rename(core / "graphs" / "decode.c1.pt2"))):
        edit()
        assert core_fingerprint(core) != before
        undo()
        assert core_fingerprint(core) == before
