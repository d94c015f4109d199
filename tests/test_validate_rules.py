"""Every validator rule rejects a real exported core mutated to break exactly that rule."""

from __future__ import annotations

import shutil

import pytest

from ignition.catalog.buffers import CONSTRAINT_INPUTS
from ignition.catalog.contract import FORMAT_CHANGES, FORMAT_VERSION
from ignition.catalog.enums import Operation, ValueSource
from ignition.runtime.core import CoreLoadError, load_core
from ignition.validate.core import validate_core
from ignition.catalog.rules import RULES


def rules_of(root, check_graphs=True) -> set[str]:
    report = validate_core(root, check_graphs=check_graphs)
    assert all(v.rule in RULES for v in report.violations), report.violations
    assert "VALIDATOR-ERROR" not in {v.rule for v in report.violations}, report.violations
    return {v.rule for v in report.violations}


def args_of(variant):
    return {a["name"]: a for a in variant["arguments"]}


def test_exported_core_is_valid(toy_core, toy_core_no_logprobs):
    assert rules_of(toy_core) == set()
    assert rules_of(toy_core_no_logprobs) == set()


def test_core_missing(tmp_path):
    assert rules_of(tmp_path) == {"CORE-MISSING"}


def test_json_parse(core_copy):
    (core_copy.root / "manifest.json").write_text("{not json")
    assert rules_of(core_copy.root) == {"JSON-PARSE"}


def test_schema_unknown_and_missing_fields(core_copy):
    def change(m):
        m["surprise"] = 1
        del m["k"]
    core_copy.edit("manifest.json", change)
    assert rules_of(core_copy.root) == {"SCHEMA"}


def test_schema_catalog_unknown_field(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0].update(extra=True))
    assert rules_of(core_copy.root) == {"SCHEMA"}


def test_format_version(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(format_version=99))
    assert rules_of(core_copy.root) == {"FORMAT-VERSION"}


def test_format_2_core_is_refused_with_the_reason(core_copy):
    """A format-2 manifest stored K twice (``k`` and ``features.max_logprobs``) and had no paged caches: refused before
    its schema, by name."""
    core_copy.edit("manifest.json", lambda m: m.update(format_version=2) or m["features"].update(max_logprobs=m["k"]))
    (violation,) = validate_core(core_copy.root).violations
    assert (violation.rule, violation.where) == ("FORMAT-VERSION", "manifest.json:format_version")
    assert violation.message == (f"expected {FORMAT_VERSION}, found 2 ({FORMAT_CHANGES[2]}; re-export the core with "
                                 "this Ignition)")
    assert "stores K twice" in FORMAT_CHANGES[2] and "paged KV caches" in FORMAT_CHANGES[2]
    with pytest.raises(CoreLoadError, match=r"\[FORMAT-VERSION\] manifest\.json:format_version: expected \d+, found 2 "
                                            r"\(format 2 stores K twice"):
        load_core(core_copy.root)


def test_unknown_operation_code(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0].update(operation=99))
    assert "ENUM-OPERATION" in rules_of(core_copy.root)


def test_unknown_value_source(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].update(input_ids=999))
    assert "ENUM-SOURCE" in rules_of(core_copy.root)


@pytest.mark.parametrize("path", ["../escape.pt2", "/etc/passwd", "graphs\\x.pt2"])
def test_file_paths_stay_inside(core_copy, path):
    core_copy.edit("catalog.json", lambda c: c["variants"][0].update(graph=path))
    assert "FILE-PATH" in rules_of(core_copy.root)


def test_missing_file(core_copy):
    (core_copy.root / "weights.safetensors").unlink()
    assert "FILE-MISSING" in rules_of(core_copy.root)


def test_tampered_file(core_copy):
    graph = core_copy.root / "graphs" / "decode.c1.pt2"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    assert "FILE-HASH" in rules_of(core_copy.root)


def test_unlisted_file(core_copy):
    core_copy.edit("manifest.json", lambda m: m["files"].pop("graphs/decode.c4.pt2"))
    assert {"FILE-UNLISTED", "FILE-EXTRA"} <= rules_of(core_copy.root)


def test_extra_file(core_copy):
    (core_copy.root / "stray.bin").write_bytes(b"x")
    assert rules_of(core_copy.root) == {"FILE-EXTRA"}


def test_token_capacity_bounds(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(completion_token_capacity=65))
    assert "GEOM-T" in rules_of(core_copy.root, check_graphs=False)


@pytest.mark.parametrize("edit", [lambda m: m.update(completion_token_capacity=0),
                                  lambda m: m.pop("completion_token_capacity")], ids=["zero", "omitted"])
def test_token_capacity_zero_or_omitted_resolves_to_eight(core_copy, edit):
    """The toy core's buffers use T=8: a manifest with T 0 or without T describes them exactly."""
    from ignition.runtime.core import load_core

    core_copy.edit("manifest.json", edit)
    assert rules_of(core_copy.root) == set()
    assert load_core(core_copy.root).token_capacity == 8


def test_token_capacity_negative_is_a_schema_error(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(completion_token_capacity=-1))
    assert rules_of(core_copy.root, check_graphs=False) == {"SCHEMA"}


def test_token_capacity_bound_is_the_record_word_width():
    from ignition.catalog.abi import MAX_RECORD_POSITIONS, RecordField
    from ignition.catalog.buffers import BUFFERS, RECORDS

    assert BUFFERS[RECORDS].dtype == "int64" and MAX_RECORD_POSITIONS == 64
    assert "PAYLOAD_MASK" not in RecordField.__members__ and RecordField(6).name == "RESERVED_6"


def test_vocab_larger_than_padding(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(vocab_size=m["vocab_padded"] + 1))
    assert "GEOM-VOCAB" in rules_of(core_copy.root, check_graphs=False)


def test_duplicate_variant(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"].append(dict(c["variants"][0])))
    assert "CATALOG-DUP" in rules_of(core_copy.root, check_graphs=False)


def test_capacities_must_match(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(capacities=[1, 2, 4]))
    assert rules_of(core_copy.root) == {"CATALOG-CAPACITIES"}


def _edit_arg(core_copy, variant, name, **changes):
    def change(c):
        args_of(core_copy.variant(c, variant))[name].update(changes)
    core_copy.edit("catalog.json", change)


@pytest.mark.parametrize("name,changes,rule", [
    ("completion_records", {"dtype": "int32"}, "BUF-DTYPE"),
    ("completion_logprobs", {"dtype": "float32"}, "BUF-DTYPE"),
    ("completion_records", {"shape": [3, 4, 24]}, "BUF-FRAMES"),
    ("completion_logprobs", {"shape": [1, 4, 8, 258]}, "BUF-FRAMES"),
    ("logprob_requested", {"shape": [8]}, "BUF-CAPACITY"),
    ("completion_logprobs", {"shape": [2, 2, 8, 258]}, "BUF-CAPACITY"),
    ("completion_records", {"shape": [2, 4, 20]}, "BUF-T"),
    ("completion_logprobs", {"shape": [2, 4, 4, 258]}, "BUF-T"),
    ("logprob_token_ids", {"shape": [4, 64]}, "BUF-SHAPE"),
    ("logprob_token_id_counts", {"shape": [4, 1]}, "BUF-SHAPE"),
    ("completion_logprobs", {"role": "input"}, "BUF-ROLE"),
])
def test_buffer_geometry(core_copy, name, changes, rule):
    _edit_arg(core_copy, "decode.c4", name, **changes)
    assert rule in rules_of(core_copy.root, check_graphs=False)


def _drop_arg(core_copy, variant, name):
    def change(c):
        v = core_copy.variant(c, variant)
        v["arguments"] = [a for a in v["arguments"] if a["name"] != name]
        v["contract"]["bindings"].pop(name, None)
    core_copy.edit("catalog.json", change)


def test_logprobs_without_flags_is_partial(core_copy):
    _drop_arg(core_copy, "decode.c4", "logprob_requested")
    assert {"LP-PARTIAL", "LP-IDS-ALL", "BIND-FLAG"} <= rules_of(core_copy.root, check_graphs=False)


def test_flags_without_logprobs_is_partial(core_copy):
    _drop_arg(core_copy, "decode.c4", "completion_logprobs")
    assert {"LP-PARTIAL", "LP-IDS-ALL"} <= rules_of(core_copy.root, check_graphs=False)


def test_token_ids_without_counts(core_copy):
    _drop_arg(core_copy, "decode.c1", "logprob_token_id_counts")
    assert "LP-IDS-ALL" in rules_of(core_copy.root, check_graphs=False)


def _natural_only(core_copy, width):
    for variant in ("decode.c1", "decode.c4", "prefill.t256"):
        _drop_arg(core_copy, variant, "logprob_token_ids")
        _drop_arg(core_copy, variant, "logprob_token_id_counts")

    def change(c):
        for v in c["variants"]:
            lp = args_of(v)["completion_logprobs"]
            lp["shape"] = lp["shape"][:-1] + [width]
            v["contract"]["layout"]["logprobs"].update(width=width, explicit_ids=False, id_inputs=[],
                                                       k=(width - 2) // 2)
    core_copy.edit("catalog.json", change)

    def manifest(m):
        m["k"] = (width - 2) // 2
        m["features"]["explicit_ids"] = False
    core_copy.edit("manifest.json", manifest)


def test_natural_only_core_is_valid_in_catalog(core_copy):
    _natural_only(core_copy, 2 + 2 * 5)
    assert rules_of(core_copy.root, check_graphs=False) == set()


@pytest.mark.parametrize("width", [44, 2, 11])
def test_natural_only_width(core_copy, width):
    _natural_only(core_copy, width)
    assert "LP-WIDTH" in rules_of(core_copy.root, check_graphs=False)


def test_k_must_agree(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(k=5))
    assert "LP-K" in rules_of(core_copy.root, check_graphs=False)


def test_reserved_operation_is_rejected(core_copy):
    core_copy.edit("catalog.json", lambda c: core_copy.variant(c, "prefill.t256").update(
        operation=int(Operation.DRAFT_PROPOSE)))
    assert "ENUM-RESERVED" in rules_of(core_copy.root, check_graphs=False)


def test_k_is_twenty_with_id_inputs(core_copy):
    """Every variant and the manifest agree on K=5, but the core declares the ID inputs: it must export K=20."""
    def change(catalog):
        for v in catalog["variants"]:
            v["contract"]["layout"]["logprobs"]["k"] = 5
    core_copy.edit("catalog.json", change)
    core_copy.edit("manifest.json", lambda m: m.update(k=5))
    assert rules_of(core_copy.root, check_graphs=False) == {"LP-K"}


def test_k_zero_without_buffers(toy_core_no_logprobs, tmp_path):
    from conftest import CoreCopy
    copy = CoreCopy(tmp_path / "c")
    shutil.copytree(toy_core_no_logprobs, copy.root)
    copy.edit("manifest.json", lambda m: m.update(k=20))
    assert "LP-K" in rules_of(copy.root, check_graphs=False)


def test_every_input_needs_a_binding(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].pop("input_ids"))
    assert rules_of(core_copy.root, check_graphs=False) == {"BIND-MISSING"}


def test_binding_unknown_argument(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].update(nope=1))
    assert rules_of(core_copy.root, check_graphs=False) == {"BIND-UNKNOWN"}


def test_output_cannot_be_uploaded(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].update(
        completion_logprobs=int(ValueSource.LOGPROB_REQUESTED)))
    assert "BIND-OUTPUT" in rules_of(core_copy.root, check_graphs=False)


def test_binding_source_must_match_table(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].update(
        logprob_token_ids=int(ValueSource.TOKEN_IDS)))
    assert {"BIND-SOURCE", "BIND-IDS"} <= rules_of(core_copy.root, check_graphs=False)


def test_flag_vector_must_be_bound(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][0]["contract"]["bindings"].update(
        logprob_requested=int(ValueSource.ACTIVE_LANES)))
    assert "BIND-FLAG" in rules_of(core_copy.root, check_graphs=False)


def test_graph_without_logprobs_binds_no_flags(toy_core_no_logprobs, tmp_path):
    from conftest import CoreCopy
    copy = CoreCopy(tmp_path / "c")
    shutil.copytree(toy_core_no_logprobs, copy.root)

    def change(c):
        v = c["variants"][0]
        v["arguments"].append({"name": "logprob_requested", "dtype": "int32", "shape": [v["capacity"]], "role": "input"})
        v["contract"]["bindings"]["logprob_requested"] = int(ValueSource.LOGPROB_REQUESTED)
    copy.edit("catalog.json", change)
    assert "BIND-NONE" in rules_of(copy.root, check_graphs=False)


def test_layout_must_describe_buffers(core_copy):
    core_copy.edit("catalog.json", lambda c: c["variants"][1]["contract"]["layout"]["logprobs"].update(width=42))
    assert "LAYOUT" in rules_of(core_copy.root, check_graphs=False)


def _add_prompt_buffers(variant, binding=int(ValueSource.PROMPT_TARGET_TOKEN)):
    c = variant["capacity"]
    variant["arguments"] += [{"name": "prompt_logprobs", "dtype": "int32", "shape": [2, c, 43], "role": "output"},
                             {"name": "prompt_target_tokens", "dtype": "int32", "shape": [c], "role": "input"}]
    variant["contract"]["bindings"]["prompt_target_tokens"] = binding
    variant["contract"]["layout"]["prompt_logprobs"] = {"buffer": "prompt_logprobs", "targets": "prompt_target_tokens",
                                                        "row_block": 64}


def test_prompt_buffers_outside_scored_prefill(core_copy):
    core_copy.edit("catalog.json", lambda c: _add_prompt_buffers(c["variants"][0]))
    assert "PROMPT-PARTIAL" in rules_of(core_copy.root, check_graphs=False)


def test_scored_prefill_rules(core_copy):
    def change(c):
        scored = dict(c["variants"][0], name="scored.c100", capacity=100, operation=int(Operation.SCORED_PREFILL))
        scored["arguments"] = [dict(a) for a in scored["arguments"]]
        scored["contract"] = {"layout": dict(scored["contract"]["layout"]), "bindings": dict(scored["contract"]["bindings"])}
        _add_prompt_buffers(scored, binding=int(ValueSource.TOKEN_IDS))
        c["variants"].append(scored)
    core_copy.edit("catalog.json", change)
    core_copy.edit("manifest.json", lambda m: m["features"].update(prompt_logprobs=True))
    found = rules_of(core_copy.root, check_graphs=False)
    assert {"PROMPT-BIND", "PROMPT-CAPACITIES"} <= found


def test_prompt_scoring_requires_k20(core_copy):
    _natural_only(core_copy, 2 + 2 * 5)

    def change(c):
        scored = dict(c["variants"][0], name="scored.c256", capacity=256, operation=int(Operation.SCORED_PREFILL))
        scored["contract"] = {"layout": dict(scored["contract"]["layout"]), "bindings": dict(scored["contract"]["bindings"])}
        scored["arguments"] = []
        scored["contract"]["bindings"] = {}
        scored["contract"]["layout"]["logprobs"] = None
        scored["contract"]["layout"]["records"] = None
        _add_prompt_buffers(scored)
        c["variants"].append(scored)
    core_copy.edit("catalog.json", change)
    core_copy.edit("manifest.json", lambda m: m.update(chunk_limit=256) or m["features"].update(prompt_logprobs=True))
    assert "PROMPT-K" in rules_of(core_copy.root, check_graphs=False)


def test_features_must_match(core_copy):
    core_copy.edit("manifest.json", lambda m: m["features"].update(explicit_ids=False, allow_logprobs=False))
    assert rules_of(core_copy.root) == {"FEAT-MISMATCH"}


def test_state_must_be_declared(core_copy):
    def change(c):
        c["variants"][0]["arguments"].append({"name": "k_cache", "dtype": "float32", "shape": [1, 2], "role": "state"})
    core_copy.edit("catalog.json", change)
    assert "STATE-DECL" in rules_of(core_copy.root, check_graphs=False)


def test_weights_must_match_file(core_copy):
    _edit_arg(core_copy, "decode.c1", "embedding.weight", shape=[256, 16])
    assert "WEIGHT-DECL" in rules_of(core_copy.root, check_graphs=False)


def test_graph_that_cannot_load(core_copy):
    (core_copy.root / "graphs" / "decode.c1.pt2").write_bytes(b"PK\x03\x04 not really a zip")
    core_copy.rehash("graphs/decode.c1.pt2")
    assert rules_of(core_copy.root) == {"GRAPH-LOAD"}


def test_graph_signature_dtype(core_copy):
    _edit_arg(core_copy, "decode.c4", "input_ids", dtype="int32")
    assert rules_of(core_copy.root) == {"GRAPH-SIGNATURE"}


def test_graph_signature_order(core_copy):
    def change(c):
        v = c["variants"][1]
        v["arguments"][2], v["arguments"][3] = v["arguments"][3], v["arguments"][2]
    core_copy.edit("catalog.json", change)
    assert rules_of(core_copy.root) == {"GRAPH-SIGNATURE"}


def test_graph_swapped_between_variants(core_copy):
    c1 = core_copy.root / "graphs" / "decode.c1.pt2"
    c4 = core_copy.root / "graphs" / "decode.c4.pt2"
    data = c1.read_bytes()
    c1.write_bytes(c4.read_bytes())
    c4.write_bytes(data)
    core_copy.rehash("graphs/decode.c1.pt2")
    core_copy.rehash("graphs/decode.c4.pt2")
    assert rules_of(core_copy.root) == {"GRAPH-SIGNATURE"}


def test_graph_mutation_roles(core_copy):
    def change(c):
        v = c["variants"][0]
        args_of(v)["slot_ids"]["role"] = "output"
        v["contract"]["bindings"].pop("slot_ids")
    core_copy.edit("catalog.json", change)
    assert rules_of(core_copy.root) == {"GRAPH-MUTATION"}


def test_every_rule_is_documented():
    text = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "api.md").read_text()
    missing = [rule for rule in RULES if f"`{rule}`" not in text]
    assert not missing, f"rules missing from docs/api.md: {missing}"


def _as_verify(core_copy, draft_tokens: int, draft_shape=None):
    """decode.c1 rewritten into the catalog entry of verify.s{S}.c1 (the graph itself is not checked)."""
    def change(catalog):
        variant = core_copy.variant(catalog, "decode.c1")
        variant.update(operation=int(Operation.SPECULATIVE_VERIFY))
        constraints = {spec.name for spec in CONSTRAINT_INPUTS}  # verify variants take no structured-output inputs
        variant["arguments"] = [a for a in variant["arguments"] if a["name"] not in constraints]
        variant["contract"]["bindings"] = {k: v for k, v in variant["contract"]["bindings"].items() if k not in constraints}
        variant["arguments"].append({"name": "draft_token_ids", "dtype": "int64", "role": "input",
                                     "shape": draft_shape or [1, draft_tokens]})
        variant["contract"]["bindings"]["draft_token_ids"] = int(ValueSource.DRAFT_TOKEN_IDS)
        variant["contract"]["layout"]["speculative"] = {"draft_tokens": draft_tokens, "positions": draft_tokens + 1,
                                                        "drafts": "draft_token_ids"}
        variant["returns"] = [{"name": "next_tokens", "dtype": "int64", "role": "output", "shape": [1, draft_tokens + 1]}]
    core_copy.edit("catalog.json", change)
    core_copy.edit("manifest.json", lambda m: m.update(capacities=[4]))  # manifest capacities list decode variants


def test_verify_entry_is_valid_and_its_positions_must_fit_t(core_copy, tmp_path):
    from conftest import CoreCopy
    good = CoreCopy(tmp_path / "good")
    shutil.copytree(core_copy.root, good.root)
    _as_verify(good, 7)  # T = 8 covers S+1 = 8
    assert rules_of(good.root, check_graphs=False) == set()
    _as_verify(core_copy, 8)
    assert rules_of(core_copy.root, check_graphs=False) == {"SPEC-T"}


def test_verify_drafts_layout_and_returns(core_copy):
    _as_verify(core_copy, 3, draft_shape=[1, 4])
    core_copy.edit("catalog.json", lambda c: core_copy.variant(c, "decode.c1")["returns"][0].update(shape=[1, 3]))
    assert rules_of(core_copy.root, check_graphs=False) == {"SPEC-DRAFTS", "SPEC-RETURNS"}


def test_drafts_only_in_verify_variants(core_copy):
    def change(catalog):
        variant = core_copy.variant(catalog, "decode.c4")
        variant["arguments"].append({"name": "draft_token_ids", "dtype": "int64", "role": "input", "shape": [4, 2]})
        variant["contract"]["bindings"]["draft_token_ids"] = int(ValueSource.DRAFT_TOKEN_IDS)
        variant["contract"]["layout"]["speculative"] = {"draft_tokens": 2, "positions": 3, "drafts": "draft_token_ids"}
    core_copy.edit("catalog.json", change)
    assert rules_of(core_copy.root, check_graphs=False) == {"SPEC-DRAFTS", "SPEC-LAYOUT"}
