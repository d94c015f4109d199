"""Random mutations of a real core's JSON always get a clean verdict, never an exception."""

from __future__ import annotations

import json
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ignition.catalog.hashing import dump_json, sha256_file
from ignition.validate.core import validate_core
from ignition.catalog.rules import RULES

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, prefix + (index,))


def _apply(doc, path, action, value):
    if not path:
        return value if action == "replace" else doc
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "replace":
        parent[last] = value
    elif action == "insert" and isinstance(parent[last], dict):
        parent[last]["fuzz"] = value
    elif action == "insert" and isinstance(parent[last], list):
        parent[last].append(value)
    return doc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), target=st.sampled_from(["manifest.json", "catalog.json"]),
       action=st.sampled_from(["replace", "delete", "insert"]), value=json_values)
def test_random_json_mutations_are_rejected_cleanly(toy_core, tmp_path_factory, data, target, action, value):
    root = tmp_path_factory.mktemp("fuzz") / "core"
    shutil.copytree(toy_core, root)
    doc = json.loads((root / target).read_text())
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    doc = _apply(doc, path, action, value)
    (root / target).write_bytes(dump_json(doc))
    if target == "catalog.json":  # keep the hash honest so the semantic rules are reached
        manifest = json.loads((root / "manifest.json").read_text())
        if isinstance(manifest.get("files"), dict):
            manifest["files"]["catalog.json"] = sha256_file(root / "catalog.json")
            (root / "manifest.json").write_bytes(dump_json(manifest))
    report = validate_core(root, check_graphs=False)
    rules = {v.rule for v in report.violations}
    assert "VALIDATOR-ERROR" not in rules, report.violations
    assert rules <= set(RULES)
    shutil.rmtree(root.parent)
