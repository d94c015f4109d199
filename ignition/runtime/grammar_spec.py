"""Structured-output request fields -> a ``GrammarSpec`` (what to compile), with no grammar engine involved.

``grammar_spec(response_format=..., structured_outputs=...)`` reads OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``strict``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar`` in Lark or GBNF/EBNF, ``json_object``, with ``disable_any_whitespace``,
``whitespace_pattern`` and ``disable_additional_properties``). A field of the wrong shape raises ``GrammarError``
naming it; ``runtime/grammar.py`` compiles the spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class GrammarError(ValueError):
    """A structured-output spec the engine cannot compile or a request field of the wrong shape (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, constructs: tuple[str, ...] = ()):
        super().__init__(message)
        self.param, self.constructs = param, constructs


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: ``kind`` json | json_object | regex | choice | grammar; ``source`` its canonical text
    (compact JSON for json and choice, in the caller's key order: property order is output order)."""

    kind: str
    source: str
    param: str  # the request field errors name
    whitespace_flexible: bool = True
    whitespace_pattern: str | None = None

    @property
    def key(self) -> tuple:
        return self.kind, self.source, self.whitespace_flexible, self.whitespace_pattern


def _canonical(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed_objects(schema):
    """vLLM's ``disable_additional_properties``: every object schema without ``additionalProperties`` gets false.
    Walks subschemas only (``const``, ``enum`` and ``default`` are data and stay as written)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            closed[key] = [_closed_objects(s) for s in schema[key]] if isinstance(schema[key], list) \
                else _closed_objects(schema[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_closed_objects(s) for s in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed_objects(s) for name, s in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _json_schema(schema, param: str, closed: bool = False) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    return _canonical(_closed_objects(schema) if closed else schema)


def _response_format_spec(response_format: dict) -> GrammarSpec | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", _canonical({"type": "object"}), "response_format")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            raise GrammarError("response_format.json_schema must be an object with a schema", "response_format")
        schema = body.get("schema", body.get("json_schema"))  # vLLM accepts either spelling
        if schema is None:
            raise GrammarError("response_format.json_schema.schema is required", "response_format")
        if not isinstance(body.get("strict", False), (bool, type(None))):
            raise GrammarError("response_format.json_schema.strict must be a boolean", "response_format")
        # NOTE: like vLLM, the schema is enforced whatever `strict` says: the grammar is the only way to honour it.
        return GrammarSpec("json", _json_schema(schema, "response_format.json_schema.schema"), "response_format")
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       "response_format")


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _structured_outputs_spec(options: dict) -> GrammarSpec | None:
    chosen = [kind for kind in _KINDS if options.get(kind) not in (None, False)]
    if len(chosen) > 1:
        raise GrammarError(f"structured_outputs sets {', '.join(chosen)}; use one kind of constraint",
                           "structured_outputs")
    if not chosen:
        return None
    kind, value = chosen[0], options[chosen[0]]
    param = f"structured_outputs.{kind}"
    flexible = not options.get("disable_any_whitespace", False)
    pattern = options.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise GrammarError("structured_outputs.whitespace_pattern must be a string", "structured_outputs")
    if kind == "structural_tag":
        raise GrammarError("structured_outputs.structural_tag is not supported by this server; use json, regex, "
                           "choice or grammar", param, ("structural_tag",))
    if kind == "json_object":
        return GrammarSpec("json_object", _canonical({"type": "object"}), param, flexible, pattern)
    if kind == "json":
        source = _json_schema(value, param, closed=bool(options.get("disable_additional_properties", False)))
        return GrammarSpec("json", source, param, flexible, pattern)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec("choice", _canonical(value), param)
    if not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{param} must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


def grammar_spec(response_format: dict | None = None, structured_outputs: dict | None = None) -> GrammarSpec | None:
    """The request's constraint, or None. Both fields set (with a non-text response_format) is an error."""
    if response_format is not None and not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object", "response_format")
    if structured_outputs is not None and not isinstance(structured_outputs, dict):
        raise GrammarError("structured_outputs must be an object", "structured_outputs")
    from_format = _response_format_spec(response_format) if response_format else None
    from_options = _structured_outputs_spec(structured_outputs) if structured_outputs else None
    if from_format is not None and from_options is not None:
        raise GrammarError("response_format and structured_outputs both constrain the output; use one",
                           "structured_outputs")
    return from_format or from_options


__all__ = ["GrammarError", "GrammarSpec", "grammar_spec"]
