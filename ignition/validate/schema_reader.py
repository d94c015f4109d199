"""A faster reader of torch.export's program JSON: ``_dict_to_dataclass`` with each schema class planned once.

NOTE: ``torch.export.load`` turns the archive's JSON into the export schema's dataclasses with
``torch._export.serde.serialize._dict_to_dataclass``, which re-inspects the target class on every JSON
object (``typing.get_origin``, ``dataclasses.fields``, type hints): about half of a core's load time
(7.0 s of 14.3 s for the tiny example's five graphs under cProfile). ``SchemaReader`` is the same
function with each class's plan (its fields and their converters) built once and reused: the same
dataclasses from the same JSON (tests/test_schema_reader.py compares them on every graph of a core).
It is installed only on a torch whose ``_dict_to_dataclass`` source is the one it was written against
(``KNOWN_SOURCES``); any other torch keeps its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import types
import typing
from typing import Annotated

KNOWN_SOURCES = frozenset({
    "caf63dd8c94356b17f6913ad42863b1eb95a3f5c7ed0e4b5a976230012cfbf5a",  # torch 2.13.0
})
"""sha256 of ``inspect.getsource(serialize._dict_to_dataclass)`` of the torch versions ``read`` matches."""


class SchemaReader:
    """``_dict_to_dataclass(cls, data)`` for one schema module, with a converter per class built once."""

    def __init__(self, schema, union_base, replaced=None):
        self._schema, self._namespace, self._union_base = schema, vars(schema), union_base
        self._converters: dict = {}
        self.replaced = replaced  # the function ``install`` replaced (the tests' oracle)

    def __call__(self, cls, data):
        return self.converter(cls)(data)

    def converter(self, cls):
        key = (cls, typing.get_args(cls))  # Union[X, None] == Union[None, X], but torch reads its first argument
        try:
            return self._converters[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable annotation: planned on every use, as torch does
            return lambda data: self._build(cls)(data)
        converter = self._converters[key] = self._build(cls)
        return converter

    def _resolve(self, cls):
        if isinstance(cls, str):
            resolved = getattr(self._schema, cls, None)
            if resolved is not None:
                return resolved
        if isinstance(cls, typing.ForwardRef):
            return self._resolve(cls.__forward_arg__)
        return cls

    def _build(self, cls):
        cls = self._resolve(cls)
        if isinstance(cls, str):
            raise AssertionError(f"Unresolved class type: '{cls}'.")
        origin = typing.get_origin(cls)
        if origin is Annotated:
            return self._deferred(cls.__origin__)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
            arguments = typing.get_args(cls)
            inner = self._deferred(arguments[0])

            def optional(data):
                if data is None:
                    return None
                if len(arguments) != 2:
                    raise AssertionError(f"expected 2 type args, got {len(arguments)}")
                return inner(data)
            return optional
        if isinstance(cls, type) and issubclass(cls, self._union_base):
            return self._union(cls)
        if dataclasses.is_dataclass(cls):
            return self._dataclass(cls)
        return lambda data: self._generic(cls, data)

    def _deferred(self, cls):
        """The converter of ``cls``, looked up on first use (schema types refer to each other)."""
        found = None

        def convert(data):
            nonlocal found
            if found is None:
                found = self.converter(cls)
            return found(data)
        return convert

    def _union(self, cls):
        hints = typing.get_type_hints(cls, globalns=self._namespace)
        tags: dict = {}

        def convert(data):
            if not isinstance(data, dict):
                raise AssertionError(f"expected dict, got {type(data).__name__}")
            if len(data) != 1:
                raise AssertionError(f"expected dict with 1 key, got {len(data)}")
            ((tag, value),) = data.items()
            if not isinstance(tag, str):
                raise AssertionError(f"expected str key, got {type(tag).__name__}")
            inner = tags.get(tag)
            if inner is None:
                inner = tags[tag] = self._deferred(hints[tag])
            return cls.create(**{tag: inner(value)})
        return convert

    def _dataclass(self, cls):
        plan = None

        def convert(data):
            nonlocal plan
            if plan is None:
                hints = typing.get_type_hints(cls, globalns=self._namespace)
                plan = [(field.name, self._deferred(hints[field.name])) for field in dataclasses.fields(cls)]
            return cls(**{name: inner(data[name]) for name, inner in plan if name in data})
        return convert

    def _generic(self, cls, data):
        if isinstance(data, list):
            if len(data) == 0:
                return data
            inner = self.converter(typing.get_args(cls)[0])
            return [inner(item) for item in data]
        if isinstance(data, dict):
            inner = self.converter(typing.get_args(cls)[1])
            return {key: inner(value) for key, value in data.items()}
        if cls is float:
            return float(data)
        return data


@functools.cache
def install() -> bool:
    """Replace torch's ``_dict_to_dataclass`` with a ``SchemaReader`` where its source is a known one; returns
    whether the reader is installed. Decided once a process: every graph load calls it."""
    try:
        from torch._export.serde import schema, serialize
        from torch._export.serde.union import _Union
    except ImportError:
        return False
    current = serialize._dict_to_dataclass
    if isinstance(current, SchemaReader):
        return True
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError):
        return False
    if hashlib.sha256(source.encode()).hexdigest() not in KNOWN_SOURCES:
        return False
    serialize._dict_to_dataclass = SchemaReader(schema, _Union, replaced=current)
    return True
