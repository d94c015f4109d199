"""``pytest -m cuda`` over the test files that hold cuda-marked tests, its return code enforced.

Only those files are collected: the rest of the suite is deselected by ``-m cuda`` anyway, and collecting it
would need its every import (schemathesis, openai, ...) on the image. The junit report gives the counts;
a test skipped for want of CUDA fails the step, since on this machine that means the GPU went unseen.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu.record import ROOT, step_main

CUDA_MARK = re.compile(r"pytest\.mark\.cuda\b")
NO_CUDA_SKIP = "needs a CUDA GPU"  # tests/conftest.py's skip reason


def cuda_test_files(tests: Path = ROOT / "tests") -> list[Path]:
    """Every ``test_*.py`` under ``tests`` that marks a test (or itself) with ``pytest.mark.cuda``."""
    return sorted(p for p in tests.glob("test_*.py") if CUDA_MARK.search(p.read_text()))


def run(context, record) -> None:
    files = cuda_test_files()
    if not record.check("test files with cuda-marked tests are found", bool(files), str(ROOT / "tests")):
        return
    report = context.work / "pytest-cuda.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={report}", *(str(p.relative_to(ROOT)) for p in files)]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT)  # output straight into the step's log
    record.check("pytest -m cuda exits 0", done.returncode == 0, f"exit {done.returncode}")
    if not record.check("pytest wrote its junit report", report.is_file(), str(report)):
        return
    suites = ET.parse(report).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    record.metric("pytest", counts)
    ran = counts["tests"] - counts["skipped"]
    record.check("at least one cuda test ran", ran > 0, f"{counts}")
    unseen = [case.get("name") for case in ET.parse(report).iter("testcase")
              if any(NO_CUDA_SKIP in (skip.get("message") or "") for skip in case.iter("skipped"))]
    record.check("no test skipped for want of CUDA", not unseen, ", ".join(unseen[:10]))


if __name__ == "__main__":
    step_main(run)
