"""Publishing a core without losing data.

- ``--out`` is checked before any work: its parent must be writable, it must not hold the
  checkpoint or tokenizer the export reads, and an existing ``--out`` is replaced only with
  ``--overwrite`` and only when it is an Ignition core: its manifest.json matches the manifest
  schema and every file it lists is there with its recorded sha256, and the directory holds no file
  the manifest does not list (``manifest.json`` and ``signature.json`` aside): no FIFO, symbolic link or
  directory without a listed file either. Anything else may be a user's data and is refused.
- A replacement is two renames, and the old core is deleted only after the second:
  ``NAME -> .NAME.old-PID``, ``.NAME.partial-PID -> NAME``. A process that dies in between
  leaves ``NAME`` missing and the old core complete; the next export to ``NAME`` renames it back.
- Every such directory is claimed when this process creates it: a marker file
  ``.NAME.ignition-TOKEN`` beside it (a fresh random token) records the directory's name, device,
  inode and the process id. Only claimed directories of processes that no longer run (or of this
  process: one process exports one ``NAME`` at a time) are removed or restored, and only while they
  are still the very directory claimed; a user's ``.NAME.old-999999`` is never touched.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import MANIFEST_FILE, SIGNATURE_FILE

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)$")
_MARKER = ".{name}.ignition-"
_MAX_MARKER_BYTES = 4096


class PublishError(ValueError):
    """``--out`` cannot be created or replaced; the message names the path and why."""


def core_problem(path: Path) -> str | None:
    """Why ``path`` is not an Ignition core that ``--overwrite`` may replace; None when it is one."""
    from ignition.validate.files import METADATA_MAX_BYTES, check_files, read_core_file
    from ignition.validate.schema import parse_json, schema_violations

    data, unreadable = read_core_file(path, MANIFEST_FILE, "--out", METADATA_MAX_BYTES)  # a FIFO is not waited on
    if data is None:
        return f"no readable {MANIFEST_FILE} ({unreadable[0]})"
    manifest, problems = parse_json(data, MANIFEST_FILE)
    problems = problems or schema_violations(manifest, "manifest.schema.json", MANIFEST_FILE)
    if problems:
        return f"{MANIFEST_FILE} is not an Ignition manifest ({problems[0]})"
    listed = Manifest.from_json(manifest).files  # the schema holds: the typed view reads it
    found = check_files(path, listed, {})  # FILE-EXTRA names unlisted FIFOs and symbolic links too
    if found:
        return f"it does not hold exactly the files its manifest lists ({found[0]})"
    return _unlisted_directory(path, listed)


def _unlisted_directory(path: Path, listed) -> str | None:
    """A directory inside ``path`` that holds no listed file (an empty one, or one holding only other
    directories), which replacing the core would delete; None when every directory leads to a listed file."""
    needed = {parent.as_posix() for rel in listed for parent in Path(rel).parents}
    for folder, subfolders, _ in os.walk(path, followlinks=False):
        for name in subfolders:
            rel = (Path(folder) / name).relative_to(path).as_posix()
            if rel not in needed:
                return f"it holds the directory {rel!r}, which its manifest lists no file in"
    return None


def is_core(path: Path) -> bool:
    """Whether ``path`` is a complete Ignition core: a schema-valid manifest, every listed file with its
    sha256, and no file the manifest does not list."""
    return path.is_dir() and not path.is_symlink() and core_problem(path) is None


def _inside(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's own leftovers are from an earlier export that failed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    except (OverflowError, ValueError):
        return False
    return True


def _identity(path: Path) -> tuple[int, int]:
    status = os.lstat(path)
    return status.st_dev, status.st_ino


def claim(directory: Path, source: Path | None = None) -> Path:
    """Record that this process created ``directory`` (a ``.NAME.partial-PID`` or ``.NAME.old-PID``): a
    marker file beside it with a random token, its name, device, inode and this process id. ``source``:
    the directory that is about to be renamed to ``directory`` (a rename keeps the inode), claimed first
    so that no crash leaves an unclaimed retired core."""
    match = _LEFTOVER.match(directory.name)
    if match is None:
        raise ValueError(f"{directory} is not a staging or retired core directory name")
    device, inode = _identity(source or directory)
    marker = directory.parent / (_MARKER.format(name=match["name"]) + secrets.token_hex(16))
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump({"directory": directory.name, "device": device, "inode": inode, "pid": os.getpid()}, file)
    return marker


def _markers(out: Path) -> list[tuple[Path, dict]]:
    """(marker, record) of every well-formed claim beside ``out``."""
    prefix = _MARKER.format(name=out.name)
    found = []
    for entry in out.parent.iterdir() if out.parent.is_dir() else ():
        if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_file():
            continue
        try:
            record = json.loads(entry.read_bytes()[:_MAX_MARKER_BYTES])
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("directory"), str) \
                and all(isinstance(record.get(k), int) for k in ("device", "inode", "pid")):
            found.append((entry, record))
    return found


def _claimed(out: Path, record: dict) -> Path | None:
    """The claimed directory when it still exists as the very directory claimed, else None."""
    match = _LEFTOVER.match(record["directory"])
    if match is None or match["name"] != out.name or "/" in record["directory"]:
        return None
    path = out.parent / record["directory"]
    try:
        same = path.is_dir() and not path.is_symlink() and _identity(path) == (record["device"], record["inode"])
    except OSError:
        return None
    return path if same else None


def staging_dir(out: Path) -> Path:
    """A fresh, claimed ``.NAME.partial-PID`` beside ``out``; refuses one that exists and is not ours."""
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists() or staging.is_symlink():
        mine = any(_claimed(out, record) == staging for _, record in _markers(out))
        if not mine:
            raise PublishError(f"cannot create the core {out}: {staging} exists and was not created by an "
                               "Ignition export; remove or rename it yourself")
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        raise PublishError(f"cannot create the core {out}: {exc.strerror or exc} ({staging})") from None
    claim(staging)
    return staging


def refuse_replacing(out: Path, overwrite: bool) -> None:
    """Raise unless ``out`` is absent, or a complete Ignition core and ``overwrite`` is set."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise PublishError(f"{out} already exists; pass --overwrite to replace it")
    if out.is_symlink():
        raise PublishError(f"--overwrite refuses to replace {out}: it is a symbolic link, not a core directory")
    if not out.is_dir():
        raise PublishError(f"--overwrite refuses to replace {out}: it is a file but not an Ignition core; "
                           "remove it yourself")
    problem = core_problem(out)
    if problem is not None:
        raise PublishError(f"--overwrite refuses to replace {out}: it is a directory but not an Ignition core "
                           f"exactly as exported: {problem}; remove it yourself")


def check_output(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """Before any work: ``out`` can be created, holds none of ``inputs`` (label -> path), may be replaced."""
    resolved = out.resolve()
    if resolved == Path.cwd().resolve() or resolved == resolved.parent:
        raise PublishError(f"--out {out} is the current directory or the file system root; refusing to write "
                           "a core there (name a new directory)")
    for label, path in inputs.items():
        if path is not None and _inside(Path(path).resolve(), resolved):
            raise PublishError(f"--out {out} is the {label} {path} or holds it; refusing to write a core there")
    refuse_replacing(out, overwrite)
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PublishError(f"cannot create the core {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PublishError(f"cannot create the core {out}: {parent} is not writable")


def leftovers(out: Path) -> list[tuple[str, int, Path]]:
    """(kind, pid, path) of every claimed ``.NAME.partial-PID`` / ``.NAME.old-PID`` beside ``out``."""
    found = []
    for _, record in _markers(out):
        path = _claimed(out, record)
        if path is not None:
            match = _LEFTOVER.match(path.name)
            found.append((match["kind"], record["pid"], path))
    return found


def recover(out: Path) -> list[str]:
    """Finish what dead exports to ``out`` left: restore an old core whose replacement was cut off, then
    remove their claimed leftovers (and the claims). Returns what was done, one line each."""
    done = []
    stale = []
    for marker, record in _markers(out):
        if _pid_alive(record["pid"]):
            continue
        path = _claimed(out, record)
        kind = _LEFTOVER.match(path.name)["kind"] if path is not None else None
        stale.append((marker, kind, path))
    if not (out.exists() or out.is_symlink()):
        olds = [path for _, kind, path in stale if kind == "old" and is_core(path)]
        if olds:
            newest = max(olds, key=lambda p: p.stat().st_mtime)
            os.rename(newest, out)
            done.append(f"restored {out} from {newest.name} (an earlier replacement was interrupted)")
    for marker, _, path in stale:
        if path is not None and path.exists() and path != out:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}, left by a process that no longer runs")
        marker.unlink(missing_ok=True)
    return done


def _release(out: Path, directory: Path) -> None:
    """Remove this process's claims on ``directory`` (renamed into place or deleted)."""
    for marker, record in _markers(out):
        if record["directory"] == directory.name and record["pid"] == os.getpid():
            marker.unlink(missing_ok=True)


def discard(staging: Path, out: Path) -> None:
    """Remove this process's staging directory and its claim (an export that failed)."""
    if staging.exists() and any(_claimed(out, record) == staging for _, record in _markers(out)):
        shutil.rmtree(staging)
    _release(out, staging)


def _fsync(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk, so the renames that publish it publish data on disk:
    after a crash or power loss ``out`` is a whole core, never a name over empty files (delayed allocation). The
    export also leaves no writeback of its gigabytes behind for the next load to compete with."""
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                _fsync(path)
        _fsync(directory)


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory, flushed to disk (``sync_tree``), to ``out``; the old core stays
    reachable until then."""
    refuse_replacing(out, overwrite)  # again: ``out`` may have changed while the export ran
    sync_tree(staging)
    if not out.exists():
        os.rename(staging, out)
        _fsync(out.parent)
        _release(out, staging)
        return
    retired = out.parent / f".{out.name}.old-{os.getpid()}"
    if retired.exists() or retired.is_symlink():
        raise PublishError(f"cannot replace {out}: {retired} exists; remove or rename it yourself")
    claim(retired, source=out)
    os.rename(out, retired)
    os.rename(staging, out)  # a crash here leaves ``out`` missing; recover() restores ``retired``
    _fsync(out.parent)
    _release(out, staging)
    shutil.rmtree(retired)
    _release(out, retired)
