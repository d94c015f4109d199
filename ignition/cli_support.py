"""What the ``ignition`` commands check and show before their heavy work (ignition/cli.py uses it).

The stderr console, the stage log of a long command, the one-line usage error, and the cheap early
checks: option ranges, that a path is a core, a readable manifest, the recipe and kernel-target names,
the trusted key, the runtime name, and binding the server's port before anything loads.
"""

from __future__ import annotations

import errno
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True, soft_wrap=True)  # messages carry paths: never hard-wrap them


class StageLog:
    """A long command's stages on stderr, each as it starts: ``progress(stage, item)``.

    In a terminal, one rich status line (spinner, stage, item, elapsed) that disappears when the
    work ends; otherwise (piped, a file, CI) one plain line per stage: ``YYYY-mm-dd HH:MM:SS
    TITLE STAGE: ITEM``, flushed at once, so a log shows where a long export or load is.
    """

    def __init__(self, title: str, terminal: bool | None = None):
        self.title = title
        self.terminal = console.is_terminal if terminal is None else terminal
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> "StageLog":
        if self.terminal:
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TextColumn("{task.fields[item]}", markup=False), TimeElapsedColumn(),
                                 console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=None, item="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def __call__(self, stage: str, item: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.title} {stage}", item=item)
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"{stamp} {self.title} {stage}: {item}" if item else f"{stamp} {self.title} {stage}",
                  file=sys.stderr, flush=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error (markup off: paths and values print as given) and return the exit."""
    console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _check_limits(**values) -> None:
    """Each ``option_name=value`` against its range in catalog/limits.py; exit 2 naming the first bad one."""
    from ignition.catalog.limits import check_limit

    for name, value in values.items():
        problem = None if value is None else check_limit(name, value, "--" + name.replace("_", "-"))
        if problem:
            raise _fail(problem)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None


def _identify_core(core: Path) -> None:
    """Before any work: a missing path or a Hugging Face checkpoint is a usage error (exit 2), one line."""
    from ignition.runtime.core import NotACoreError, identify_core

    try:
        identify_core(core)
    except NotACoreError as exc:
        raise _fail(_not_a_core_message(exc, core))


def _not_a_core_message(exc, core: Path) -> str:
    """NotACoreError's message; for a checkpoint whose model_type names a recipe, the exact command."""
    from ignition.recipes.registry import RECIPES

    if exc.checkpoint and exc.model_type in RECIPES:
        return (f"{core} is a Hugging Face checkpoint, not a core; run `ignition export-core {core} "
                f"--recipe {exc.model_type} --out CORE` first, then use CORE")
    return str(exc)


def _read_manifest(core: Path) -> dict | None:
    """The core's manifest for early option checks (None when it does not parse: loading says why)."""
    from ignition.runtime.core import read_manifest

    return read_manifest(core)


def _bind(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, before loading, as uvicorn would (SO_REUSEADDR; IPv6 when the host
    has a colon); the server then listens on this very socket. A busy port or bad host exits 2."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        reason = getattr(exc, "strerror", None) or str(exc)
        hint = " (another server is listening there; choose another --port)" \
            if getattr(exc, "errno", None) == errno.EADDRINUSE else ""
        raise _fail(f"cannot listen on {host}:{port}: {reason}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _check_export_names(recipe: str, targets: str, tokenizer: Optional[Path]) -> None:
    """What export-core can refuse before reading the checkpoint: the recipe name, the kernel targets
    (catalog/targets.py) and a --tokenizer directory without tokenizer files."""
    from ignition.catalog.targets import parse_targets
    from ignition.recipes.base import RecipeError
    from ignition.recipes.registry import RECIPES
    from ignition.recipes.tokenizer import require_tokenizer_files

    if recipe not in RECIPES:
        raise _fail(f"unknown recipe {recipe!r}; available: {', '.join(sorted(RECIPES))}")
    try:
        if targets.strip():
            parse_targets(targets)
        if tokenizer is not None:
            require_tokenizer_files(tokenizer)
    except (ValueError, RecipeError) as exc:
        raise _fail(f"--{'tokenizer' if isinstance(exc, RecipeError) else 'targets'}: {exc}") from None


def _trusted_key(path: Optional[Path]):
    """The --trusted-key PEM, loaded before any work; a bad key file is a usage error (exit 2)."""
    if path is None:
        return None
    from ignition.catalog.signatures import SigningError, load_trusted_key
    try:
        return load_trusted_key(path)
    except SigningError as exc:
        console.print(f"[red]error:[/red] --trusted-key {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)


TRUSTED_KEY_HELP = "Ed25519 public key (PEM): the core must carry a signature by it; a signed core may load compiled packages"
TRUST_COMPILED_HELP = ("Load AOTInductor packages (native code) even from an unsigned core (the target core only: a "
                       "draft core's packages need its signature by --trusted-key)")
RUNTIME_HELP = "Backend replaying the graphs: torch (.pt2 programs) or onnxruntime (the core's ONNX graphs, --onnx)"


def _runtime(value: str) -> str:
    from ignition.runtime.backends import RUNTIMES
    if value not in RUNTIMES:
        raise typer.BadParameter(f"expected one of {', '.join(RUNTIMES)}, got {value!r}", param_hint="--runtime")
    return value
