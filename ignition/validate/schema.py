"""JSON Schema (draft 2020-12) checks against the schemas shipped in ignition/schemas."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from jsonschema import Draft202012Validator, validators
from referencing import Registry, Resource

from ignition.catalog.limits import MAX_JSON_DEPTH
from ignition.validate.report import Violation

_StrictValidator = validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool)))
"""Draft 2020-12 with one change: 1e18 or 250.0 is not an integer (the loader would use it as a float)."""

SCHEMA_FILES = ("buffer.schema.json", "manifest.schema.json", "catalog.schema.json", "kernels.schema.json",
                "signature.schema.json")


@cache
def _registry() -> tuple[Registry, dict[str, dict]]:
    schemas = {}
    package = resources.files("ignition.schemas")
    for name in SCHEMA_FILES:
        if package.joinpath(name).is_file():
            schemas[name] = json.loads(package.joinpath(name).read_text())
    registry = Registry().with_resources(
        (f"https://ignition.dev/schemas/{name}", Resource.from_contents(s)) for name, s in schemas.items())
    return registry, schemas


def schema_violations(document, schema_name: str, where: str) -> list[Violation]:
    registry, schemas = _registry()
    validator = _StrictValidator(schemas[schema_name], registry=registry)
    found = []
    for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path))):
        path = "/".join(str(p) for p in error.absolute_path) or "(root)"
        found.append(Violation("SCHEMA", f"{where}:{path}", error.message[:300]))
    return found


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def nesting_depth(document) -> int:
    """Levels of arrays and objects in ``document`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:  # deeper levels are rejected anyway
                stack += [(child, depth) for child in (value.values() if isinstance(value, dict) else value)]
    return deepest


def _unique_keys(pairs: list[tuple]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate keys {repeated[:5]} in one object (parsers disagree on which one counts)")
    return dict(pairs)


def parse_json(data: bytes, where: str):
    """(document, []) for strict UTF-8 JSON nested at most MAX_JSON_DEPTH levels, with no object repeating a
    key, else (None, [JSON-PARSE])."""
    try:
        document = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        return None, [Violation("JSON-PARSE", where, f"nested deeper than Python's parser allows; "
                                                     f"expected at most {MAX_JSON_DEPTH} levels")]
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, NaN/Infinity, >4300-digit integers
        return None, [Violation("JSON-PARSE", where, f"not UTF-8 JSON: {str(exc)[:200]}")]
    depth = nesting_depth(document)
    if depth > MAX_JSON_DEPTH:
        return None, [Violation("JSON-PARSE", where, f"expected at most {MAX_JSON_DEPTH} levels of nesting, "
                                                     f"found more than {MAX_JSON_DEPTH}")]
    return document, []
