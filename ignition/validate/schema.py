"""JSON Schema (draft 2020-12) checks against the schemas shipped in ignition/schemas."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from ignition.validate.report import Violation

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
    validator = Draft202012Validator(schemas[schema_name], registry=registry)
    found = []
    for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path))):
        path = "/".join(str(p) for p in error.absolute_path) or "(root)"
        found.append(Violation("SCHEMA", f"{where}:{path}", error.message[:300]))
    return found
