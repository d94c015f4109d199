"""What the commands check before their heavy work, each failure a :class:`UsageError` (exit 2).

Option ranges, that a path is a core, a readable manifest, the recipe and kernel-target names, the
trusted key, the runtime name, and binding the server's port before anything loads.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Optional

import typer

from ignition.cli.errors import UsageError

TRUSTED_KEY_HELP = "Ed25519 public key (PEM): the core must carry a signature by it; a signed core may load compiled packages"
TRUST_COMPILED_HELP = ("Load AOTInductor packages (native code) even from an unsigned core (the target core only: a "
                       "draft core's packages need its signature by --trusted-key)")
RUNTIME_HELP = "Backend replaying the graphs: torch (.pt2 programs) or onnxruntime (the core's ONNX graphs, --onnx)"


def check_limits(**values) -> None:
    """Each ``option_name=value`` against its range in catalog/limits.py; the first bad one is a usage error."""
    from ignition.catalog.limits import check_limit

    for name, value in values.items():
        problem = None if value is None else check_limit(name, value, "--" + name.replace("_", "-"))
        if problem:
            raise UsageError(problem)


def int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None


def identify_core(core: Path) -> None:
    """Before any work: a missing path or a Hugging Face checkpoint is a usage error, one line."""
    from ignition.runtime.core import NotACoreError, identify_core as identify

    try:
        identify(core)
    except NotACoreError as exc:
        raise UsageError(not_a_core_message(exc, core)) from None


def not_a_core_message(exc, core: Path) -> str:
    """NotACoreError's message; for a checkpoint whose model_type names a recipe, the exact command."""
    from ignition.recipes.registry import RECIPES

    if exc.checkpoint and exc.model_type in RECIPES:
        return (f"{core} is a Hugging Face checkpoint, not a core; run `ignition export-core {core} "
                f"--recipe {exc.model_type} --out CORE` first, then use CORE")
    return str(exc)


def read_manifest(core: Path):
    """The core's typed manifest for early option checks (None when it does not read as one: loading says why)."""
    from ignition.catalog.manifest import Manifest
    from ignition.runtime.core import read_manifest as read

    manifest = read(core)
    try:
        return Manifest.from_json(manifest) if manifest is not None else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def bind(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, before loading, as uvicorn would (SO_REUSEADDR; IPv6 when the host
    has a colon); the server then listens on this very socket. A busy port or bad host is a usage error."""
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
        raise UsageError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
    sock.set_inheritable(True)
    return sock


def check_export_names(recipe: str, targets: str, tokenizer: Optional[Path]) -> None:
    """What export-core can refuse before reading the checkpoint: the recipe name, the kernel targets
    (catalog/targets.py) and a --tokenizer directory without tokenizer files."""
    from ignition.catalog.targets import parse_targets
    from ignition.recipes.base import RecipeError
    from ignition.recipes.registry import RECIPES
    from ignition.recipes.tokenizer import require_tokenizer_files

    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}; available: {', '.join(sorted(RECIPES))}")
    try:
        if targets.strip():
            parse_targets(targets)
        if tokenizer is not None:
            require_tokenizer_files(tokenizer)
    except (ValueError, RecipeError) as exc:
        raise UsageError(f"--{'tokenizer' if isinstance(exc, RecipeError) else 'targets'}: {exc}") from None


def trusted_key(path: Optional[Path]):
    """The --trusted-key PEM, loaded before any work; a bad key file is a usage error."""
    if path is None:
        return None
    from ignition.catalog.signatures import SigningError, load_trusted_key
    try:
        return load_trusted_key(path)
    except SigningError as exc:
        raise UsageError(f"--trusted-key {exc}") from None


def runtime_name(value: str) -> str:
    from ignition.runtime.backends import RUNTIMES
    if value not in RUNTIMES:
        raise typer.BadParameter(f"expected one of {', '.join(RUNTIMES)}, got {value!r}", param_hint="--runtime")
    return value


def is_utf8(text: str) -> bool:
    """False for argv bytes that were not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
