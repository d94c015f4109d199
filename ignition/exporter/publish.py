"""Publishing a core without losing data.

- ``--out`` is checked before any work: its parent must be writable, it must not hold the
  checkpoint or tokenizer the export reads, and an existing ``--out`` is replaced only with
  ``--overwrite`` and only when it is an Ignition core (its manifest.json parses and carries
  ``format_version``, ``catalog`` and ``files``).
- A replacement is two renames, and the old core is deleted only after the second:
  ``NAME -> .NAME.old-PID``, ``.NAME.partial-PID -> NAME``. A process that dies in between
  leaves ``NAME`` missing and the old core complete; the next export to ``NAME`` renames it back.
- ``.NAME.partial-PID`` and ``.NAME.old-PID`` directories of processes that no longer run are
  removed. Those of this process are leftovers too: one process exports one ``NAME`` at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ignition.catalog.model import MANIFEST_FILE

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)$")


class PublishError(ValueError):
    """``--out`` cannot be created or replaced; the message names the path and why."""


def is_core(path: Path) -> bool:
    """Whether ``path`` is a directory holding an Ignition manifest (any format version)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(manifest, dict) and isinstance(manifest.get("format_version"), int)
            and isinstance(manifest.get("catalog"), str) and isinstance(manifest.get("files"), dict))


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


def staging_dir(out: Path) -> Path:
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        raise PublishError(f"cannot create the core {out}: {exc.strerror or exc} ({staging})") from None
    return staging


def refuse_replacing(out: Path, overwrite: bool) -> None:
    """Raise unless ``out`` is absent, or an Ignition core and ``overwrite`` is set."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise PublishError(f"{out} already exists; pass --overwrite to replace it")
    if out.is_symlink():
        raise PublishError(f"--overwrite refuses to replace {out}: it is a symbolic link, not a core directory")
    if not out.is_dir() or not is_core(out):
        what = "a directory" if out.is_dir() else "a file"
        raise PublishError(f"--overwrite refuses to replace {out}: it is {what} but not an Ignition core "
                           f"(no {MANIFEST_FILE} with format_version, catalog and files); remove it yourself")


def check_output(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """Before any work: ``out`` can be created, holds none of ``inputs`` (label -> path), may be replaced."""
    resolved = out.resolve()
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
    """(kind, pid, path) of every ``.NAME.partial-PID`` / ``.NAME.old-PID`` beside ``out``."""
    if not out.parent.is_dir():
        return []
    found = []
    for entry in out.parent.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match and match["name"] == out.name:
            found.append((match["kind"], int(match["pid"]), entry))
    return found


def recover(out: Path) -> list[str]:
    """Finish what dead exports to ``out`` left: restore an old core whose replacement was cut off, then
    remove their leftovers. Returns what was done, one line each."""
    stale = [(kind, pid, path) for kind, pid, path in leftovers(out) if not _pid_alive(pid)]
    done = []
    if not (out.exists() or out.is_symlink()):
        olds = [path for kind, _, path in stale if kind == "old" and is_core(path)]
        if olds:
            newest = max(olds, key=lambda p: p.stat().st_mtime)
            os.rename(newest, out)
            done.append(f"restored {out} from {newest.name} (an earlier replacement was interrupted)")
    for _, _, path in stale:
        if path.exists() or path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}, left by a process that no longer runs")
    return done


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory to ``out``; the old core stays reachable until then."""
    refuse_replacing(out, overwrite)  # again: ``out`` may have changed while the export ran
    if not out.exists():
        os.rename(staging, out)
        return
    retired = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, retired)
    os.rename(staging, out)  # a crash here leaves ``out`` missing; recover() restores ``retired``
    shutil.rmtree(retired)
