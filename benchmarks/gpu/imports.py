"""Which distributions the code gpu-check runs on the GPU image imports, and whether each gets there.

The code is ``ignition/``, gpu-check itself, the example checkpoint maker it uses, and the test files
``pytest -m cuda`` collects with the local helpers they import. Every import statement counts, including
those inside functions (a lazy import still runs on the image). Each top-level module outside the standard
library and this repository is mapped to its distribution through the installed packages' metadata; a
distribution must be on the image (``wheelhouse.IMAGE``) or in the wheelhouse for every CPython version.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL_PACKAGES = {"ignition", "benchmarks", "tests", "examples"}


def _imported_modules(path: Path, module_level_only: bool = False) -> set[str]:
    """Dotted names of the absolute imports in ``path`` (with ``module_level_only``, those run at import)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _top_level_imports(path: Path, module_level_only: bool = False) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path, module_level_only)}


def scanned_files() -> list[tuple[Path, bool]]:
    """The sources gpu-check runs on the image, each with whether only its module-level imports count.

    Every import counts in ``ignition/``, gpu-check and the cuda test files, and in the test helpers those
    files import or run as scripts (``_triton_vocabulary_check.py``). tests/conftest.py counts at module level
    only: its fixtures' lazy imports (the HTTP test servers) serve tests that ``-m cuda`` deselects."""
    from benchmarks.gpu.steps.pytest_cuda import cuda_test_files

    files = sorted((ROOT / "ignition").rglob("*.py")) + [ROOT / "benchmarks" / "gpu_check.py"]
    files += sorted((ROOT / "benchmarks" / "gpu").rglob("*.py")) + [ROOT / "examples" / "make_tiny_qwen3.py"]
    helpers = {p.stem: p for p in (ROOT / "tests").glob("_*.py")}
    pending, seen = list(cuda_test_files()), set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        named = {name.removeprefix("tests.").split(".")[0] for name in _imported_modules(path)}
        named |= set(re.findall(r"\b(_\w+)\.py\b", path.read_text()))  # helper scripts run by path
        pending += [helpers[name] for name in named if name in helpers]
    return [(f, False) for f in files + sorted(seen)] + [(ROOT / "tests" / "conftest.py", True)]


def third_party_modules(files: list[tuple[Path, bool]]) -> dict[str, list[str]]:
    """Each imported top-level module outside the standard library and this repository, with its importers."""
    local = LOCAL_PACKAGES | {p.stem for p in (ROOT / "tests").glob("*.py")} | \
        {p.stem for p in (ROOT / "examples").glob("*.py")}
    found: dict[str, list[str]] = {}
    for path, module_level_only in files:
        for name in _top_level_imports(path, module_level_only):
            if name in sys.stdlib_module_names or name in local or name == "__future__":
                continue
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def needed_distributions() -> tuple[dict[str, list[str]], list[str]]:
    """{module: the distributions that provide it}, and the modules no installed distribution provides."""
    providers = metadata.packages_distributions()
    modules = third_party_modules(scanned_files())
    mapped = {m: sorted(set(providers[m])) for m in modules if m in providers}
    return mapped, sorted(m for m in modules if m not in providers)


def coverage_problems(manifest: dict) -> list[str]:
    """Each imported module that neither the image nor the wheelhouse (for every CPython) provides."""
    from packaging.utils import canonicalize_name

    from benchmarks.gpu.wheelhouse import PYTHONS, on_image, serves

    carried = {python: {canonicalize_name(w["name"]) for w in manifest["wheels"] if serves(w["file"], python)}
               for python in PYTHONS}
    mapped, unknown = needed_distributions()
    problems = [f"module {m}: no installed distribution provides it, so its wheel cannot be told" for m in unknown]
    for module, distributions in sorted(mapped.items()):
        names = [canonicalize_name(d) for d in distributions]
        if any(on_image(n) for n in names):
            continue
        for python in PYTHONS:
            if not any(n in carried[python] for n in names):
                problems.append(f"module {module} ({', '.join(distributions)}) is neither on the image nor in the "
                                f"wheelhouse for CPython {python}")
    return problems
