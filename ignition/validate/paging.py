"""Paged-KV rules: the block size, the pool's declared bound and every variant's block tables.

A core whose state holds the pools of blocks (catalog/geometry.py ``PAGED_STATE``) states ``model.block_size`` and
``model.kv_blocks``; ``check_state`` ties them to the pools' extents (GEOM-BLOCK-SIZE, GEOM-KV-BLOCKS), and these
rules check what the extents alone cannot: the block size divides the key window granule, the bound holds one
sequence of ``max_seq_len`` (GEOM-SEQ), and every variant takes ``block_tables`` as ``catalog.buffers.PAGED_INPUTS``
declares it (no variant of a core without pools does; a wrong row count is GEOM-SLOTS, a wrong width GEOM-SEQ).
"""

from __future__ import annotations

from ignition.catalog.buffers import BLOCK_TABLES, BUFFERS, KEY_WINDOW, WINDOWS, resolve_shape
from ignition.catalog.geometry import PAGED_STATE, block_size_problem, max_blocks
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
    expected = None
    if paged and all(isinstance(v, int) and v > 0 for v in (block_size, seq, model.get("num_slots"))):
        spec = BUFFERS[BLOCK_TABLES]
        expected = (spec.dtype, resolve_shape(spec, num_slots=model["num_slots"],
                                              max_blocks=max_blocks(seq, block_size)), spec.source)
    for variant in variants:
        where = f"variant {variant['name']}: {BLOCK_TABLES}"
        declared = [a for a in variant["arguments"] if a["name"] == BLOCK_TABLES]
        if not paged:
            if declared:
                found.append(Violation("GEOM-BLOCK-TABLES", where, "declared, but the core has no paged caches"))
            continue
        binding = variant["contract"]["bindings"].get(BLOCK_TABLES)
        found_decl = (declared[0]["dtype"], declared[0]["shape"], binding) if declared else None
        if expected is None or found_decl == (expected[0], expected[1], int(expected[2])) \
                and declared[0]["role"] == "input":
            continue
        rule = "GEOM-BLOCK-TABLES"  # a wrong row count or width: the slot count or the context bound is what lies
        if found_decl is not None and found_decl[0] == expected[0] and len(found_decl[1]) == 2:
            rule = "GEOM-SLOTS" if found_decl[1][0] != expected[1][0] else \
                "GEOM-SEQ" if found_decl[1][1] != expected[1][1] else rule
        found.append(Violation(rule, where, f"expected an input {expected[0]} {expected[1]} ([num_slots, "
                               f"ceil(max_seq_len / block_size)]) bound to {expected[2].name} ({int(expected[2])}), "
                               f"found {found_decl or 'none'}"))
    return found
