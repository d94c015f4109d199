"""Saving a captured program: ``torch.export.save`` without its discarded self-test, then the safe reader.

Shared by the export's own capture loop and its capture workers (exporter/workers.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from contextlib import contextmanager
from pathlib import Path

import torch

from ignition.validate.archive import check_archive


class ExportError(Exception):
    """The export produced no core; the message says why (validation findings included)."""


def save_program(program: torch.export.ExportedProgram, staging: Path, graph_file: str) -> None:
    """``torch.export.save``, then the validator's safe reader: a graph that loading would refuse (a pickle,
    code, a foreign member) fails the export here instead of every load later."""
    with _discarded_canonical_check_skipped():
        torch.export.save(program, staging / graph_file)
    refused = check_archive((staging / graph_file).read_bytes(), graph_file)
    if refused:
        raise ExportError(f"{graph_file}: torch.export.save wrote an archive that loading refuses:\n"
                          + "\n".join(f"  {v}" for v in refused))


@contextmanager
def _discarded_canonical_check_skipped():
    """Skip the canonical-form self-test inside ``torch.export.save`` when its result is discarded.

    NOTE: torch's program serializer calls ``canonicalize(serialized_ep, ...)`` as a bare statement
    ("Test canonical form is well defined") and writes ``serialized_ep`` itself: the canonical copy,
    a deep copy of the whole serialized program, is thrown away. It is 15% of a tiny export's time
    (7.8 s of 53 s under cProfile). The skip is installed only where the serializer's source shows
    that call as a bare statement, so a torch that uses the result keeps it; the archive is the same
    byte for byte either way (tests/test_save_program.py). The check reads the whole serializer module,
    so a torch that uses ``canonicalize``'s result anywhere keeps it everywhere.
    """
    from torch._export.serde import serialize

    if not _canonical_check_is_discarded(serialize):
        yield
        return
    original = serialize.canonicalize
    serialize.canonicalize = lambda ep, constants=None: ep
    try:
        yield
    finally:
        serialize.canonicalize = original


@functools.cache
def _canonical_check_is_discarded(source_of) -> bool:
    """Whether ``source_of`` (the serializer module) calls ``canonicalize`` only as bare statements."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(source_of)))
    except (OSError, TypeError, SyntaxError):
        return False
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "canonicalize"]
    bare = [node for node in ast.walk(tree) if isinstance(node, ast.Expr) and node.value in calls]
    names = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "canonicalize"]
    return bool(calls) and len(bare) == len(calls) == len(names)  # no other use of the function either
