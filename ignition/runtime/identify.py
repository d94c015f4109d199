"""What a path holds, read before any heavy work: whether it is a core at all (``identify_core``), its manifest
read alone (``read_manifest``, what the CLI checks options against before loading), and whether a rank count fits
it (``check_rank_count``). ``load_core`` (ignition/runtime/core.py) runs all three."""

from __future__ import annotations

import json
from pathlib import Path

from ignition.catalog.manifest import Manifest
from ignition.catalog.model import MANIFEST_FILE
from ignition.runtime.verified import CoreLoadError
from ignition.validate.files import METADATA_MAX_BYTES, read_core_file


class NotACoreError(CoreLoadError):
    """The path is no core at all (a Hugging Face checkpoint, a missing directory): a usage error.
    ``model_type``: the checkpoint's config.json ``model_type`` when the path is a checkpoint."""

    def __init__(self, message: str, checkpoint: bool = False, model_type: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.model_type = model_type


def identify_core(path: str | Path) -> None:
    """Raise NotACoreError, before any heavy work, when ``path`` cannot be a core: it is missing, not a
    directory, or a Hugging Face checkpoint (``config.json``, no manifest) that needs ``export-core``."""
    root = Path(path)
    if not root.exists():
        raise NotACoreError(f"{root} does not exist; expected a core directory written by `ignition export-core`")
    if not root.is_dir():
        raise NotACoreError(f"{root} is a file; expected a core directory written by `ignition export-core`")
    if not (root / MANIFEST_FILE).exists() and (root / "config.json").is_file():
        model_type = _model_type(root)
        raise NotACoreError(f"{root} is a Hugging Face checkpoint, not a core; run "
                            f"`ignition export-core {root} --recipe RECIPE --out CORE` first, then use CORE",
                            checkpoint=True, model_type=model_type)


def _model_type(root: Path) -> str | None:
    data, _ = read_core_file(root, "config.json", "checkpoint", METADATA_MAX_BYTES)
    try:
        value = json.loads(data).get("model_type") if data is not None else None
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def read_manifest(path: str | Path) -> dict | None:
    """The core's manifest when it parses and matches its schema, read alone (no other file, no hashes):
    what the CLI checks options against before loading. None otherwise; load_core then says why."""
    from ignition.validate.schema import parse_json, schema_violations

    data, _ = read_core_file(Path(path), MANIFEST_FILE, "core", METADATA_MAX_BYTES)  # a FIFO is refused, not read
    if data is None:
        return None
    manifest, problems = parse_json(data, MANIFEST_FILE)
    if problems or schema_violations(manifest, "manifest.schema.json", MANIFEST_FILE):
        return None
    return manifest


def check_rank_count(root: Path, spec: Manifest, ranks: int) -> None:
    """CoreLoadError when ``ranks`` is not the core's rank count, naming the option that fits."""
    if ranks != spec.ranks:
        hint = f"run it with --tensor-parallel {spec.ranks}" if spec.sharded else "run it without --tensor-parallel"
        raise CoreLoadError(f"{root}: the core holds {spec.ranks} rank shard{'s' if spec.sharded else ''}, "
                            f"not {ranks}; {hint}")


__all__ = ["NotACoreError", "check_rank_count", "identify_core", "read_manifest"]
