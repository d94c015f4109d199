"""Semantic rules of the structured-output inputs (``catalog.buffers.CONSTRAINT_INPUTS``).

A core either declares the token bitmask and the sparse logit bias in every variant of a constrained operation
(``catalog.buffers.CONSTRAINED_OPERATIONS``: one sampled position per lane) and nowhere else, or declares them
nowhere: then it loads and serves, and the server refuses structured requests. ``features.structured_output``
says which; a core written before the feature existed omits it (false).
"""

from __future__ import annotations

from ignition.catalog import buffers as B
from ignition.catalog.buffers import BUFFERS, CONSTRAINED_OPERATIONS, resolve_shape, shape_expression
from ignition.catalog.contract import bitmask_words
from ignition.catalog.model import lane_count
from ignition.validate.report import Violation

CONSTRAINT_NAMES = tuple(spec.name for spec in B.CONSTRAINT_INPUTS)
FEATURE = "structured_output"
FEATURE_DEFAULT = False  # a manifest written before the feature existed omits it


def declares_constraints(variant: dict) -> bool:
    """Whether a catalog variant declares the token bitmask."""
    return any(a["name"] == B.TOKEN_BITMASK for a in variant["arguments"])


def check_variant_constraints(variant: dict, args: dict, manifest: dict) -> list[Violation]:
    """CONSTRAINT-PARTIAL and the table's role, dtype and shape (CONSTRAINT-WORDS for the bitmask's words)."""
    where = f"variant {variant['name']}"
    present = [name for name in CONSTRAINT_NAMES if name in args]
    if not present:
        return []
    found = []
    if len(present) != len(CONSTRAINT_NAMES):
        absent = [name for name in CONSTRAINT_NAMES if name not in args]
        found.append(Violation("CONSTRAINT-PARTIAL", where, f"declares {', '.join(present)} without "
                               f"{', '.join(absent)}; the structured-output inputs come together"))
    if variant["operation"] not in {int(op) for op in CONSTRAINED_OPERATIONS} or B.RECORDS not in args:
        found.append(Violation("CONSTRAINT-PARTIAL", where, f"declares {', '.join(present)}, but only the sampling "
                               f"variants of {', '.join(op.name for op in CONSTRAINED_OPERATIONS)} take them"))
    lanes = lane_count(variant["operation"], variant["capacity"])
    words = bitmask_words(manifest["vocab_padded"])
    for name in present:
        spec, decl = BUFFERS[name], args[name]
        at = f"{where}: buffer {name}"
        if decl["role"] != spec.role.name.lower():
            found.append(Violation("BUF-ROLE", at, f"expected role {spec.role.name.lower()}, found {decl['role']}"))
        if decl["dtype"] != spec.dtype:
            found.append(Violation("BUF-DTYPE", at, f"expected dtype {spec.dtype}, found {decl['dtype']}"))
        expected = resolve_shape(spec, capacity=lanes, VOCAB_WORDS=words)
        if decl["shape"] != expected:
            rule = "BUF-SHAPE"
            if len(decl["shape"]) == len(expected):
                rule = "BUF-CAPACITY" if decl["shape"][0] != expected[0] else (
                    "CONSTRAINT-WORDS" if name == B.TOKEN_BITMASK else "BUF-SHAPE")
            found.append(Violation(rule, at, f"expected shape {expected} {shape_expression(spec)} with capacity="
                                   f"{lanes}, VOCAB_WORDS=ceil(vocab_padded {manifest['vocab_padded']} / 32)={words}; "
                                   f"found {decl['shape']}"))
    return found


def check_catalog_constraints(manifest: dict, variants: list[dict]) -> list[Violation]:
    """CONSTRAINT-ALL across the catalog, and ``features.structured_output`` (FEAT-MISMATCH)."""
    constrained = [v for v in variants if v["operation"] in {int(op) for op in CONSTRAINED_OPERATIONS}]
    declaring = [v["name"] for v in constrained if declares_constraints(v)]
    found = []
    if declaring and len(declaring) != len(constrained):
        missing = [v["name"] for v in constrained if v["name"] not in declaring]
        found.append(Violation("CONSTRAINT-ALL", "catalog.json", f"{', '.join(declaring)} declare the "
                               f"structured-output inputs but {', '.join(missing)} do not; a core declares them in every "
                               f"{'/'.join(op.name for op in CONSTRAINED_OPERATIONS)} variant or in none"))
    implied = bool(declaring)
    stated = manifest["features"].get(FEATURE, FEATURE_DEFAULT)
    if stated != implied:
        found.append(Violation("FEAT-MISMATCH", f"manifest.json:features.{FEATURE}",
                               f"catalog implies {implied!r}, found {stated!r}"))
    return found


__all__ = ["check_catalog_constraints", "check_variant_constraints", "declares_constraints"]
