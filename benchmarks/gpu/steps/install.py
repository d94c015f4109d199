"""Step 0: install the carried wheelhouse with ``pip --no-index`` and prove every requirement importable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from packaging.requirements import Requirement
from packaging.version import Version

from benchmarks.gpu.record import ROOT, step_main

IMPORTS = ("import ignition.cli, ignition.exporter.export, ignition.runtime.core, ignition.runtime.scheduler, "
           "ignition.serve.app, ignition.validate, jsonschema, typer, rich, fastapi, uvicorn, cryptography, "
           "prometheus_client, pytest, safetensors, tokenizers, transformers; print('ok')")


def run(context, record) -> None:
    from benchmarks.gpu import wheelhouse

    try:
        problems = wheelhouse.check(context.wheelhouse)
    except wheelhouse.WheelhouseError as exc:
        record.check("the wheelhouse is there", False, f"{exc} (carry build/wheelhouse)")
        return
    record.check("every wheel matches manifest.json and installs on every CPython", not problems,
                 "; ".join(problems[:5]))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
               "--no-input", "--no-compile", "--find-links", str(context.wheelhouse),
               "-r", str(context.wheelhouse / wheelhouse.REQUIREMENTS)]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-4000:] + done.stderr[-4000:], flush=True)
    last_line = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    record.check("pip install --no-index exits 0", done.returncode == 0,
                 f"exit {done.returncode}: {last_line}" if done.returncode else "")
    record.check("every requirement is installed at an allowed version",
                 *_versions(context.wheelhouse / wheelhouse.REQUIREMENTS, record))
    imported = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, cwd=ROOT)
    record.check("ignition's CLI, exporter, runtime, server and the test tools import",
                 imported.returncode == 0 and imported.stdout.strip().endswith("ok"),
                 imported.stderr.strip()[-1500:])


def _versions(requirements, record) -> tuple[bool, str]:
    """Every line of requirements.txt against the installed distribution (a fresh process sees the install)."""
    script = textwrap.dedent("""
        import json, sys
        from importlib import metadata
        from packaging.requirements import Requirement
        found = {}
        for line in open(sys.argv[1]).read().splitlines():
            if line.strip() and not line.startswith("#"):
                try:
                    found[line] = metadata.version(Requirement(line).name)
                except metadata.PackageNotFoundError:
                    found[line] = None
        print(json.dumps(found))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(requirements)], capture_output=True, text=True)
    if done.returncode != 0:
        return False, done.stderr.strip()[-1000:]
    found = json.loads(done.stdout)
    record.metric("installed", found)
    bad = [f"{spec} (found {version})" for spec, version in found.items()
           if version is None or not Requirement(spec).specifier.contains(Version(version), prereleases=True)]
    return not bad, "; ".join(bad)


if __name__ == "__main__":
    step_main(run)
