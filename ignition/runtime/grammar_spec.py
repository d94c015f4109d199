"""Structured-output request fields -> a ``GrammarSpec`` (what to compile), with no grammar engine involved.

``grammar_spec(response_format=..., structured_outputs=...)`` reads OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``strict``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar`` in Lark or GBNF/EBNF, ``json_object``, with ``disable_any_whitespace``,
``whitespace_pattern`` and ``disable_additional_properties``). The whitespace options apply to ``response_format``
too, and a server default can disable any whitespace; JSON Schema objects are closed as vLLM's default backend
closes them (``_closed_objects``). A field of the wrong shape raises ``GrammarError`` naming it;
``runtime/grammar.py`` compiles the spec.
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


# vLLM's guidance backend walks these (vllm/v1/structured_output/backend_guidance.py,
# _walk_json_for_additional_properties): maps of subschemas, then subschemas and lists of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "anyOf",
               "oneOf")
# NOTE: not allOf: its members describe one object together (xgrammar's strict mode is unevaluatedProperties:
# false, which counts the properties of every member), so closing each would make their intersection unsatisfiable


def _closed_objects(schema):
    """Every object schema that lists ``properties`` or ``patternProperties`` and says nothing of
    ``additionalProperties`` gets ``additionalProperties: false``; an object schema without either keeps taking
    any object. This is what vLLM's default backend does: xgrammar compiles JSON Schema in ``strict_mode`` (its
    default, "will not allow properties and items that is not specified in the schema", xgrammar
    python/xgrammar/compiler.py ``compile_json_schema``), and vLLM's ``disable_additional_properties`` makes its
    guidance backend match it with this walk (vllm/v1/structured_output/backend_guidance.py). llguidance alone
    would allow extra properties. Walks subschemas only (``const``, ``enum`` and ``default`` are data), and not
    into ``allOf``, whose members together describe one object."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed_objects(s) for name, s in schema[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), dict | list):
            closed[key] = _closed_objects(schema[key])
    if "additionalProperties" not in schema and (isinstance(schema.get("properties"), dict)
                                                 or isinstance(schema.get("patternProperties"), dict)):
        closed["additionalProperties"] = False
    return closed


def whitespace_options(structured_outputs: dict | None, disable_any_whitespace: bool = False) -> tuple[bool, str | None]:
    """(whitespace_flexible, whitespace_pattern) of a request: ``structured_outputs.disable_any_whitespace`` when the
    request sets it, else the server's default (``--structured-outputs-config``), and its ``whitespace_pattern``.
    They shape every JSON the grammar engine writes: ``response_format``, ``structured_outputs.json`` and
    ``json_object``, and the arguments of enforced tool calls."""
    options = structured_outputs or {}
    disable = options.get("disable_any_whitespace")
    if disable is not None and not isinstance(disable, bool):
        raise GrammarError("structured_outputs.disable_any_whitespace must be a boolean",
                           "structured_outputs.disable_any_whitespace")
    pattern = options.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise GrammarError("structured_outputs.whitespace_pattern must be a string",
                           "structured_outputs.whitespace_pattern")
    return not (disable_any_whitespace if disable is None else disable), pattern


def guidance_options(whitespace_flexible: bool, whitespace_pattern: str | None) -> dict:
    """The whitespace options as llguidance reads them, in a schema's ``x-guidance`` or as defaults."""
    options = {"whitespace_flexible": whitespace_flexible}
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    return options


def json_schema_object(schema, param: str):
    """A request's JSON Schema (an object, a boolean, or JSON text of one), with its objects closed as vLLM's
    default backend closes them (``_closed_objects``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        return _closed_objects(schema)
    except RecursionError:
        raise GrammarError(f"{param}: the schema nests too deep to read", param) from None


def _json_schema(schema, param: str) -> str:
    return _canonical(json_schema_object(schema, param))


def _response_format_spec(response_format: dict, flexible: bool, pattern: str | None) -> GrammarSpec | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", _canonical({"type": "object"}), "response_format", flexible, pattern)
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
        return GrammarSpec("json", _json_schema(schema, "response_format.json_schema.schema"), "response_format",
                           flexible, pattern)
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       "response_format")


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _structured_outputs_spec(options: dict, flexible: bool, pattern: str | None) -> GrammarSpec | None:
    chosen = [kind for kind in _KINDS if options.get(kind) not in (None, False)]
    if len(chosen) > 1:
        raise GrammarError(f"structured_outputs sets {', '.join(chosen)}; use one kind of constraint",
                           "structured_outputs")
    if not chosen:
        return None
    kind, value = chosen[0], options[chosen[0]]
    param = f"structured_outputs.{kind}"
    if kind == "structural_tag":
        raise GrammarError("structured_outputs.structural_tag is not supported by this server; use json, regex, "
                           "choice or grammar", param, ("structural_tag",))
    if kind == "json_object":
        return GrammarSpec("json_object", _canonical({"type": "object"}), param, flexible, pattern)
    if kind == "json":
        return GrammarSpec("json", _json_schema(value, param), param, flexible, pattern)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec("choice", _canonical(value), param)
    if not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{param} must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


def grammar_spec(response_format: dict | None = None, structured_outputs: dict | None = None,
                 disable_any_whitespace: bool = False) -> GrammarSpec | None:
    """The request's constraint, or None. Both fields set (with a non-text response_format) is an error; the
    whitespace options of ``structured_outputs`` (``whitespace_options``; ``disable_any_whitespace``: the server's
    default) apply to either."""
    if response_format is not None and not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object", "response_format")
    if structured_outputs is not None and not isinstance(structured_outputs, dict):
        raise GrammarError("structured_outputs must be an object", "structured_outputs")
    flexible, pattern = whitespace_options(structured_outputs, disable_any_whitespace)
    from_format = _response_format_spec(response_format, flexible, pattern) if response_format else None
    from_options = _structured_outputs_spec(structured_outputs, flexible, pattern) if structured_outputs else None
    if from_format is not None and from_options is not None:
        raise GrammarError("response_format and structured_outputs both constrain the output; use one",
                           "structured_outputs")
    return from_format or from_options


__all__ = ["GrammarError", "GrammarSpec", "grammar_spec", "guidance_options", "json_schema_object",
           "whitespace_options"]
