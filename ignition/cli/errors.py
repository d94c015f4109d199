"""The command line's errors and the exit code of each: commands raise, ``Commands.invoke`` maps.

======  ==========================================================================
code    meaning
======  ==========================================================================
0       ok
1       an invalid core, or the core failed at run time (:class:`CoreError`)
2       a usage error: an option, argument or path the command cannot take (:class:`UsageError`)
70      an internal error: an exception no command expected, a bug (EX_SOFTWARE)
======  ==========================================================================
"""

from __future__ import annotations

from rich.markup import escape

EXIT_OK = 0
EXIT_CORE = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70


class CliError(Exception):
    """An error a command reports in one line, ``LABEL: MESSAGE`` on stderr, and exits with ``exit_code``."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, label: str = "error"):
        super().__init__(message)
        self.message = message
        self.label = label


class UsageError(CliError):
    """An option, argument or path the command cannot take: nothing heavy ran (exit 2)."""

    exit_code = EXIT_USAGE


class CoreError(CliError):
    """The core is invalid, cannot load, or failed while it ran (exit 1)."""

    exit_code = EXIT_CORE


def report(error: CliError, console) -> int:
    """Print ``error`` on ``console`` (its message as given: paths and values are not markup) and return its code."""
    console.print(f"[red]{escape(error.label)}:[/red] {escape(error.message)}", highlight=False, soft_wrap=True)
    return error.exit_code


def report_internal(exc: BaseException, console) -> int:
    """An exception no command expected: one line naming it, how to get the traceback, and exit 70."""
    console.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, highlight=False)
    console.print("this is a bug in ignition; rerun with IGNITION_TRACEBACK=1 and report the traceback",
                  markup=False, highlight=False)
    return EXIT_INTERNAL
