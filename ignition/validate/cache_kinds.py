"""Cache-kind rules: every layer's kind against the kind table and the state buffers that hold it.

``manifest.json:model.layer_kinds`` names a kind of ``catalog/cache_kinds.py`` for every layer; the state then
declares exactly the buffers of the kinds present, a window ring (sliding, and every DeepSeek V4 kind) is as long
as its window plus one step's rows (GEOM-WINDOW), and a compressed layer's entry table and source ring have the
extents ``catalog/cache_kinds.py`` derives from its compression rate (GEOM-COMPRESS). The buffers' extents themselves (each kind's layer count first, ``window_cells`` as a
window cache's positions) are checked with the rest of the state by ``validate/geometry.py`` from
``catalog.geometry.STATE_SHAPES``.
"""

from __future__ import annotations

from ignition.catalog.cache_kinds import CACHE_KINDS, KIND_OF_BUFFER, compressed_entries, source_cells, window_cells
from ignition.catalog.enums import Operation
from ignition.validate.report import Violation

_WHERE = "manifest.json:model.layer_kinds"


def step_rows(manifest: dict, variants: list[dict]) -> int:
    """The most rows one slot writes in a step: a prompt chunk (``chunk_limit``; packed and mixed chunks are no
    longer) or a verify round's ``S + 1`` positions; at least one (a decode step)."""
    verify = [v.get("layout", {}).get("speculative", {}).get("positions", 0) for v in variants
              if v["operation"] == Operation.SPECULATIVE_VERIFY]
    return max([manifest.get("chunk_limit") or 1, 1] + [p for p in verify if isinstance(p, int)])


def check_layer_kinds(manifest: dict) -> list[Violation]:
    """GEOM-KIND and GEOM-KIND-RESERVED: one known, built kind a layer."""
    model = manifest["model"]
    kinds = model.get("layer_kinds")
    if not isinstance(kinds, list) or len(kinds) != model["num_layers"]:
        found = "nothing" if kinds is None else f"{len(kinds)} entries" if isinstance(kinds, list) else repr(kinds)
        return [Violation("GEOM-KIND", _WHERE, f"expected one cache kind for each of model.num_layers = "
                          f"{model['num_layers']} layers ({', '.join(CACHE_KINDS)}), found {found}")]
    found = []
    for layer, kind in enumerate(kinds):
        spec = CACHE_KINDS.get(kind)
        if spec is None:
            found.append(Violation("GEOM-KIND", f"{_WHERE}[{layer}]",
                                   f"expected one of {', '.join(CACHE_KINDS)}, found {kind!r}"))
        elif not spec.built:
            found.append(Violation("GEOM-KIND-RESERVED", f"{_WHERE}[{layer}]",
                                   f"cache kind {kind!r} is reserved and not built ({spec.summary})"))
    return found


def check_kind_buffers(manifest: dict, variants: list[dict]) -> list[Violation]:
    """GEOM-KIND-BUFFERS and GEOM-WINDOW: the state holds the buffers of exactly the kinds present, and each
    present kind states its model fields; a sliding ring holds its window plus one step's rows."""
    model, kinds = manifest["model"], set(manifest["model"]["layer_kinds"])
    declared = {decl["name"] for decl in manifest["state"]}
    found = []
    for name in sorted(declared):
        kind = KIND_OF_BUFFER.get(name)
        if kind is not None and kind not in kinds:
            found.append(Violation("GEOM-KIND-BUFFERS", f"manifest.json:state {name}",
                                   f"holds {kind!r} layers, but no layer in {_WHERE} is {kind!r}"))
    for kind in sorted(kinds & set(CACHE_KINDS)):
        spec = CACHE_KINDS[kind]
        if not spec.built:
            continue
        held = [name for name in spec.buffers if name in declared]
        # a full layer is GQA's K and V or MLA's latent and rope key; the other kinds declare every buffer
        wanted = 2 if kind == "full" else len(spec.buffers)
        if len(held) != wanted:
            found.append(Violation("GEOM-KIND-BUFFERS", "manifest.json:state", f"{kind!r} layers need "
                                   f"{wanted} of the buffers {list(spec.buffers)}; the state declares {held}"))
        missing = [field for field in spec.fields if not isinstance(model.get(field), int)]
        if missing:
            found.append(Violation("GEOM-KIND-BUFFERS", "manifest.json:model", f"{kind!r} layers need the "
                                   f"fields {list(spec.fields)}; missing {missing}"))
    windowed = any("window_cells" in CACHE_KINDS[kind].fields for kind in kinds & set(CACHE_KINDS))
    if windowed and isinstance(model.get("sliding_window"), int) and isinstance(model.get("window_cells"), int) \
            and isinstance(model.get("max_seq_len"), int):
        rows = step_rows(manifest, variants)
        expected = window_cells(model["sliding_window"], rows, model["max_seq_len"])
        if model["window_cells"] != expected:
            found.append(Violation("GEOM-WINDOW", "manifest.json:model.window_cells", f"expected min(sliding_window "
                                   f"{model['sliding_window']} + {rows} step rows - 1, max_seq_len "
                                   f"{model['max_seq_len']}) = {expected}, found {model['window_cells']}"))
    return found


COMPRESSED_EXTENTS: dict[str, tuple[str, str, str, bool]] = {
    "compressed": ("csa_rate", "csa_entries", "csa_source_cells", True),
    "heavily_compressed": ("hca_rate", "hca_entries", "hca_source_cells", False),
}
"""A compressed kind -> (its rate field, entry-table field, source-ring field, whether windows overlap)."""


def check_compressed_extents(manifest: dict, variants: list[dict]) -> list[Violation]:
    """GEOM-COMPRESS: each compressed kind present has a positive rate, ``max_seq_len // rate + 1`` entries and a
    source ring of ``(2 if overlapping else 1) * rate + R - 1`` cells."""
    model, kinds = manifest["model"], set(manifest["model"]["layer_kinds"])
    found = []
    for kind, (rate_field, entries_field, cells_field, overlap) in COMPRESSED_EXTENTS.items():
        rate, max_seq_len = model.get(rate_field), model.get("max_seq_len")
        if kind not in kinds or not all(isinstance(model.get(f), int) for f in (rate_field, entries_field, cells_field)) \
                or not isinstance(max_seq_len, int):
            continue  # a missing field is GEOM-KIND-BUFFERS'
        if rate < 1:
            found.append(Violation("GEOM-COMPRESS", f"manifest.json:model.{rate_field}",
                                   f"expected a positive compression rate, found {rate}"))
            continue
        rows = step_rows(manifest, variants)
        for field, expected, how in (
                (entries_field, compressed_entries(max_seq_len, rate), f"max_seq_len {max_seq_len} // {rate_field} "
                                                                       f"{rate} + 1"),
                (cells_field, source_cells(rate, rows, overlap), f"{2 if overlap else 1} * {rate_field} {rate} + "
                                                                 f"{rows} step rows - 1")):
            if model[field] != expected:
                found.append(Violation("GEOM-COMPRESS", f"manifest.json:model.{field}",
                                       f"expected {how} = {expected}, found {model[field]}"))
    return found


def check_cache_kinds(manifest: dict, variants: list[dict]) -> list[Violation]:
    """Every GEOM-KIND*, GEOM-WINDOW and GEOM-COMPRESS finding of a schema-valid manifest."""
    found = check_layer_kinds(manifest)
    return found or check_kind_buffers(manifest, variants) + check_compressed_extents(manifest, variants)
