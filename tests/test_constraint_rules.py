"""Validator rules of the structured-output inputs, on the session toy core mutated one rule at a time, and a
core exported without them (what every core written before the feature looks like)."""

from __future__ import annotations

import pytest

from ignition.catalog.buffers import BIAS_IDS, BIAS_VALUES, TOKEN_BITMASK
from ignition.catalog.enums import ValueSource
from ignition.catalog.rules import RULES
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.validate.core import validate_core

NAMES = (TOKEN_BITMASK, BIAS_IDS, BIAS_VALUES)


def rules_of(root, check_graphs=False) -> set[str]:
    report = validate_core(root, check_graphs=check_graphs)
    assert all(v.rule in RULES for v in report.violations), report.violations
    return {v.rule for v in report.violations}


def drop(variant: dict, names=NAMES) -> None:
    variant["arguments"] = [a for a in variant["arguments"] if a["name"] not in names]
    for name in names:
        variant["contract"]["bindings"].pop(name, None)


def argument(variant: dict, name: str) -> dict:
    return next(a for a in variant["arguments"] if a["name"] == name)


def test_exported_core_declares_the_feature(toy_core):
    assert rules_of(toy_core, check_graphs=True) == set()


def test_a_catalog_without_the_inputs_is_valid_with_the_feature_false_or_omitted(core_copy):
    core_copy.edit("catalog.json", lambda c: [drop(v) for v in c["variants"]])
    assert rules_of(core_copy.root) == {"FEAT-MISMATCH"}  # the manifest still says true
    core_copy.edit("manifest.json", lambda m: m["features"].update(structured_output=False))
    assert rules_of(core_copy.root) == set()
    core_copy.edit("manifest.json", lambda m: m["features"].pop("structured_output"))  # a core from before
    assert rules_of(core_copy.root) == set()


def test_feature_must_match_a_catalog_with_the_inputs(core_copy):
    core_copy.edit("manifest.json", lambda m: m["features"].pop("structured_output"))
    assert rules_of(core_copy.root) == {"FEAT-MISMATCH"}


def test_inputs_come_together(core_copy):
    core_copy.edit("catalog.json", lambda c: drop(core_copy.variant(c, "decode.c1"), (BIAS_VALUES,)))
    assert rules_of(core_copy.root) == {"CONSTRAINT-PARTIAL"}


def test_every_constrained_variant_or_none(core_copy):
    core_copy.edit("catalog.json", lambda c: drop(core_copy.variant(c, "decode.c4")))
    assert rules_of(core_copy.root) == {"CONSTRAINT-ALL"}


@pytest.mark.parametrize("field,value,rule", [
    ("shape", [4, 9], "CONSTRAINT-WORDS"),
    ("shape", [3, 8], "BUF-CAPACITY"),
    ("shape", [4, 8, 1], "BUF-SHAPE"),
    ("dtype", "int64", "BUF-DTYPE"),
])
def test_bitmask_declaration(core_copy, field, value, rule):
    core_copy.edit("catalog.json", lambda c: argument(core_copy.variant(c, "decode.c4"), TOKEN_BITMASK).update(
        {field: value}))
    assert rules_of(core_copy.root) == {rule}


def test_bias_declaration(core_copy):
    core_copy.edit("catalog.json", lambda c: argument(core_copy.variant(c, "prefill.t256"), BIAS_IDS).update(
        shape=[1, 299]))
    assert rules_of(core_copy.root) == {"BUF-SHAPE"}
    core_copy.edit("catalog.json", lambda c: argument(core_copy.variant(c, "prefill.t256"), BIAS_IDS).update(
        shape=[1, 300], role="output"))
    assert rules_of(core_copy.root) >= {"BUF-ROLE", "BIND-OUTPUT"}


@pytest.mark.parametrize("code,rule", [(int(ValueSource.LOGIT_BIAS_IDS), "BIND-SOURCE"), (max(ValueSource) + 1, "ENUM-SOURCE"),
                                       (None, "BIND-MISSING")])
def test_bitmask_binding(core_copy, code, rule):
    def change(catalog):
        bindings = core_copy.variant(catalog, "decode.c1")["contract"]["bindings"]
        if code is None:
            del bindings[TOKEN_BITMASK]
        else:
            bindings[TOKEN_BITMASK] = code
    core_copy.edit("catalog.json", change)
    assert rule in rules_of(core_copy.root)


def test_core_exported_without_the_feature_validates_and_loads(tmp_path):
    out = tmp_path / "plain"
    export_core(ExportOptions(recipe="toy", capacities=(2,), chunk_limit=16, structured_output=False), out)
    assert rules_of(out, check_graphs=True) == set()
    core = load_core(out)
    assert core.features["structured_output"] is False
    assert all(TOKEN_BITMASK not in variant.buffers for variant in core.variants.values())
