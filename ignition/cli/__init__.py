"""The ``ignition`` command line: export-core, validate-core, inspect-core, run, serve.

Everything a command can check cheaply is checked before its heavy work (an export, a load):
option ranges, that a core path is a core, that ``--out`` may be written, that the port is
free, that ``run``'s logprob options fit the core (read from its manifest alone). Long work
reports its stages on stderr as they start: a rich status line in a terminal, plain timestamped
lines otherwise (CI logs, files). Commands raise the errors of cli/errors.py; the command group
(cli/group.py) maps each to its message and exit code, and ``main`` maps anything else to 70.
"""

from __future__ import annotations

import os
import sys

from ignition.cli import examine, export, run, serve  # noqa: F401 (each registers its command)
from ignition.cli.console import StageLog, console
from ignition.cli.errors import report_internal
from ignition.cli.group import app, version_text


def main() -> None:
    """The console script: ``app`` with non-UTF-8 argv printed escaped and an unexpected error reported as a bug."""
    for stream in (sys.stdout, sys.stderr):  # paths from non-UTF-8 argv print escaped, not as a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        app()
    except Exception as exc:  # every input has its own clean error; reaching this is a bug
        if os.environ.get("IGNITION_TRACEBACK"):
            raise
        sys.exit(report_internal(exc, console))


__all__ = ["StageLog", "app", "main", "version_text"]
