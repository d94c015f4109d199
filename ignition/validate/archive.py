"""The safe ``.pt2`` reader: every byte ``torch.export.load`` would act on is checked first, by us.

``torch.export.load`` unpickles payloads (``torch.load(weights_only=False)`` for pickled
weights, constants and sample inputs, ``pickle.loads`` for opaque objects, the TorchScript
unpickler for custom objects), dlopens any ``data/aotinductor/`` package it finds, falls back
to a legacy zip reader on error, and later ``exec``s ``guards_code`` and ``sympify``s symbolic
expressions from the program JSON. Ignition graphs need none of that: they are static
programs of tensor arguments. So an archive is accepted only when

* its zip layout is plain (PT2-ARCHIVE): one root folder, stored members, no duplicate names,
  nothing before the first member or after the central directory;
* every member is on the allow-list of what ``torch.export.save`` writes for our graphs, with
  the content kind that name implies (PT2-MEMBER);
* no member is, or is configured to be read as, a pickle (PT2-PICKLE);
* the program is static, has only tensor inputs and calls only allowed operators (PT2-PROGRAM).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass

from ignition.validate.program_json import program_violations
from ignition.validate.report import Violation

_PICKLE_NAMES = (".pkl", ".pickle", ".pt", ".pth", ".bin")
_TEXT = {  # member -> the exact content it may hold
    "archive_format": re.compile(rb"pt2"),
    "archive_version": re.compile(rb"0"),
    "byteorder": re.compile(rb"little|big"),
    ".data/version": re.compile(rb"[0-9]{1,3}\n?"),
    ".data/serialization_id": re.compile(rb"[0-9]{1,64}"),
}
_REQUIRED = ("archive_format", "archive_version", "models/model.json")
_MODEL = "models/model.json"
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"  # written empty: the exporter strips example inputs
CONSTANTS_DIR = "data/constants/"
CONSTANTS_CONFIG = CONSTANTS_DIR + "model_constants_config.json"
_CONFIGS = {  # payload config -> (raw data folder, file-name prefix torch reads as raw tensor bytes)
    "data/weights/model_weights_config.json": ("data/weights/", "weight_"),
    CONSTANTS_CONFIG: (CONSTANTS_DIR, "tensor_"),
}
_MAX_JSON_BYTES = 256 << 20


def looks_pickled(data: bytes) -> bool:
    """A pickle (protocol 2+ opens with PROTO 0x80) or a ``torch.save`` zip (which holds data.pkl)."""
    return (len(data) >= 2 and data[0] == 0x80 and data[1] <= 5) or data[:4] == b"PK\x03\x04"


def check_archive(data: bytes, where: str) -> list[Violation]:
    """Violations of the ``.pt2`` allow-list; an empty list means torch.export.load may read ``data``."""
    return accept_archive(data, where)[0]


@dataclass(frozen=True, slots=True)
class AcceptedArchive:
    """What ``accept_archive`` read of an archive it accepted: the program JSON and every member's bytes by its
    name under the root folder (``data/constants/tensor_0``): what ``program_reader.read_program`` reads."""

    document: dict
    members: dict[str, bytes]


def accept_archive(data: bytes, where: str) -> tuple[list[Violation], AcceptedArchive | None]:
    """``check_archive``'s violations, and what it read of the archive (None when it refused it)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as exc:
        return [Violation("GRAPH-LOAD", where, f"not a readable zip archive: {exc}")], None
    found, root = _layout(archive, infos, data, where)
    if found:
        return found, None
    members: dict[str, bytes] = {}
    for info in infos:
        try:
            members[info.filename[len(root) + 1:]] = archive.read(info)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as exc:
            found.append(Violation("PT2-ARCHIVE", f"{where}: {info.filename}", f"member cannot be read: {exc}"))
    if found:
        return found, None
    read: dict = {}
    found = _members(members, where, read)
    return found, (AcceptedArchive(read[_MODEL], members) if not found else None)


def _layout(archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], data: bytes, where: str):
    """The zip-level checks; returns (violations, the single root folder)."""
    def bad(message: str) -> tuple[list[Violation], str]:
        return [Violation("PT2-ARCHIVE", where, message)], ""

    if not infos:
        return bad("expected the members torch.export.save writes, found an empty archive")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        return bad(f"duplicate member names {sorted({n for n in names if names.count(n) > 1})}: "
                   "readers disagree on which one counts")
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or any("/" not in n for n in names):
        return bad(f"expected every member under one root folder, found roots {sorted(roots)[:5]}")
    for info in infos:
        parts = info.filename.split("/")
        if "" in parts or ".." in parts or "\\" in info.filename or info.filename.startswith("/"):
            return bad(f"member name {info.filename!r} is not a plain relative path")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            return bad(f"member {info.filename!r} is compressed or encrypted; torch.export.save stores members")
    if min(i.header_offset for i in infos) != 0:
        return bad("bytes precede the first member (a polyglot or prepended payload)")
    if archive.comment or data[-22:-18] != b"PK\x05\x06":  # the 22-byte end record closes the file
        return bad("bytes follow the zip's end record")
    return [], roots.pop()


def _members(members: dict[str, bytes], where: str, read: dict) -> list[Violation]:
    found: list[Violation] = []
    raw_allowed: dict[str, str] = {}  # raw tensor member -> the config that declares it
    for name in _REQUIRED:
        if name not in members:
            found.append(Violation("PT2-MEMBER", where, f"expected member {name}, found none"))
    for name, (folder, prefix) in _CONFIGS.items():
        if name in members:
            found += _payload_config(members[name], folder, prefix, f"{where}: {name}", raw_allowed)
    for name, content in sorted(members.items()):
        at = f"{where}: {name}"
        if name in raw_allowed:
            continue  # raw tensor bytes, read with as_strided, never unpickled: any content is data
        if looks_pickled(content) or (name.endswith(_PICKLE_NAMES) and name != _SAMPLE_INPUTS):
            found.append(Violation("PT2-PICKLE", at, "expected no pickled member, found one"))
        elif name == _SAMPLE_INPUTS:
            if content:
                found.append(Violation("PT2-PICKLE", at, f"expected an empty sample-input record, found "
                                                         f"{len(content)} bytes that torch.load would unpickle"))
        elif name in _TEXT:
            if not _TEXT[name].fullmatch(content):
                found.append(Violation("PT2-MEMBER", at, f"expected {_TEXT[name].pattern.decode()!r}, "
                                                         f"found {content[:40]!r}"))
        elif name == _MODEL:
            document = _json(content, at, found)
            if document is not None:
                found += program_violations(document, at)
                read[name] = document
        elif name not in _CONFIGS:
            found.append(Violation("PT2-MEMBER", at, "not a member torch.export.save writes for an Ignition graph "
                                                     f"(allowed: {', '.join(sorted({*_TEXT, _MODEL, *_CONFIGS}))}, "
                                                     "raw tensors named by a payload config)"))
    return found


def _json(content: bytes, at: str, found: list[Violation]):
    if len(content) > _MAX_JSON_BYTES:
        found.append(Violation("PT2-MEMBER", at, f"expected JSON under {_MAX_JSON_BYTES} bytes, found {len(content)}"))
        return None
    try:
        return json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        found.append(Violation("PT2-MEMBER", at, f"expected UTF-8 JSON, found {type(exc).__name__}: {str(exc)[:120]}"))
        return None


def _payload_config(content: bytes, folder: str, prefix: str, at: str, raw: dict[str, str]) -> list[Violation]:
    """A weights/constants payload config: every entry is a raw tensor (``use_pickle`` false, a tensor
    meta, a ``weight_``/``tensor_`` file); custom and opaque objects, which torch unpickles, are refused."""
    found: list[Violation] = []
    if looks_pickled(content):
        return [Violation("PT2-PICKLE", at, "expected a JSON payload config, found a pickle")]
    document = _json(content, at, found)
    if document is None:
        return found
    entries = document.get("config") if isinstance(document, dict) else None
    if not isinstance(entries, dict) or set(document) != {"config"}:
        return [Violation("PT2-MEMBER", at, f"expected {{\"config\": {{...}}}}, found {str(document)[:80]}")]
    for fqn, meta in entries.items():
        entry = f"{at}: entry {fqn!r}"
        if not isinstance(meta, dict):
            found.append(Violation("PT2-MEMBER", entry, f"expected an object, found {type(meta).__name__}"))
            continue
        if meta.get("use_pickle") is not False:
            found.append(Violation("PT2-PICKLE", entry, f"expected use_pickle false, found {meta.get('use_pickle')!r}"))
        if not isinstance(meta.get("tensor_meta"), dict):
            found.append(Violation("PT2-MEMBER", entry, "expected a tensor_meta (a raw tensor's dtype and shape)"))
        path = meta.get("path_name")
        if isinstance(path, str) and re.fullmatch(rf"{prefix}[0-9]+", path):
            raw[folder + path] = at
        else:
            unpickled = isinstance(path, str) and path.startswith(("custom_obj_", "opaque_obj_"))
            found.append(Violation("PT2-PICKLE" if unpickled else "PT2-MEMBER", entry,
                                   f"expected a raw tensor file {prefix}<n>, found {path!r}"))
    return found
