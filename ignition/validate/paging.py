"""Paged-KV rules: the block size, the pool's declared bound and every variant's block tables.

A core whose state holds the pools of blocks (catalog/geometry.py ``PAGED_STATE``) states ``model.block_size`` and
``model.kv_blocks``; ``check_state`` ties them to the pools' extents (GEOM-BLOCK-SIZE, GEOM-KV-BLOCKS), and these
rules check what the extents alone cannot: the block size divides the key window granule, the bound holds one
sequence of ``max_seq_len`` (GEOM-SEQ), and every variant takes ``block_tables`` as ``catalog.buffers.PAGED_INPUTS``
declares it (no variant of a core without pools does; a wrong row count is GEOM-SLOTS, a wrong width GEOM-SEQ).
A core with sliding-window pools (``WINDOW_PAGED_STATE``) states ``model.window_kv_blocks`` (GEOM-WINDOW-BLOCKS) and
every variant takes ``window_block_tables`` too (GEOM-WINDOW-TABLES).
"""

from __future__ import annotations

from ignition.catalog.buffers import BLOCK_TABLES, BUFFERS, KEY_WINDOW, WINDOW_BLOCK_TABLES, WINDOWS, resolve_shape
from ignition.catalog.geometry import (PAGED_STATE, WINDOW_PAGED_STATE, block_size_problem, max_blocks,
                                       window_blocks_bound)
from ignition.validate.report import Violation


def check_paging(manifest: dict, variants: list[dict]) -> list[Violation]:
    model = manifest["model"]
    paged = any(s["name"] in PAGED_STATE for s in manifest["state"])
    block_size, kv_blocks, seq = model.get("block_size"), model.get("kv_blocks"), model.get("max_seq_len")
    found = []
    if paged and block_size is not None:
        problem = block_size_problem(block_size, WINDOWS[KEY_WINDOW].granule)
        if problem:
            found.append(Violation("GEOM-BLOCK-SIZE", "manifest.json:model.block_size", problem))
    if not paged and (block_size is not None or kv_blocks is not None):
        found.append(Violation("GEOM-BLOCK-SIZE", "manifest.json:model", "block_size and kv_blocks describe paged "
                               f"caches ({', '.join(PAGED_STATE)}); the state declares none"))
    if paged and seq is None:
        found.append(Violation("GEOM-SEQ", "manifest.json:model.max_seq_len", "a paged core states its context "
                               "bound (the width of its block tables), found none"))
    if paged and isinstance(block_size, int) and block_size > 0 and isinstance(seq, int) and isinstance(kv_blocks, int) \
            and kv_blocks < max_blocks(seq, block_size):  # the pool, which its tensors confirm, cannot hold max_seq_len
        found.append(Violation("GEOM-SEQ", "manifest.json:model.max_seq_len", f"a sequence of {seq} positions takes "
                               f"{max_blocks(seq, block_size)} blocks of {block_size}; model.kv_blocks holds "
                               f"{kv_blocks}"))
    windowed = any(s["name"] in WINDOW_PAGED_STATE for s in manifest["state"])
    window_blocks = model.get("window_kv_blocks")
    if windowed != (window_blocks is not None):
        found.append(Violation("GEOM-WINDOW-BLOCKS", "manifest.json:model.window_kv_blocks",
                               "stated, but the state declares no sliding pools" if window_blocks is not None else
                               f"the sliding pools {list(WINDOW_PAGED_STATE)} need their declared block count"))
    elif windowed and all(isinstance(model.get(f), int) and model[f] > 0
                          for f in ("block_size", "max_seq_len", "num_slots", "window_cells")):
        expected = window_blocks_bound(model["num_slots"], model["window_cells"], seq, block_size)
        if window_blocks != expected:
            found.append(Violation("GEOM-WINDOW-BLOCKS", "manifest.json:model.window_kv_blocks", f"expected "
                                   f"num_slots {model['num_slots']} x {(expected - 1) // model['num_slots']} blocks "
                                   f"(a window of window_cells {model['window_cells']} positions in blocks of "
                                   f"{block_size}) + the null block = {expected}, found {window_blocks}"))
    for table, present, rule in ((BLOCK_TABLES, paged, "GEOM-BLOCK-TABLES"),
                                 (WINDOW_BLOCK_TABLES, windowed, "GEOM-WINDOW-TABLES")):
        found += _check_tables(model, variants, table, present, rule)
    return found


def _check_tables(model: dict, variants: list[dict], table: str, present: bool, rule: str) -> list[Violation]:
    """Every variant declares the input ``table`` as ``catalog.buffers`` does exactly when ``present`` (``rule``)."""
    block_size, seq = model.get("block_size"), model.get("max_seq_len")
    expected, found = None, []
    if present and all(isinstance(v, int) and v > 0 for v in (block_size, seq, model.get("num_slots"))):
        spec = BUFFERS[table]
        expected = (spec.dtype, resolve_shape(spec, num_slots=model["num_slots"],
                                              max_blocks=max_blocks(seq, block_size)), spec.source)
    for variant in variants:
        where = f"variant {variant['name']}: {table}"
        declared = [a for a in variant["arguments"] if a["name"] == table]
        if not present:
            if declared:
                found.append(Violation(rule, where, "declared, but the core has no caches it addresses"))
            continue
        binding = variant["contract"]["bindings"].get(table)
        found_decl = (declared[0]["dtype"], declared[0]["shape"], binding) if declared else None
        if expected is None or found_decl == (expected[0], expected[1], int(expected[2])) \
                and declared[0]["role"] == "input":
            continue
        broken = rule  # a wrong row count or width: the slot count or the context bound is what lies
        if found_decl is not None and found_decl[0] == expected[0] and len(found_decl[1]) == 2:
            broken = "GEOM-SLOTS" if found_decl[1][0] != expected[1][0] else \
                "GEOM-SEQ" if found_decl[1][1] != expected[1][1] else rule
        found.append(Violation(broken, where, f"expected an input {expected[0]} {expected[1]} ([num_slots, "
                               f"ceil(max_seq_len / block_size)]) bound to {expected[2].name} ({int(expected[2])}), "
                               f"found {found_decl or 'none'}"))
    return found
