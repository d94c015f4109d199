"""Rules of the packed prefill (PACKED_PREFILL, ``packed.t{C}.c{capacity}``) that JSON Schema cannot express.

A packed variant replaces the single-chunk inputs with the packed inputs (``catalog.buffers.PACKED_INPUTS``):
every lane's chunk concatenated in ``packed_input_ids [capacity*C]``, its start, length and emission per lane,
and the segment window ``[C]``, with C = ``layout.packed.segment_rows`` = the rows of the PREFILL variant's chunk
(which CATALOG-PREFILL ties to the manifest's chunk limit), so a lane's chunk is the one a serial round runs.
"""

from __future__ import annotations

from ignition.catalog import buffers as B
from ignition.catalog.buffers import CHUNK_TOKENS, resolve_shape, shape_expression
from ignition.catalog.enums import Operation
from ignition.catalog.geometry import field_name, manifest_value
from ignition.validate.report import Violation

SINGLE_CHUNK_INPUTS = tuple(spec.name for spec in B.CHUNK_INPUTS) + ("input_ids", "positions")
"""What a packed variant must not declare: its lanes' tokens and positions come from the packed inputs."""


def prefill_rows(variants: list[dict]) -> int | None:
    """The chunk rows of the catalog's PREFILL variant; None without exactly one (CATALOG-PREFILL reports it)."""
    chunks = [a["shape"] for v in variants if v["operation"] == Operation.PREFILL for a in v["arguments"]
              if a["name"] == CHUNK_TOKENS]
    return chunks[0][0] if len(chunks) == 1 and len(chunks[0]) == 1 else None


def check_packed(variant: dict, manifest: dict, chunk_rows: int | None) -> list[Violation]:
    """PACKED-INPUTS and PACKED-LAYOUT for one schema-valid variant; ``chunk_rows``: ``prefill_rows`` of its catalog."""
    where = f"variant {variant['name']}"
    args = {decl["name"]: decl for decl in variant["arguments"]}
    operation = variant["operation"]
    packed = operation == Operation.PACKED_PREFILL
    kind = Operation(operation).name if operation in Operation._value2member_map_ else f"code {operation}"
    layout = variant["contract"]["layout"].get("packed")
    declared = [spec.name for spec in B.PACKED_INPUTS if spec.name in args]
    if not packed:
        found = [Violation("PACKED-INPUTS", where, f"declares {', '.join(declared)} in a {kind} variant; only "
                           "PACKED_PREFILL variants pack chunks")] if declared else []
        if layout is not None:
            found.append(Violation("PACKED-LAYOUT", f"{where}: layout.packed", "present in a variant that is not "
                                   "PACKED_PREFILL"))
        return found
    found = _check_layout(variant, layout, manifest, chunk_rows)
    rows = layout["segment_rows"] if isinstance(layout, dict) and isinstance(layout.get("segment_rows"), int) \
        else chunk_rows
    for spec in B.PACKED_INPUTS if rows is not None else ():
        decl = args.get(spec.name)
        expected = {"dtype": spec.dtype, "shape": resolve_shape(spec, capacity=variant["capacity"], C=rows),
                    "role": spec.role.name.lower()}
        found_decl = decl and {key: decl[key] for key in ("dtype", "shape", "role")}
        if found_decl != expected:
            found.append(Violation("PACKED-INPUTS", f"{where}: {spec.name}", f"expected {expected} "
                                   f"({shape_expression(spec)}, capacity={variant['capacity']}, C={rows}), "
                                   f"found {found_decl or 'no declaration'}"))
    single = [name for name in SINGLE_CHUNK_INPUTS if name in args]
    if single:
        found.append(Violation("PACKED-INPUTS", where, f"declares {', '.join(single)}: a packed variant takes its "
                               "lanes' rows from the packed inputs only"))
    return found


def _check_layout(variant: dict, layout, manifest: dict, chunk_rows: int | None) -> list[Violation]:
    where = f"variant {variant['name']}: layout.packed"
    rows = chunk_rows if chunk_rows is not None else (layout or {}).get("segment_rows")
    expected = {"tokens": B.PACKED_TOKENS, "segment_rows": rows, "segment_window": B.SEGMENT_WINDOW}
    found = []
    if layout != expected:
        found.append(Violation("PACKED-LAYOUT", where, f"expected {expected} (segment_rows: the rows of the PREFILL "
                               f"variant's {CHUNK_TOKENS}), found {layout}"))
    slots, capacity = manifest_value(manifest, "num_slots"), variant["capacity"]
    if capacity < 2 or (isinstance(slots, int) and capacity > slots):
        found.append(Violation("PACKED-LAYOUT", f"variant {variant['name']}: capacity", f"expected 2 lanes or more "
                               f"and at most {field_name('num_slots')} = {slots} (each lane needs its own slot), "
                               f"found {capacity}"))
    return found


__all__ = ["check_packed", "prefill_rows"]
