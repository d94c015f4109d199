"""`make gpu-wheelhouse`: the wheels the GPU image lacks, for CPython 3.10-3.13 on manylinux x86_64.

The image (an H200 with torch 2.11+cu130, Triton 3.6, CuPy, cuda-bindings, onnx, onnxruntime and
transformers) reaches no package index, so everything else ``ignition`` and ``make gpu-check`` import
travels as wheels in ``build/wheelhouse``:

1. the requirements are the project's dependencies and the test tools ``gpu-check`` runs
   (``GPU_TEST_TOOLS``, specifiers read from pyproject.toml);
2. ``pip download`` resolves those not in ``IMAGE`` once per CPython version, binary wheels only;
3. wheels of ``IMAGE`` packages are dropped (torch, Triton and CUDA are never carried); a pure-python
   wheel is kept once, a binary one per version it serves (or once, where it is abi3);
4. ``manifest.json`` records each file's name, version, sha256, size and the versions it serves (and the full
   requirement list), ``requirements.txt`` only the requirements the image lacks: listing an image package
   (torch, numpy, ...) makes pip resolve against the installed torch's whole tree, where one pin it cannot
   meet offline installs nothing. The install step falls back to ``pip install --target`` of the carried
   wheels the image does not have (``steps/install.py``).

``check`` proves a wheelhouse complete without a network: every file matches the manifest, the total
fits ``MAX_BYTES``, and for each CPython version every requirement, and every requirement of every
wheel chosen (markers evaluated for that version), is either an ``IMAGE`` package or a wheel here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "build" / "wheelhouse"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64")
"""Up to glibc 2.31: llguidance 1.9's only Linux x86_64 wheel is manylinux_2_31. The image's Python is 3.12.3, Ubuntu
24.04's (glibc 2.39: the device tool's KINDS.md), so every tag here installs there."""
MAX_BYTES = 64 * 2**20
MANIFEST, REQUIREMENTS = "manifest.json", "requirements.txt"
GPU_TEST_TOOLS = ("pytest",)
"""Test-extra packages that ``gpu-check`` itself runs (``pytest -m cuda``); the others stay behind."""

IMAGE: dict[str, str] = {
    # What the GPU image holds (the list and what those packages require), with the version read
    # there where one was read (docs: the device's package list, 2026-11), else "". These are never carried:
    # they are large, binary, or tied to the image's torch and CUDA. Small pure-python packages the image
    # probably has too (typing-extensions, click, packaging, ...) travel anyway: a missing one stops the run.
    "torch": "2.11.0", "triton": "3.6.0", "cuda-bindings": "", "cuda-pathfinder": "", "cuda-core": "",
    "cupy-cuda13x": "14.2.0", "numpy": "2.5.2", "onnx": "1.23.1", "onnxruntime": "1.30.0", "onnxscript": "0.7.2",
    "onnx-ir": "1.0.0", "ml-dtypes": "", "protobuf": "", "transformers": "5.17.0", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "hf-xet": "", "regex": "", "pyyaml": "", "tqdm": "",
    "jinja2": "", "markupsafe": "", "filelock": "", "fsspec": "", "sympy": "", "mpmath": "", "networkx": "",
    "setuptools": "",
}
IMAGE_PREFIXES = ("nvidia-",)  # the CUDA libraries torch pulls in


def on_image(name: str) -> bool:
    name = canonicalize_name(name)
    return name in IMAGE or name.startswith(IMAGE_PREFIXES)


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be built or read (pip failed, a file is missing); the message says which."""


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The project's dependencies and ``GPU_TEST_TOOLS`` with the specifiers pyproject.toml gives them."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    test = {canonicalize_name(Requirement(r).name): Requirement(r)
            for r in project["optional-dependencies"]["test"]}
    missing = [t for t in GPU_TEST_TOOLS if t not in test]
    if missing:
        raise WheelhouseError(f"{pyproject}: the test extra lacks {', '.join(missing)} (GPU_TEST_TOOLS)")
    return [Requirement(r) for r in project["dependencies"]] + [test[t] for t in GPU_TEST_TOOLS]


def install_list(wanted: list[Requirement]) -> str:
    """``requirements.txt``: the requirements the image lacks, one a line (image packages are never listed)."""
    return "".join(f"{r}\n" for r in wanted if not on_image(r.name))


def target_environment(python: str) -> dict[str, str]:
    """Marker values for CPython ``python`` ("3.12") on manylinux x86_64."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")
    return env


def target_tags(python: str) -> set:
    version = tuple(int(part) for part in python.split("."))
    interpreter = f"cp{version[0]}{version[1]}"
    return set(cpython_tags(version, platforms=PLATFORMS)) | set(
        compatible_tags(version, interpreter=interpreter, platforms=PLATFORMS))


def serves(filename: str, python: str) -> bool:
    return bool(set(parse_wheel_filename(filename)[3]) & target_tags(python))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(roots: list[Requirement], python: str, into: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", python, "--dest", str(into)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    done = subprocess.run(command + [str(r) for r in roots], capture_output=True, text=True)
    if done.returncode != 0:
        raise WheelhouseError(f"pip download for CPython {python} failed ({done.returncode}):\n"
                              f"{(done.stdout + done.stderr)[-3000:]}")


def build(out: Path = DEFAULT_DIR, log=print) -> dict:
    """Download, prune and describe the wheelhouse in ``out`` (its old wheels are replaced); the manifest."""
    wanted = requirements()
    roots = [r for r in wanted if not on_image(r.name)]
    served: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as scratch:
        for python in PYTHONS:
            into = Path(scratch) / python
            log(f"pip download for CPython {python}: {', '.join(str(r) for r in roots)}")
            _download(roots, python, into)
            # NOTE: pip evaluates markers for the interpreter running it, not for --python-version, so a
            # dependency only older versions need (tomli; python_version < "3.11") is fetched by name here.
            for _ in range(8):
                wheels = [_entry(w) for w in into.glob("*.whl")]
                missing = {str(r.name) + str(r.specifier) for r in _walk(into, wheels, wanted, python)[1]}
                if not missing:
                    break
                log(f"  and for CPython {python}'s markers: {', '.join(sorted(missing))}")
                _download([Requirement(m) for m in sorted(missing)], python, into)
            for wheel in into.glob("*.whl"):
                if on_image(parse_wheel_filename(wheel.name)[0]):
                    continue
                served.setdefault(wheel.name, set()).add(python)
                shutil.copy2(wheel, Path(scratch) / wheel.name)
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.whl"):
            old.unlink()
        for filename in served:
            shutil.copy2(Path(scratch) / filename, out / filename)
    entries = [dict(_entry(out / filename), sha256=_sha256(out / filename), pythons=sorted(served[filename]))
               for filename in sorted(served)]
    manifest = {"pythons": list(PYTHONS), "platforms": list(PLATFORMS), "max_bytes": MAX_BYTES,
                "total_bytes": sum(e["bytes"] for e in entries), "requirements": [str(r) for r in wanted],
                "image": {"packages": IMAGE, "prefixes": list(IMAGE_PREFIXES)}, "wheels": entries}
    (out / REQUIREMENTS).write_text(install_list(wanted))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _entry(path: Path) -> dict:
    name, version, _, tags = parse_wheel_filename(path.name)
    return {"file": path.name, "name": str(name), "version": str(version), "bytes": path.stat().st_size,
            "tags": sorted(str(t) for t in tags)}


def read_manifest(directory: Path = DEFAULT_DIR) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise WheelhouseError(f"{path} is missing: run `make gpu-wheelhouse` (on a machine that reaches PyPI)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WheelhouseError(f"{path} is not JSON: {exc}") from None


def _metadata_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if name is None:
            raise WheelhouseError(f"{wheel.name} has no .dist-info/METADATA")
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def check(directory: Path = DEFAULT_DIR, verify_hashes: bool = True) -> list[str]:
    """Every problem of the wheelhouse in ``directory`` (empty: it installs on every CPython in PYTHONS)."""
    manifest = read_manifest(directory)
    problems = []
    wheels = manifest["wheels"]
    listed = {w["file"] for w in wheels}
    for stray in sorted(p.name for p in directory.glob("*.whl") if p.name not in listed):
        problems.append(f"{stray} is not in {MANIFEST}")
    total = 0
    for wheel in wheels:
        path = directory / wheel["file"]
        if not path.is_file():
            problems.append(f"{wheel['file']} is listed in {MANIFEST} but missing")
            continue
        total += path.stat().st_size
        if path.stat().st_size != wheel["bytes"] or (verify_hashes and _sha256(path) != wheel["sha256"]):
            problems.append(f"{wheel['file']} differs from its {MANIFEST} entry (size or sha256)")
        if on_image(wheel["name"]):
            problems.append(f"{wheel['file']} is an image package ({wheel['name']}) and must not be carried")
    if total > MAX_BYTES:
        problems.append(f"the wheelhouse holds {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    if not (directory / REQUIREMENTS).is_file():
        problems.append(f"{REQUIREMENTS} is missing")
    else:
        listed = [Requirement(line) for line in (directory / REQUIREMENTS).read_text().splitlines() if line.strip()]
        problems += [f"{REQUIREMENTS} lists {r.name}, which the image has: pip would resolve against its tree"
                     for r in listed if on_image(r.name)]
    roots = [Requirement(r) for r in manifest["requirements"]]
    for python in PYTHONS:
        problems += [f"CPython {python}: {p}" for p in _walk(directory, wheels, roots, python)[0]]
    return problems


def _walk(directory: Path, wheels: list[dict], roots: list[Requirement],
          python: str) -> tuple[list[str], list[Requirement]]:
    """Walks the requirements as pip would on CPython ``python``: each one not on the image needs a wheel in
    ``directory`` that serves that version and satisfies its specifier; that wheel's own requirements follow.
    The problems found, and the requirements no wheel here satisfies."""
    env = target_environment(python)
    candidates: dict[str, list[dict]] = {}
    for wheel in wheels:
        if serves(wheel["file"], python):
            candidates.setdefault(canonicalize_name(wheel["name"]), []).append(wheel)
    problems, missing, seen = [], [], set()
    pending = [(r, REQUIREMENTS, ("",)) for r in roots]
    while pending:
        requirement, wanted_by, extras = pending.pop()
        if requirement.marker is not None and not any(
                requirement.marker.evaluate(dict(env, extra=extra)) for extra in extras):
            continue
        name = canonicalize_name(requirement.name)
        if on_image(name):
            known = IMAGE.get(name, "")
            if known and not requirement.specifier.contains(Version(known), prereleases=True):
                problems.append(f"{wanted_by} needs {requirement}, the image has {name} {known}")
            continue
        fitting = [w for w in candidates.get(name, [])
                   if requirement.specifier.contains(Version(w["version"]), prereleases=True)]
        if not fitting:
            problems.append(f"{wanted_by} needs {requirement}: no wheel here serves it")
            missing.append(requirement)
            continue
        chosen = max(fitting, key=lambda w: Version(w["version"]))
        key = (chosen["file"], tuple(sorted(requirement.extras)))
        if key in seen:
            continue
        seen.add(key)
        for needed in _metadata_requirements(directory / chosen["file"]):
            pending.append((needed, chosen["file"], ("", *sorted(requirement.extras))))
    return problems, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="wheelhouse directory (default build/wheelhouse)")
    parser.add_argument("--check", action="store_true", help="only check an existing wheelhouse (no download)")
    args = parser.parse_args(argv)
    try:
        manifest = read_manifest(args.out) if args.check else build(args.out)
        problems = check(args.out)
    except WheelhouseError as exc:
        print(f"gpu-wheelhouse: {exc}", file=sys.stderr)
        return 1
    binary = sum(1 for w in manifest["wheels"] if not w["file"].endswith("-none-any.whl"))
    print(f"{args.out}: {len(manifest['wheels'])} wheels ({binary} binary), "
          f"{manifest['total_bytes'] / 2**20:.2f} MiB of {MAX_BYTES / 2**20:.0f} MiB, CPython {', '.join(PYTHONS)}")
    for problem in problems:
        print(f"  problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
