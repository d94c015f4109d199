"""`make gpu-check` on CPU: the plan keeps its deadline, the runner enforces timeouts and assertions, and the
wheelhouse (when built: `make gpu-wheelhouse`) covers every import the GPU steps make, for CPython 3.10-3.13.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.gpu import imports, wheelhouse
from benchmarks.gpu.plan import DEADLINE_S, PLAN, PYTEST_CUDA_S, SMOKE_S, Step, budget_problems, step_timeout
from benchmarks.gpu.record import site_dir, with_site
from benchmarks.gpu.replay import LOW_PRECISION_TOLERANCE, compare_low_precision
from benchmarks.gpu_check import run_plan

ROOT = Path(__file__).resolve().parents[1]


def test_the_budgets_fit_the_deadline():
    assert budget_problems(PLAN, DEADLINE_S) == []
    assert sum(step.budget_s for step in PLAN) < DEADLINE_S <= 600 - 30  # the device tool's limit on one command
    assert [PLAN[0].name, PLAN[1].name, PLAN[1].budget_s] == ["install", "smoke", SMOKE_S]
    assert budget_problems(PLAN, sum(step.budget_s for step in PLAN)) != []  # equal is not under


def test_no_step_can_outlast_the_deadline():
    """Whatever each step takes up to its timeout, the last one still ends by the deadline."""
    for spent in (0.0, 0.5, 1.0):  # each step uses none, half or all of its timeout
        elapsed = 0.0
        for index, step in enumerate(PLAN):
            timeout = step_timeout(PLAN, index, elapsed, DEADLINE_S)
            assert timeout >= step.budget_s or elapsed + timeout == pytest.approx(DEADLINE_S - sum(
                s.budget_s for s in PLAN[index + 1:]))
            elapsed += spent * timeout
            assert elapsed <= DEADLINE_S
    assert step_timeout(PLAN, len(PLAN) - 1, 0.0) == DEADLINE_S  # the elastic last step takes what is left
    assert step_timeout(PLAN, 0, DEADLINE_S) == 0.0


def test_pytest_cuda_gets_its_measured_need_even_after_every_step_spends_its_budget():
    """pytest -m cuda needs 150-280 s on an H200: the last step, elastic, gets at least its budget when every step
    before it runs to its timeout, and the deadline's slack on top."""
    assert PLAN[-1].name == "pytest-cuda" and PLAN[-1].elastic and PLAN[-1].budget_s == PYTEST_CUDA_S >= 250
    spent = sum(step.budget_s for step in PLAN[:-1])
    assert step_timeout(PLAN, len(PLAN) - 1, spent) == DEADLINE_S - spent >= PYTEST_CUDA_S


def test_a_bad_plan_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="budget_s must be positive"):
        Step("x", "m", 0, "", ())
    plan = (Step("a", "m", 300, "", ()), Step("a", "m", 200, "", (), elastic=True))
    assert budget_problems(plan, 480) == ["the step budgets sum to 500 s, not under the 480 s deadline",
                                          "step names repeat: ['a', 'a']"]


def _fake_step(folder: Path, name: str, body: str) -> Step:
    (folder / f"{name}.py").write_text("import time\nfrom benchmarks.gpu.record import step_main\n\n\n"
                                       "def run(context, record):\n" + textwrap.indent(body, "    ")
                                       + "\n\n\nstep_main(run)\n")
    return Step(name, name, 5, f"fake step {name}", ())


def test_the_runner_records_every_step_and_fails_on_any_assertion(tmp_path, monkeypatch):
    modules = tmp_path / "modules"
    modules.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(modules))
    plan = (_fake_step(modules, "passes", "record.check('holds', True)\nrecord.metric('x', 1)\n"
                                          "import os\nrecord.metric('path', os.environ['PYTHONPATH'])"),
            _fake_step(modules, "fails", "record.check('holds', True)\nrecord.check('breaks', False, 'why')"),
            _fake_step(modules, "hangs", "record.check('started', True)\ntime.sleep(60)"),
            _fake_step(modules, "raises", "raise ValueError('bad input')"))
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "results").mkdir(parents=True)
    results = run_plan(plan, out, ["--work", str(work)], work, deadline_s=22)
    statuses = {s["name"]: s["status"] for s in results["steps"]}
    assert statuses == {"passes": "passed", "fails": "failed", "hangs": "timeout", "raises": "failed"}
    assert not results["ok"]
    steps = {s["name"]: s for s in results["steps"]}
    assert steps["passes"]["metrics"]["x"] == 1
    assert str(site_dir(work)) in steps["passes"]["metrics"]["path"].split(os.pathsep)  # the --target fallback's
    assert [a["name"] for a in steps["hangs"]["assertions"]] == ["started", "finished within 5 s"]
    assert steps["hangs"]["seconds"] < 15
    assert "ValueError: bad input" in steps["raises"]["assertions"][0]["detail"]
    assert json.loads((out / "results.json").read_text())["steps"] == results["steps"]
    log = (out / "log.txt").read_text()
    assert "[fails] [FAIL] breaks: why" in log and "gpu-check: FAILED" in log
    assert "**FAILED** breaks: why" in (out / "results.md").read_text()


def test_bad_arguments_get_one_line_not_a_traceback(tmp_path):
    (tmp_path / "file").write_text("")
    for arguments, message in [(["--only", "nope"], "--only: unknown step nope"),
                               (["--out", str(tmp_path / "file")], "exists and is not a folder"),
                               (["--out", str(tmp_path), "--work", str(tmp_path / "w")], "must not lie under")]:
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *arguments], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_site_folder_follows_the_inherited_path(tmp_path):
    path = with_site(tmp_path, {"PYTHONPATH": "/somewhere"})["PYTHONPATH"].split(os.pathsep)
    assert path == [str(ROOT), "/somewhere", str(tmp_path / "site")]


def test_requirements_list_only_what_the_image_lacks():
    """N1: listing an image package makes pip resolve against the image's torch tree offline."""
    from packaging.requirements import Requirement

    wanted = wheelhouse.requirements()
    assert {"torch", "numpy", "safetensors"} <= {r.name for r in wanted}
    listed = {Requirement(line).name for line in wheelhouse.install_list(wanted).splitlines()}
    assert {"jsonschema", "typer", "rich", "pytest"} <= listed
    assert not [name for name in listed if wheelhouse.on_image(name)]


def test_a_requirements_file_naming_an_image_package_is_a_problem(tmp_path):
    (tmp_path / wheelhouse.MANIFEST).write_text(json.dumps({"wheels": [], "requirements": []}))
    (tmp_path / wheelhouse.REQUIREMENTS).write_text("typer>=0.9\ntorch>=2.4\n")
    assert wheelhouse.check(tmp_path) == [f"{wheelhouse.REQUIREMENTS} lists torch, which the image has: pip would "
                                          f"resolve against its tree"]


def _result(steps, error=None):
    from types import SimpleNamespace

    from ignition.catalog.abi import TokenEntry

    return SimpleNamespace(error=error, prompt_entries=None,
                           entries=[TokenEntry(chosen, dict(top)[chosen], top) for chosen, top in steps])


def test_the_bf16_comparison_allows_a_near_tie_and_two_ulps_and_nothing_more():
    u = LOW_PRECISION_TOLERANCE / 2
    cpu = [_result([(3, [(3, -1.0), (5, -1.0 - u)]), (7, [(7, -0.5), (1, -2.0)])])]
    near = [_result([(3, [(3, -1.0 + 2 * u), (5, -1.0)]), (7, [(7, -0.5), (1, -2.0)])])]
    assert compare_low_precision(near, cpu)[0]
    parted = [_result([(5, [(5, -1.0), (3, -1.0)]), (9, [(9, -0.1)])])]  # 5 is a near tie on the CPU
    ok, detail, _ = compare_low_precision(parted, cpu)
    assert ok and "1 requests parted" in detail
    far = [_result([(3, [(3, -1.0 + 3 * u), (5, -1.0)]), (7, [(7, -0.5), (1, -2.0)])])]
    assert not compare_low_precision(far, cpu)[0]
    not_a_tie = [_result([(3, [(3, -1.0)]), (1, [(1, -0.5)])])]  # 1 is 1.5 below 7 on the CPU
    ok, detail, _ = compare_low_precision(not_a_tie, cpu)
    assert not ok and "not a near tie" in detail
    assert not compare_low_precision([_result([], error="boom")], cpu)[0]


def test_the_cuda_test_files_and_their_helpers_are_scanned():
    scanned = {path.name for path, _ in imports.scanned_files()}
    assert {"test_cuda_replay.py", "test_triton_vocabulary.py", "_decoder_cores.py", "_triton_vocabulary_check.py",
            "conftest.py", "gpu_check.py", "make_tiny_qwen3.py"} <= scanned
    assert "test_server.py" not in scanned


@pytest.fixture(scope="module")
def manifest() -> dict:
    if not (wheelhouse.DEFAULT_DIR / wheelhouse.MANIFEST).is_file():
        pytest.skip("build/wheelhouse is absent: run `make gpu-wheelhouse`")
    return wheelhouse.read_manifest(wheelhouse.DEFAULT_DIR)


def test_the_wheelhouse_installs_on_every_cpython_and_fits(manifest):
    assert manifest["pythons"] == ["3.10", "3.11", "3.12", "3.13"]
    assert wheelhouse.check(wheelhouse.DEFAULT_DIR) == []
    assert manifest["total_bytes"] <= 64 * 2**20
    carried = {w["name"] for w in manifest["wheels"]}
    assert not carried & {"torch", "triton", "cuda-bindings", "numpy"}
    assert not [name for name in carried if name.startswith("nvidia-")]


def test_the_wheelhouse_covers_every_import_the_gpu_steps_make(manifest):
    assert imports.coverage_problems(manifest) == []
    mapped, unknown = imports.needed_distributions()
    assert unknown == [] and {"jsonschema", "typer", "rich", "fastapi", "pytest"} <= set(mapped)


def test_a_missing_dependency_is_found_per_python_version(manifest, tmp_path):
    """The closure check evaluates markers per version: tomli only matters on 3.10."""
    for wheel in manifest["wheels"]:
        os.symlink(wheelhouse.DEFAULT_DIR / wheel["file"], tmp_path / wheel["file"])
    (tmp_path / wheelhouse.REQUIREMENTS).write_text("")
    pruned = dict(manifest, wheels=[w for w in manifest["wheels"] if w["name"] != "tomli"])
    (tmp_path / wheelhouse.MANIFEST).write_text(json.dumps(pruned))
    (tmp_path / next(w["file"] for w in manifest["wheels"] if w["name"] == "tomli")).unlink()
    problems = wheelhouse.check(tmp_path, verify_hashes=False)
    assert problems and all(p.startswith("CPython 3.10: ") and "tomli" in p for p in problems)


def test_the_dry_run_passes_without_exporting(manifest, tmp_path):
    """`make gpu-check DRY=1` less the core exports (a minute or more here): plan, wheelhouse, coverage, imports."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--no-export", "--cores",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and done.stdout.strip().endswith("dry run: ok"), done.stdout + done.stderr
    assert "[ok] the budgets sum to" in done.stdout and "[FAIL]" not in done.stdout
