"""Semantic rules of the logprob contract that JSON Schema cannot express.

Input: the schema-valid manifest and catalog documents. Output: every violation found.
"""

from __future__ import annotations

from ignition.catalog import buffers as B
from ignition.catalog.abi import MAX_RECORD_POSITIONS
from ignition.catalog.buffers import BUFFERS, resolve_shape, shape_expression
from ignition.catalog.contract import NATURAL_K, PACKED_CHOSEN_WORDS, manifest_token_capacity, packed_width, scored_capacities
from ignition.catalog.enums import Operation, ValueSource, reserved_status
from ignition.catalog.geometry import field_name, manifest_value
from ignition.catalog.model import decode_slot_limit, lane_count
from ignition.validate.constraint_rules import check_catalog_constraints, check_variant_constraints
from ignition.validate.packed import check_packed, prefill_rows
from ignition.validate.report import Violation

_DIM_RULES = {"FRAMES": "BUF-FRAMES", "capacity": "BUF-CAPACITY", "C": "BUF-CAPACITY", "T": "BUF-T",
              "RECORD_HEADER_WORDS+T": "BUF-T"}
_LOGPROB_INPUT_SOURCES = {ValueSource.LOGPROB_REQUESTED, ValueSource.LOGPROB_TOKEN_IDS, ValueSource.LOGPROB_TOKEN_ID_COUNTS}


def _enum(enum, code):
    try:
        return enum(code)
    except ValueError:
        return None


def check_core_geometry(manifest: dict) -> list[Violation]:
    found = []
    t = manifest_token_capacity(manifest)  # 0 or omitted resolves to 8
    if not 1 <= t <= MAX_RECORD_POSITIONS:
        found.append(Violation("GEOM-T", "manifest.json:completion_token_capacity",
                               f"expected 1..{MAX_RECORD_POSITIONS} (one FORCED_MASK bit per position of an int64 "
                               f"record word), found {t}"))
    if manifest["vocab_size"] > manifest["vocab_padded"]:
        found.append(Violation("GEOM-VOCAB", "manifest.json:vocab_size",
                               f"vocab_size {manifest['vocab_size']} exceeds vocab_padded {manifest['vocab_padded']}"))
    return found


def _check_buffer(variant: dict, decl: dict, t: int, width: int | None, draft_tokens: int | None = None) -> list[Violation]:
    spec = BUFFERS[decl["name"]]
    where = f"variant {variant['name']}: buffer {decl['name']}"
    found = []
    if decl["role"] != spec.role.name.lower():
        found.append(Violation("BUF-ROLE", where, f"expected role {spec.role.name.lower()}, found {decl['role']}"))
    if decl["dtype"] != spec.dtype:
        found.append(Violation("BUF-DTYPE", where, f"expected dtype {spec.dtype}, found {decl['dtype']}"))
    lanes = lane_count(variant["operation"], variant["capacity"])
    geometry = {"capacity": lanes, "T": t, "C": variant["capacity"]}
    if width is not None:
        geometry["PACKED_WIDTH"] = width
    if draft_tokens is not None:
        geometry["S"] = draft_tokens
    expected = resolve_shape(spec, **geometry)
    found_shape = decl["shape"]
    if found_shape != expected:
        rule = "BUF-SHAPE"
        if len(found_shape) == len(expected):
            rule = next((_DIM_RULES.get(sym, "BUF-SHAPE") for sym, e, f in zip(spec.shape, expected, found_shape) if e != f))
        found.append(Violation(rule, where, f"expected shape {expected} {shape_expression(spec)} with capacity="
                               f"{lanes}, C={variant['capacity']}, T={t}; found {found_shape}"))
    return found


def check_variant(variant: dict, manifest: dict) -> list[Violation]:
    name = variant["name"]
    where = f"variant {name}"
    found = []
    operation = _enum(Operation, variant["operation"])
    if operation is None:
        found.append(Violation("ENUM-OPERATION", where, f"unknown operation code {variant['operation']}; "
                               f"known: {', '.join(f'{o.name}={o.value}' for o in Operation)}"))
    elif reserved_status(operation):
        found.append(Violation("ENUM-RESERVED", where, f"operation {operation.name} ({int(operation)}) is reserved for "
                               "a feature Ignition does not build yet; no loader can serve it"))
    args = {}
    for decl in variant["arguments"]:
        if decl["name"] in args:
            found.append(Violation("CATALOG-DUP", where, f"argument {decl['name']!r} declared twice"))
        args[decl["name"]] = decl
    bindings = variant["contract"]["bindings"]
    for arg_name, code in bindings.items():
        source = _enum(ValueSource, code)
        if source is None:
            found.append(Violation("ENUM-SOURCE", f"{where}: binding {arg_name}", f"unknown value source code {code}"))
        if arg_name not in args:
            found.append(Violation("BIND-UNKNOWN", f"{where}: binding {arg_name}", "names no declared argument"))
        elif args[arg_name]["role"] != "input":
            found.append(Violation("BIND-OUTPUT", f"{where}: binding {arg_name}",
                                   f"a {args[arg_name]['role']} argument cannot be uploaded; found binding {code}"))
    for arg_name, decl in args.items():
        if decl["role"] == "input" and arg_name not in bindings:
            found.append(Violation("BIND-MISSING", f"{where}: argument {arg_name}", "input argument has no value binding"))
        spec = BUFFERS.get(arg_name)
        if spec is not None and spec.source is not None and arg_name in bindings and bindings[arg_name] != spec.source:
            found.append(Violation("BIND-SOURCE" if spec.source is not ValueSource.PROMPT_TARGET_TOKEN else "PROMPT-BIND",
                                   f"{where}: binding {arg_name}",
                                   f"expected {spec.source.name} ({int(spec.source)}), found {bindings[arg_name]}"))
    found += _check_logprob_bundle(variant, args, bindings, manifest)
    found += _check_prompt_buffers(variant, args, operation)
    found += _check_speculative(variant, args, operation, manifest)
    found += _check_mixed(variant, args, operation)
    found += check_variant_constraints(variant, args, manifest)
    found += _check_vocabulary_windows(variant, args, manifest)
    return found


def _check_vocabulary_windows(variant, args, manifest) -> list[Violation]:
    """The sample and transform windows span the whole padded row: a runtime passes their full extent whenever a lane
    samples or has a constraint or penalty, so a shorter declaration would sample from a prefix of the vocabulary or
    leave the columns past it untransformed."""
    found = []
    for name in (B.SAMPLE_WINDOW, B.TRANSFORM_WINDOW):
        decl = args.get(name)
        if decl is None:
            continue
        spec = BUFFERS[name]
        expected = resolve_shape(spec, vocab_padded=manifest["vocab_padded"])
        if decl["dtype"] != spec.dtype or decl["shape"] != expected:
            found.append(Violation("BUF-SHAPE", f"variant {variant['name']}: buffer {name}",
                                   f"expected {spec.dtype} {expected} (vocab_padded), found {decl['dtype']} "
                                   f"{decl['shape']}"))
    return found


def _check_mixed(variant, args, operation) -> list[Violation]:
    """MIXED variants: the prompt lane input, both roles' private frames (shared shapes), the merge, no scoring."""
    where = f"variant {variant['name']}"
    mixed = operation is Operation.MIXED
    layout = variant["contract"]["layout"].get("mixed")
    found = []
    declared = [spec.name for spec in B.MIXED_BUFFERS if spec.name in args]
    if not mixed:
        if declared:
            found.append(Violation("MIXED-ROLES", where, f"declares {', '.join(declared)} in a "
                                   f"{operation.name if operation else '?'} variant; only MIXED variants have roles"))
        if layout is not None:
            found.append(Violation("MIXED-MERGE", f"{where}: layout.mixed", "present in a variant that is not MIXED"))
        return found
    shared = [(B.RECORDS, 0)] + ([(B.LOGPROBS, 1)] if B.LOGPROBS in args else [])
    wanted = {B.PROMPT_LANE: args.get(B.PROMPT_LANE) and {"dtype": "int64", "shape": [1], "role": "input"}}
    for records_and_logprobs in B.ROLE_FRAMES.values():
        for name, index in shared:
            source = args.get(name)
            wanted[records_and_logprobs[index]] = source and {"dtype": source["dtype"], "shape": source["shape"],
                                                              "role": "output"}
    for name, expected in wanted.items():
        decl = args.get(name)
        if decl is None or not expected or {key: decl[key] for key in ("dtype", "shape", "role")} != expected:
            found.append(Violation("MIXED-ROLES", f"{where}: {name}", f"expected {expected or 'a declaration'}, "
                                   f"found {decl and {key: decl[key] for key in ('dtype', 'shape', 'role')}}"))
    expected_layout = {"prompt_lane": B.PROMPT_LANE, "merge": "active_frame",
                       "roles": {role: {"records": records, "logprobs": logprobs if B.LOGPROBS in args else None}
                                 for role, (records, logprobs) in B.ROLE_FRAMES.items()}}
    if layout != expected_layout:
        found.append(Violation("MIXED-MERGE", f"{where}: layout.mixed", f"expected {expected_layout}, found {layout}"))
    scored = [spec.name for spec in B.PROMPT_BUFFERS if spec.name in args]
    if scored:
        found.append(Violation("MIXED-SCORED", where, f"declares {', '.join(scored)}: scored requests never enter the "
                               "prompt role of a mixed graph"))
    return found


def _check_speculative(variant, args, operation, manifest) -> list[Violation]:
    """SPECULATIVE_VERIFY variants: layout.speculative, the draft input [capacity, S], S+1 <= T."""
    where = f"variant {variant['name']}"
    layout = variant["contract"]["layout"].get("speculative")
    verify = operation is Operation.SPECULATIVE_VERIFY
    found = []
    if B.DRAFT_TOKENS in args and not verify:
        found.append(Violation("SPEC-DRAFTS", where, f"declares {B.DRAFT_TOKENS} in a "
                               f"{operation.name if operation else '?'} variant; only SPECULATIVE_VERIFY variants take drafts"))
    if (layout is not None) != verify:
        found.append(Violation("SPEC-LAYOUT", f"{where}: layout.speculative",
                               "must be present exactly in SPECULATIVE_VERIFY variants"))
    if not verify or layout is None:
        return found
    draft_tokens, t = layout["draft_tokens"], manifest_token_capacity(manifest)
    expected = {"positions": draft_tokens + 1, "drafts": B.DRAFT_TOKENS}
    for key, value in expected.items():
        if layout.get(key) != value:
            found.append(Violation("SPEC-LAYOUT", f"{where}: layout.speculative.{key}", f"expected {value!r}, found {layout.get(key)!r}"))
    if draft_tokens + 1 > t:
        found.append(Violation("SPEC-T", f"{where}: layout.speculative.draft_tokens", f"a verify round emits up to "
                               f"S+1 = {draft_tokens + 1} positions; the core's T is {t}"))
    if B.DRAFT_TOKENS not in args:
        found.append(Violation("SPEC-DRAFTS", where, f"SPECULATIVE_VERIFY variant without {B.DRAFT_TOKENS}"))
    else:
        found += [Violation("SPEC-DRAFTS", v.where, v.message) for v in
                  _check_buffer(variant, args[B.DRAFT_TOKENS], t, None, draft_tokens)]
    returns = [(r["name"], r["dtype"], r["shape"]) for r in variant["returns"]]
    if returns != [("next_tokens", "int64", [variant["capacity"], draft_tokens + 1])]:
        found.append(Violation("SPEC-RETURNS", f"{where}: returns", f"expected next_tokens int64 "
                               f"[{variant['capacity']}, {draft_tokens + 1}], found {returns}"))
    return found


def _check_logprob_bundle(variant, args, bindings, manifest) -> list[Violation]:
    where = f"variant {variant['name']}"
    t = manifest_token_capacity(manifest)
    layout = variant["contract"]["layout"]
    present = [spec.name for spec in B.COMPLETION_BUFFERS if spec.name in args]
    has_lp, has_flags = B.LOGPROBS in args, B.REQUESTED in args
    id_inputs = [n for n in B.ID_INPUTS if n in args]
    found = []
    if has_lp != has_flags:
        missing = B.REQUESTED if has_lp else B.LOGPROBS
        found.append(Violation("LP-PARTIAL", where, f"declares {B.LOGPROBS if has_lp else B.REQUESTED} without {missing}"))
    if has_lp and B.RECORDS not in args:
        found.append(Violation("LP-PARTIAL", where, f"declares {B.LOGPROBS} without {B.RECORDS}"))
    if id_inputs and len(present) != len(B.COMPLETION_BUFFERS):
        absent = [spec.name for spec in B.COMPLETION_BUFFERS if spec.name not in args]
        found.append(Violation("LP-IDS-ALL", where, f"declares {', '.join(id_inputs)} but not {', '.join(absent)}; "
                               "a core declaring the ID inputs declares all five buffers"))
    width = None
    if has_lp:
        lp_shape = args[B.LOGPROBS]["shape"]
        width = lp_shape[-1] if lp_shape else 0
        if id_inputs:
            if width != packed_width(NATURAL_K, True):
                found.append(Violation("LP-WIDTH", f"{where}: buffer {B.LOGPROBS}",
                                       f"with explicit-ID inputs the last extent must be {packed_width(NATURAL_K, True)}, found {width}"))
        elif (width - PACKED_CHOSEN_WORDS) % 2 or not 1 <= (width - PACKED_CHOSEN_WORDS) // 2 <= NATURAL_K:
            found.append(Violation("LP-WIDTH", f"{where}: buffer {B.LOGPROBS}",
                                   f"without ID inputs the last extent must be 2+2K with 1<=K<={NATURAL_K}, found {width}"))
    for name in present:
        found += _check_buffer(variant, args[name], t, width if name == B.LOGPROBS else None)
    sampling = B.RECORDS in args
    if has_lp and sampling and bindings.get(B.REQUESTED) != ValueSource.LOGPROB_REQUESTED:
        found.append(Violation("BIND-FLAG", where, f"sampling graph with logprob outputs must bind {B.REQUESTED} "
                               f"to LOGPROB_REQUESTED ({int(ValueSource.LOGPROB_REQUESTED)})"))
    if has_lp and sampling:
        for name in id_inputs:
            if bindings.get(name) != BUFFERS[name].source:
                found.append(Violation("BIND-IDS", where, f"ID input {name} must be bound to {BUFFERS[name].source.name}"))
    if not has_lp:
        stray = [n for n in (B.REQUESTED, *B.ID_INPUTS) if n in args]
        stray += [n for n, code in bindings.items() if code in {int(s) for s in _LOGPROB_INPUT_SOURCES} and n not in stray]
        if stray:
            found.append(Violation("BIND-NONE", where, f"graph without logprob outputs declares or binds {', '.join(stray)}"))
    lp_layout = layout.get("logprobs")
    if has_lp and lp_layout is None or not has_lp and lp_layout is not None:
        found.append(Violation("LAYOUT", where, f"layout.logprobs must describe {B.LOGPROBS} exactly when it is declared"))
    elif lp_layout is not None:
        expected = {"buffer": B.LOGPROBS, "width": width, "explicit_ids": bool(id_inputs), "flags": B.REQUESTED,
                    "id_inputs": list(B.ID_INPUTS) if id_inputs else [], "k": manifest["k"]}
        for key, value in expected.items():
            if lp_layout.get(key) != value:
                rule = "LP-K" if key == "k" else "LAYOUT"
                found.append(Violation(rule, f"{where}: layout.logprobs.{key}", f"expected {value!r}, found {lp_layout.get(key)!r}"))
        if not id_inputs and width is not None and lp_layout.get("k") != (width - PACKED_CHOSEN_WORDS) // 2:
            found.append(Violation("LP-K", f"{where}: layout.logprobs.k", f"width {width} implies K={(width - 2) // 2}"))
    if layout.get("records") != (B.RECORDS if sampling else None) or layout.get("token_capacity") != t:
        found.append(Violation("LAYOUT", f"{where}: layout.records", f"expected records={B.RECORDS if sampling else None!r}, "
                               f"token_capacity={t}; found {layout.get('records')!r}, {layout.get('token_capacity')!r}"))
    return found


def _check_prompt_buffers(variant, args, operation) -> list[Violation]:
    where = f"variant {variant['name']}"
    present = [spec.name for spec in B.PROMPT_BUFFERS if spec.name in args]
    found = []
    scored = operation is Operation.SCORED_PREFILL
    if present and len(present) != len(B.PROMPT_BUFFERS):
        found.append(Violation("PROMPT-PARTIAL", where, f"declares {present[0]} without the other prompt buffer"))
    if present and not scored:
        found.append(Violation("PROMPT-PARTIAL", where, f"prompt buffers in a {operation.name if operation else '?'} variant; "
                               "only SCORED_PREFILL variants score prompts"))
    if scored and len(present) != len(B.PROMPT_BUFFERS):
        found.append(Violation("PROMPT-PARTIAL", where, "SCORED_PREFILL variant without prompt_logprobs and prompt_target_tokens"))
    for name in present:
        found += _check_buffer(variant, args[name], 1, None)
    layout = variant["contract"]["layout"].get("prompt_logprobs")
    if bool(layout) != (len(present) == len(B.PROMPT_BUFFERS)):
        found.append(Violation("LAYOUT", f"{where}: layout.prompt_logprobs", "must describe the prompt buffers exactly when declared"))
    return found


def _check_slot_limits(manifest: dict, variants: list[dict], decode: list[int]) -> list[Violation]:
    """SLOT-LIMIT: only a decode variant declares ``layout.slot_limit``, and only the one ``decode_slot_limit``
    allows it (its capacity, below the slot count and the widest decode capacity), so every slot can decode."""
    found = []
    slots = manifest_value(manifest, "num_slots")
    for variant in variants:
        limit = variant["contract"]["layout"].get("slot_limit")
        if limit is None:
            continue
        where = f"variant {variant['name']}: layout.slot_limit"
        if variant["operation"] != Operation.DECODE:
            found.append(Violation("SLOT-LIMIT", where, f"expected none (only DECODE variants declare a slot limit), "
                                   f"found {limit} on operation {variant['operation']}"))
            continue
        allowed = decode_slot_limit(variant["capacity"], decode, slots) if isinstance(slots, int) and decode else None
        if limit != allowed:
            expected = "none" if allowed is None else str(allowed)
            found.append(Violation("SLOT-LIMIT", where, f"expected {expected} (its capacity {variant['capacity']}, when "
                                   f"that is 2 or more and below both {field_name('num_slots')} = {slots} and the widest "
                                   f"decode capacity {max(decode, default=None)}), found {limit}"))
    return found


def check_catalog(manifest: dict, catalog: dict) -> list[Violation]:
    """Core-level rules across variants: names, K, capacities, prompt scoring, features, state."""
    variants = catalog["variants"]
    found = check_core_geometry(manifest)
    names = [v["name"] for v in variants]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        found.append(Violation("CATALOG-DUP", f"variant {dup}", "variant name used more than once"))
    chunk_rows = prefill_rows(variants)
    for variant in variants:
        found += check_variant(variant, manifest) + check_packed(variant, manifest, chunk_rows)
    declares = lambda name: any(a["name"] == name for v in variants for a in v["arguments"])  # noqa: E731
    has_lp, has_ids = declares(B.LOGPROBS), declares(B.TOKEN_IDS)
    if not has_lp and manifest["k"] != 0:
        found.append(Violation("LP-K", "manifest.json:k", f"a core without logprob buffers has K=0, found {manifest['k']}"))
    if has_lp and not 1 <= manifest["k"] <= NATURAL_K:
        found.append(Violation("LP-K", "manifest.json:k", f"expected 1..{NATURAL_K}, found {manifest['k']}"))
    elif has_ids and manifest["k"] != NATURAL_K:
        found.append(Violation("LP-K", "manifest.json:k", f"a core with the explicit-ID inputs exports K={NATURAL_K}; "
                               f"only natural-only cores have a smaller K, found {manifest['k']}"))
    decode = sorted({v["capacity"] for v in variants if v["operation"] == Operation.DECODE})
    if manifest["capacities"] != decode:
        found.append(Violation("CATALOG-CAPACITIES", "manifest.json:capacities", f"expected {decode}, found {manifest['capacities']}"))
    scored = sorted(v["capacity"] for v in variants if v["operation"] == Operation.SCORED_PREFILL)
    if scored:
        if manifest["k"] != NATURAL_K or not has_lp:
            found.append(Violation("PROMPT-K", "manifest.json:k", f"prompt scoring requires K={NATURAL_K} generation outputs, "
                                   f"found K={manifest['k']}"))
        limit = manifest["chunk_limit"]
        expected = scored_capacities(limit) if isinstance(limit, int) and limit >= 1 else None
        if scored != expected:
            found.append(Violation("PROMPT-CAPACITIES", "catalog.json", f"scored capacities must be {expected} for chunk "
                                   f"limit {limit}, found {scored}"))
    features = {"allow_logprobs": has_lp, "explicit_ids": has_ids, "prompt_logprobs": bool(scored)}
    for key, value in features.items():
        if manifest["features"].get(key) != value:
            found.append(Violation("FEAT-MISMATCH", f"manifest.json:features.{key}", f"catalog implies {value!r}, "
                                   f"found {manifest['features'].get(key)!r}"))
    found += check_catalog_constraints(manifest, variants)
    found += _check_slot_limits(manifest, variants, decode)
    state = {s["name"]: s for s in manifest["state"]}
    for variant in variants:
        for decl in variant["arguments"]:
            if decl["role"] == "state":
                declared = state.get(decl["name"])
                if declared is None or (declared["dtype"], declared["shape"]) != (decl["dtype"], decl["shape"]):
                    found.append(Violation("STATE-DECL", f"variant {variant['name']}: argument {decl['name']}",
                                           f"expected a manifest state entry with dtype {decl['dtype']} shape "
                                           f"{decl['shape']}, found {declared}"))
    return found


__all__ = ["check_catalog", "check_variant"]
