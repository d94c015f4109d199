"""Step 0: install the carried wheelhouse with ``pip --no-index`` and prove every requirement importable.

``requirements.txt`` lists only what the image lacks. Should pip still refuse (a resolver conflict with the
image's tree), the carried wheels of distributions the image does not have are installed with ``--no-deps
--target`` into ``site_dir(work)``, which gpu_check puts on every later step's PYTHONPATH."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from packaging.requirements import Requirement
from packaging.version import Version

from benchmarks.gpu.record import ROOT, site_dir, step_main, with_site

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
    if done.returncode != 0:
        record.metric("pip_install_failed", f"exit {done.returncode}: {last_line}")
        done = _install_target(context, record)
        last_line = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    record.check("pip install --no-index (or its --target fallback) exits 0", done.returncode == 0,
                 f"exit {done.returncode}: {last_line}" if done.returncode else "")
    record.check("every requirement is installed at an allowed version",
                 *_versions(context.wheelhouse / wheelhouse.REQUIREMENTS, record, context.work))
    imported = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, cwd=ROOT,
                              env=with_site(context.work))
    record.check("ignition's CLI, exporter, runtime, server and the test tools import",
                 imported.returncode == 0 and imported.stdout.strip().endswith("ok"),
                 imported.stderr.strip()[-1500:])


def _install_target(context, record) -> subprocess.CompletedProcess:
    """The carried wheels that serve this Python, of distributions not installed here, into ``site_dir``."""
    from importlib import metadata

    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename

    from benchmarks.gpu import wheelhouse

    here = set(sys_tags())
    installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    wheels = [w["file"] for w in wheelhouse.read_manifest(context.wheelhouse)["wheels"]
              if set(parse_wheel_filename(w["file"])[3]) & here and canonicalize_name(w["name"]) not in installed]
    record.metric("installed_with_target", wheels)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
               "--no-input", "--no-compile", "--no-deps", "--target", str(site_dir(context.work)),
               *(str(context.wheelhouse / name) for name in wheels)]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-4000:] + done.stderr[-4000:], flush=True)
    return done


def _versions(requirements, record, work) -> tuple[bool, str]:
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
    done = subprocess.run([sys.executable, "-c", script, str(requirements)], capture_output=True, text=True,
                          env=with_site(work))
    if done.returncode != 0:
        return False, done.stderr.strip()[-1000:]
    found = json.loads(done.stdout)
    record.metric("installed", found)
    bad = [f"{spec} (found {version})" for spec, version in found.items()
           if version is None or not Requirement(spec).specifier.contains(Version(version), prereleases=True)]
    return not bad, "; ".join(bad)


if __name__ == "__main__":
    step_main(run)
