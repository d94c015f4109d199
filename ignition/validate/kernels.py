"""Kernel table rules JSON Schema cannot express: coverage, files, checksums, targets, shared memory.

Defensive by design: a malformed table yields violations, never an exception, so the same
function can run before or after the schema check.
"""

from __future__ import annotations

from pathlib import Path

from ignition.catalog.hashing import sha256_file
from ignition.catalog.model import reduction_rows
from ignition.catalog.parallel import SCORING_LAUNCHES, VOCABULARY_LAUNCHES, variant_scoring_blocks
from ignition.catalog.targets import TARGETS
from ignition.validate.files import safe_path
from ignition.validate.report import Violation


def validate_kernel_table(core_dir: Path, table: dict, variant_launches: dict[str, list[str]]) -> list[Violation]:
    """Violations of KERNEL-TARGET, KERNEL-FILE, KERNEL-HASH, KERNEL-SMEM and KERNEL-MISSING."""
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), list):
        return [Violation("KERNEL-MISSING", "kernels.json", "expected an object with a 'kernels' list")]
    targets = table.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        return [Violation("KERNEL-TARGET", "kernels.json:targets",
                          f"expected a list of target names, found {targets!r}")]
    found = [Violation("KERNEL-TARGET", "kernels.json:targets", f"unknown target {t!r}; known: {', '.join(TARGETS)}")
             for t in targets if t not in TARGETS]
    prepared = set()
    for index, entry in enumerate(table["kernels"]):
        where = f"kernels.json:kernels/{index}"
        if not isinstance(entry, dict):
            found.append(Violation("KERNEL-FILE", where,
                                   f"expected a kernel entry object, found {type(entry).__name__}"))
            continue
        where = f"kernels.json:{entry.get('key')}@{entry.get('target')}"
        found += _check_entry(Path(core_dir), entry, targets, where)
        prepared.add((str(entry.get("key")), str(entry.get("target"))))
    for variant, launches in sorted(variant_launches.items()):
        for key in launches if isinstance(launches, list) else [launches]:
            missing = [t for t in targets if t in TARGETS and (str(key), t) not in prepared]
            if missing:
                found.append(Violation("KERNEL-MISSING", f"variant {variant}: launch {key}",
                                       f"no prepared binary for target(s) {', '.join(missing)}"))
    return found


def _check_entry(core_dir: Path, entry: dict, targets: list[str], where: str) -> list[Violation]:
    found = []
    target = TARGETS.get(entry.get("target")) if isinstance(entry.get("target"), str) else None
    if target is None or entry.get("target") not in targets:
        found.append(Violation("KERNEL-TARGET", where, f"target {entry.get('target')!r} is not one of the table's "
                                                       f"known targets {[t for t in targets if t in TARGETS]}"))
    shared = entry.get("shared_bytes")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        found.append(Violation("KERNEL-SMEM", where, f"expected a non-negative shared_bytes, found {shared!r}"))
    elif target is not None and shared > target.max_shared_bytes:
        found.append(Violation("KERNEL-SMEM", where, f"needs {shared} bytes of shared memory per block; "
                                                     f"{entry['target']} allows {target.max_shared_bytes}"))
    rel = entry.get("file")
    path, problems = safe_path(core_dir, rel, where) if isinstance(rel, str) else (None, [])
    if not isinstance(rel, str) or problems:
        found.append(Violation("KERNEL-FILE", where, f"expected a relative path inside the core, found {rel!r}"))
    elif not path.is_file():
        found.append(Violation("KERNEL-FILE", where, f"binary {rel} is missing"))
    elif sha256_file(path) != entry.get("sha256"):
        found.append(Violation("KERNEL-HASH", where, f"{rel}: expected sha256 {entry.get('sha256')}, "
                                                     f"found {sha256_file(path)}"))
    return found


_SHARDED_NAMES = [f"vocab.{launch.name}" for launch in VOCABULARY_LAUNCHES]
_SCORING_NAMES = [f"score.{launch.name}" for launch in SCORING_LAUNCHES]
_RANKED = {"vocab.global_normalization", "vocab.merge", "score.normalization", "score.merge"}  # read every rank's words
_TILED = {"vocab.tile_stats", "score.tile_stats"}


def _scoring_blocks(variant: dict) -> list[int] | None:
    """Row-block sizes of a scored variant (None when its declaration is malformed: other rules report it)."""
    try:
        return variant_scoring_blocks(variant)
    except (StopIteration, KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def check_sharded_launches(manifest: dict, variants: list[dict], table: dict) -> list[Violation]:
    """KERNEL-SHARDED: each logprob variant of a sharded core launches the six sharded kernels of its shape, then
    a scored variant the seven scoring kernels of each row-block size."""
    section = manifest.get("tensor_parallel")
    entries = {}
    for entry in table.get("kernels", []) if isinstance(table, dict) else []:
        if isinstance(entry, dict):
            entries.setdefault(entry.get("key"), entry)
    found = []
    for variant in variants:
        launches = variant.get("launches") or []
        names = [entries.get(key, {}).get("name") for key in launches]
        where = f"variant {variant.get('name')}: launches"
        if section is None:
            if any(name in _SHARDED_NAMES or name in _SCORING_NAMES for name in names):
                found.append(Violation("KERNEL-SHARDED", where, f"a single-rank core lists sharded launches {names}"))
            continue
        if not launches or None in names:  # no logprobs, or KERNEL-MISSING already names the key
            continue
        blocks = _scoring_blocks(variant)
        if blocks is None:
            continue
        wanted = _SHARDED_NAMES + _SCORING_NAMES * len(blocks)
        if names != wanted:
            found.append(Violation("KERNEL-SHARDED", where, f"expected {wanted}, found {names}"))
            continue
        rows = reduction_rows(variant["operation"], variant["capacity"], variant["contract"]["layout"])
        covered = [rows] * len(_SHARDED_NAMES) + [b for b in blocks for _ in _SCORING_NAMES]
        for key, name, block_rows in zip(launches, names, covered):
            entry = entries[key]
            constexprs, grid = entry.get("constexprs") or {}, entry.get("grid") or []
            if name in _RANKED and constexprs.get("RANKS") != section["ranks"]:
                found.append(Violation("KERNEL-SHARDED", f"{where}: {key}", f"built for RANKS="
                                       f"{constexprs.get('RANKS')}, the core has {section['ranks']} ranks"))
            if not grid or grid[0] != block_rows:
                found.append(Violation("KERNEL-SHARDED", f"{where}: {key}", f"grid {grid} does not cover the "
                                       f"variant's {block_rows} {'scored' if name in _SCORING_NAMES else 'reduction'}"
                                       f" rows"))
            if name in _TILED and len(grid) == 2 and not (
                    (grid[1] - 1) * constexprs.get("TILE", 0) < section["vocab_shard"] <= grid[1] * constexprs.get("TILE", 0)):
                found.append(Violation("KERNEL-SHARDED", f"{where}: {key}", f"{grid[1]} tiles of "
                                       f"{constexprs.get('TILE')} lanes do not cover vocab_shard "
                                       f"{section['vocab_shard']}"))
    return found
