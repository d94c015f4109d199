"""The tokenizer files a core ships: copied without following links out of their directory, parsed once.

A checkpoint's tokenizer files are copied into a private directory (the export copies that into
the core's ``tokenizer/``). A file that is a link resolving outside the tokenizer's directory is
refused by name: copying it would put a host file into the core. One layout is allowed: the
Hugging Face hub cache, where ``snapshots/<revision>/<file>`` links to ``../../blobs/<sha>``.
Before anything is copied, the JSON files must parse and ``tokenizer.json`` must load.
"""

from __future__ import annotations

import atexit
import json
import shutil
import stat
import tempfile
from pathlib import Path

from ignition.recipes.base import RecipeError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")
"""Files copied into the core's ``tokenizer/`` directory (when tokenizer.json or .model exists)."""


def _allowed_roots(directory: Path) -> list[Path]:
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # Hugging Face hub cache: links point into the repository's blobs/
        roots.append(root.parent.parent / "blobs")
    return roots


def read_tokenizer_file(directory: Path, name: str) -> bytes:
    """The bytes of ``directory/name``; a link out of the directory or a non-regular file is refused."""
    path = directory / name
    target = path.resolve()
    if not any(target == root or root in target.parents for root in _allowed_roots(directory)):
        raise RecipeError(f"tokenizer file {path} is a link to {target}, outside {directory}; refusing to copy "
                          f"it into the core (replace the link with the file itself)")
    if not stat.S_ISREG(target.stat().st_mode):
        raise RecipeError(f"tokenizer file {path} is not a regular file")
    return target.read_bytes()


def parse_tokenizer_files(files: dict[str, bytes], where: Path) -> int | None:
    """Parse the JSON files and load tokenizer.json; returns its id range (largest id + 1), None without one."""
    for name, data in files.items():
        if name.endswith(".json"):
            try:
                json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise RecipeError(f"tokenizer file {where / name} is not valid UTF-8 JSON: "
                                  f"{type(exc).__name__}: {exc}") from None
    if "tokenizer.json" not in files:
        return None
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for every malformed file
        raise RecipeError(f"tokenizer file {where / 'tokenizer.json'} does not load: {exc}") from None
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(ids, default=-1) + 1


def require_tokenizer_files(directory: Path) -> None:
    """RecipeError unless ``directory`` holds tokenizer.json or tokenizer.model (the CLI checks
    ``--tokenizer`` with this before an export reads any weight)."""
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise RecipeError(f"tokenizer directory {directory}: expected tokenizer.json or tokenizer.model, "
                          f"found {sorted(p.name for p in directory.iterdir()) if directory.is_dir() else 'nothing'}")


def tokenizer_dir(directory: Path, required: bool = False, vocab_size: int | None = None) -> Path | None:
    """A private, parsed copy of the tokenizer files in ``directory``, or None when it has none.

    ``directory`` is ``--tokenizer`` when given (``required``), else the checkpoint itself. With
    ``vocab_size``, a tokenizer whose ids reach beyond the model's vocabulary is refused.
    """
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not {"tokenizer.json", "tokenizer.model"} & set(present):
        if required:
            require_tokenizer_files(directory)
        return None
    files = {name: read_tokenizer_file(directory, name) for name in present}
    id_end = parse_tokenizer_files(files, directory)
    if vocab_size is not None and id_end is not None and id_end > vocab_size:
        raise RecipeError(f"tokenizer {directory / 'tokenizer.json'}: token ids reach {id_end - 1}, beyond the "
                          f"model's vocabulary of {vocab_size}")
    staging = Path(tempfile.mkdtemp(prefix="ignition-tokenizer-"))
    atexit.register(shutil.rmtree, staging, True)
    staging.chmod(0o755)  # mkdtemp's 0700 would be copied into the core
    for name, data in files.items():
        (staging / name).write_bytes(data)
    return staging
