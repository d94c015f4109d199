"""Graph rules: each .pt2 loads and really has the declared arguments, returns and mutations."""

from __future__ import annotations

import hashlib
import io
import logging
import operator
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from ignition.catalog.buffers import MIN_WINDOW, WINDOWS
from ignition.catalog.geometry import DYNAMIC_BLOCKS, PAGED_DIM, PAGED_STATE
from ignition.validate import schema_reader
from ignition.validate.allocations import allocation_violations
from ignition.validate.archive import accept_archive
from ignition.validate.files import GRAPH_MAX_BYTES, read_core_file
from ignition.validate.program_facts import ProgramFacts, program_facts
from ignition.validate.program_reader import ProgramReadError, read_program
from ignition.validate.report import Violation

_WRITES_EXPECTED = {"output", "state"}


def _extents(facts: ProgramFacts, shape, name: str, windows, paged: bool = False) -> list:
    """The argument's extents as declared: an int per static dim; the upper bound of the dim of a window the
    variant names (``layout["windows"]``, ``catalog.buffers.WINDOWS``) whose range is ``[MIN_WINDOW, bound]``;
    likewise the block count of a paged cache of a ``layout["dynamic_blocks"]`` variant (``paged``); anything else
    symbolic as its text, which no declaration matches."""
    extents = []
    for dim, extent in enumerate(shape):
        if isinstance(extent, int):
            extents.append(extent)
            continue
        bounds = facts.bounds.get(extent)
        windowed = (name in windows and name in WINDOWS and WINDOWS[name].dim == dim or paged and name in PAGED_STATE
                    and dim == PAGED_DIM) and bounds is not None and bounds[0] == MIN_WINDOW
        extents.append(bounds[1] if windowed and bounds[1] is not None else f"dynamic {extent}")
    return extents


def _mutated_placeholders(graph: torch.fx.Graph) -> set[str]:
    """Placeholders written by any node, following view chains back to their base (through ``getitem`` of the
    list a view operation such as ``unbind``, ``split`` or ``chunk`` returns)."""
    def base(node):
        while node.op == "call_function":
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
                node = node.args[0]  # one tensor of a list: the list's producer decides whether it aliases
                continue
            if not isinstance(node.target, torch._ops.OpOverload):
                break
            schema = node.target._schema
            first = schema.arguments[0] if schema.arguments else None
            if first is None or first.alias_info is None or first.alias_info.is_write:
                break
            node = node.args[0]
        return node

    written = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, torch.fx.Node):
                    written.add(base(value).name)
    return written


class _CachedSchemaHints(types.ModuleType):
    """``typing`` as torch's program deserializer sees it, with ``get_type_hints`` of the export schema's
    dataclasses computed once per class instead of once per JSON object.

    NOTE: ``torch.export.load`` spends most of its time re-resolving the same few dozen schema classes'
    annotations (pytorch/pytorch#196452; 12,689 lookups for one decode graph of the example core). The
    schema classes are immutable, so the cache returns exactly what the lookup would; any other caller
    (another ``globalns``, a ``localns``) goes to ``typing`` itself.
    """

    def __init__(self, schema_namespace: dict):
        super().__init__("typing")
        self._schema_namespace = schema_namespace
        self._hints: dict = {}

    def __getattr__(self, name):
        return getattr(typing, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if globalns is not self._schema_namespace or localns is not None:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, None, include_extras)
        return dict(hints)  # a copy, as typing returns: a caller may change it


def _cache_schema_hints() -> None:
    """Install ``_CachedSchemaHints`` in torch's deserializer once; torch versions that do not look hints
    up through the module ``typing`` (or have no such schema module) are left as they are."""
    try:
        from torch._export.serde import schema, serialize
    except ImportError:
        return
    if getattr(serialize, "typing", None) is typing:
        serialize.typing = _CachedSchemaHints(vars(schema))


def _load_accepted_program(data: bytes):
    """``torch.export.load`` of archive bytes that ``check_archive`` accepted (the caller's duty)."""
    if not schema_reader.install():  # the reader plans each class once itself; else cache torch's hint lookups
        _cache_schema_hints()
    export_log = logging.getLogger("torch.export")
    level = export_log.level
    export_log.setLevel(logging.ERROR)  # torch logs every deserialization failure at WARNING with a traceback
    try:
        return torch.export.load(io.BytesIO(data))
    finally:
        export_log.setLevel(level)


@dataclass(frozen=True)
class ReadAhead:
    """A graph file read and parsed before the validation that checks it (export-core reads each variant's
    archive as its capture worker finishes, on a core the other captures leave idle): the sha256 of the bytes
    read, what ``accept_archive`` refused of them, and the program ``read_program`` read (None when refused or
    unreadable; ``unreadable`` then says why). ``validate_core(read_ahead=...)`` uses it only where the
    manifest's digest of the file is this one, so what it checks is the bytes the digest covers."""

    sha256: str
    refused: list[Violation]
    program: object | None
    unreadable: str | None = None


def _where(variant: dict) -> str:
    return f"variant {variant['name']}: {variant['graph']}"


def _file_hash(variant: dict, expected: str, found: str) -> list[Violation]:
    return [Violation("FILE-HASH", variant["graph"], f"expected sha256 {expected}, found {found}")]


def read_ahead(path: Path, variant: dict) -> ReadAhead:
    """Read ``variant``'s graph file at ``path`` once: its digest, the archive checks and the program, as
    ``read_graph`` would."""
    data, refused = _graph_bytes(path, variant)
    if refused:
        return ReadAhead(hashlib.sha256(b"").hexdigest(), refused, None)
    refused, accepted = accept_archive(data, _where(variant))
    program, unreadable = (None, None) if refused else _program_of(accepted)
    return ReadAhead(hashlib.sha256(data).hexdigest(), refused, program, unreadable)


def _graph_bytes(path: Path, variant: dict) -> tuple[bytes, list[Violation]]:
    """The graph file's bytes, read only as a regular file under ``GRAPH_MAX_BYTES`` (``read_core_file``: a FIFO,
    a device or an oversized file is a FILE-REGULAR finding, never read)."""
    data, problems = read_core_file(path.parent, path.name, _where(variant), GRAPH_MAX_BYTES)
    return (b"", problems) if data is None else (data, [])


def _program_of(accepted) -> tuple[object | None, str | None]:
    """(the program ``read_program`` reads of an archive ``accept_archive`` accepted, None) or (None, why not)."""
    try:
        return read_program(accepted.document, accepted.members), None
    except ProgramReadError as exc:
        return None, str(exc)


def _accepted_bytes(path: Path, variant: dict, sha256: str | None):
    """(where, violations, the file's bytes, what ``accept_archive`` read of them): the file read once, its digest
    compared (FILE-HASH) and the archive checked by our own reader, all on the very bytes that are then loaded."""
    where = _where(variant)
    data, refused = _graph_bytes(path, variant)
    if refused:
        return where, refused, None, None
    if sha256 is not None and (found := hashlib.sha256(data).hexdigest()) != sha256:
        return where, _file_hash(variant, sha256, found), None, None
    refused, accepted = accept_archive(data, where)
    return where, refused, data, accepted


def check_graph(path: Path, variant: dict, sha256: str | None = None):
    """Check the archive with our own reader, then load the variant's program with ``torch.export.load`` and
    check it; returns (violations, program or None when it cannot or may not load). ``sha256``: the digest the
    manifest records for the file, checked on the very bytes that are then read and loaded (FILE-HASH)."""
    where, refused, data, _ = _accepted_bytes(path, variant, sha256)
    if refused:
        return refused, None
    try:
        program = _load_accepted_program(data)
    except Exception as exc:  # a corrupt archive can fail in many ways
        return [Violation("GRAPH-LOAD", where, f"torch.export.load failed: {type(exc).__name__}: {str(exc)[:200]}")], None
    return check_program(program, variant, where), program


def read_graph(path: Path, variant: dict, sha256: str | None = None, ahead: ReadAhead | None = None):
    """``check_graph`` as the runtime loads: the same archive checks and graph rules, with the program read by
    ``program_reader.read_program`` instead of ``torch.export.load`` (a ``StaticProgram``; GRAPH-LOAD names
    what it could not read). ``ahead``: the file as ``read_ahead`` read it, which the caller has matched to the
    manifest's digest; the file is then not read again."""
    where = _where(variant)
    if ahead is not None:
        if sha256 is not None and ahead.sha256 != sha256:
            return _file_hash(variant, sha256, ahead.sha256), None
        refused, program, unreadable = ahead.refused, ahead.program, ahead.unreadable
    else:
        where, refused, _, accepted = _accepted_bytes(path, variant, sha256)
        program, unreadable = (None, None) if refused else _program_of(accepted)
    if refused:
        return refused, None
    if program is None:
        return [Violation("GRAPH-LOAD", where, f"the program cannot be read: {unreadable}")], None
    return check_program(program, variant, where), program


def check_program(program, variant: dict, where: str) -> list[Violation]:
    """GRAPH-SIGNATURE, GRAPH-MUTATION and GRAPH-ALLOCATION of a loaded program (an ``ExportedProgram`` or the runtime reader's
    ``StaticProgram``) against its catalog entry."""
    facts = program_facts(program)
    declared = variant["arguments"]
    names = facts.argument_names
    if names is None:
        return [Violation("GRAPH-SIGNATURE", where, "expected one dict argument of named buffers")]
    found = []
    if names != [d["name"] for d in declared]:
        found.append(Violation("GRAPH-SIGNATURE", where, f"expected arguments {[d['name'] for d in declared]}, found {names}"))
        return found
    windows = variant["contract"]["layout"].get("windows") or ()
    paged = bool(variant["contract"]["layout"].get(DYNAMIC_BLOCKS))
    inputs = {d["name"] for d in declared if d["role"] == "input"}
    for name in windows:
        if name not in WINDOWS or name not in inputs:
            found.append(Violation("GRAPH-SIGNATURE", f"{where}: layout.windows",
                                   f"{name!r} is not a declared input with a window (expected one of "
                                   f"{sorted(set(WINDOWS) & inputs)})"))
        else:
            tensor = facts.inputs[[d["name"] for d in declared].index(name)][1]
            extent = tensor.shape[WINDOWS[name].dim] if tensor is not None else None
            if isinstance(extent, int):
                found.append(Violation("GRAPH-SIGNATURE", f"{where}: argument {name}",
                                       f"layout.windows names it, but the graph fixes its extent at {extent}"))
    for decl, (_, tensor) in zip(declared, facts.inputs):
        found_sig = (str(tensor.dtype).removeprefix("torch."),
                     _extents(facts, tensor.shape, decl["name"], windows, paged)) \
            if tensor is not None else None
        if found_sig != (decl["dtype"], decl["shape"]):
            found.append(Violation("GRAPH-SIGNATURE", f"{where}: argument {decl['name']}",
                                   f"expected {decl['dtype']} {decl['shape']}, found {found_sig}"))
    found_returns = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in facts.outputs if t is not None]
    expected_returns = [(r["dtype"], r["shape"]) for r in variant["returns"]]
    if found_returns != expected_returns:
        found.append(Violation("GRAPH-SIGNATURE", f"{where}: returns", f"expected {expected_returns}, found {found_returns}"))
    written = _mutated_placeholders(facts.graph)
    for decl, (node_name, _) in zip(declared, facts.inputs):
        writes = node_name in written
        if decl["role"] in _WRITES_EXPECTED and not writes:
            found.append(Violation("GRAPH-MUTATION", f"{where}: argument {decl['name']}",
                                   f"declared {decl['role']} but the graph never writes it"))
        elif decl["role"] not in _WRITES_EXPECTED and writes:
            found.append(Violation("GRAPH-MUTATION", f"{where}: argument {decl['name']}",
                                   f"declared {decl['role']} but the graph writes it"))
    return found + allocation_violations(facts, variant, where)
