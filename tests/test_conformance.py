"""docs/conformance.md cannot rot: every row's code and tests exist, statuses carry their evidence, counts add up."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "conformance.md"
STATUSES = ("implemented+tested", "implemented", "partial", "missing", "contradicted")
REF = re.compile(r"`([^`]+?)::([A-Za-z_][A-Za-z0-9_.]*)`")


def block(name: str) -> list[list[str]]:
    """Rows (cells stripped) of the table between ``<!-- BEGIN name -->`` and ``<!-- END name -->``."""
    match = re.search(rf"<!-- BEGIN {name} -->\n(.*?)<!-- END {name} -->", DOC.read_text(), re.S)
    assert match, f"docs/conformance.md lacks the {name} block"
    lines = [line for line in match.group(1).splitlines() if line.startswith("|")][2:]  # header and rule
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def statements() -> list[dict]:
    rows = []
    for cells in block("STATEMENTS"):
        assert len(cells) == 7, cells
        number, statement, status, before, code, test, note = cells
        rows.append({"number": int(number), "statement": statement, "status": status, "before": before or status,
                     "code": REF.findall(code), "test": REF.findall(test), "code_cell": code, "test_cell": test,
                     "note": note})
    return rows


@cache
def defined_names(path: str) -> frozenset[str]:
    """Top-level functions, classes and assignments, plus ``Class.method`` and ``Class.attribute``."""
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(f"{node.name}.{member.target.id}")
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


ROWS = statements()


def test_rows_are_numbered_in_order_and_statuses_are_known():
    assert [row["number"] for row in ROWS] == list(range(1, len(ROWS) + 1))
    for row in ROWS:
        assert row["status"] in STATUSES and row["before"] in STATUSES, row


@pytest.mark.parametrize("row", ROWS, ids=[str(row["number"]) for row in ROWS])
def test_row_names_code_and_tests_that_exist(row):
    for kind, refs, cell in (("code", row["code"], row["code_cell"]), ("test", row["test"], row["test_cell"])):
        assert cell == "-" or len(refs) == cell.count("`") // 2, f"row {row['number']}: unparsable {kind} cell {cell!r}"
        for path, name in refs:
            assert (ROOT / path).is_file(), f"row {row['number']}: {kind} file {path} does not exist"
            assert name in defined_names(path), f"row {row['number']}: {path} defines no {name}"
            if kind == "test":
                assert path.startswith("tests/test_") and name.startswith("test_"), (row["number"], path, name)
            else:
                assert not path.startswith("tests/"), f"row {row['number']}: code must not point into tests/"


@pytest.mark.parametrize("row", ROWS, ids=[str(row["number"]) for row in ROWS])
def test_status_carries_its_evidence(row):
    status, code, test = row["status"], row["code"], row["test"]
    if status == "implemented+tested":
        assert code and test, f"row {row['number']}: implemented+tested needs code and a test"
    elif status == "implemented":
        assert code and not test, f"row {row['number']}: a tested row is implemented+tested"
    elif status == "partial":
        assert code and row["note"], f"row {row['number']}: partial rows name code and say what is missing"
    elif status == "missing":
        assert not code and not test and row["note"], f"row {row['number']}: missing rows only say why"


def test_counts_agree_with_the_rows():
    counts = {cells[0]: (int(cells[1]), int(cells[2])) for cells in block("COUNTS")}
    for status in STATUSES:
        now = sum(row["status"] == status for row in ROWS)
        before = sum(row["before"] == status for row in ROWS)
        assert counts[status] == (before, now), status
    assert counts["total"] == (len(ROWS), len(ROWS))
    assert counts["contradicted"][1] == 0, "the code contradicts the specification"


def test_parser_catches_a_rotten_reference():
    assert "reduce_emitted_logprobs" in defined_names("ignition/components/commit.py")
    assert "OutputProcessor._decode_lane" in defined_names("ignition/runtime/outputs.py")
    assert "PAYLOAD_MASK" not in defined_names("ignition/catalog/abi.py")
    assert REF.findall("`tests/test_x.py::test_y`, `a/b.py::C.d`") == [("tests/test_x.py", "test_y"), ("a/b.py", "C.d")]
