"""The manifest's geometry against the tensors: every red-team edit is caught by exactly its new rule.

Each case edits a real exported core (a tiny Qwen3 with KV caches, or the toy with a tokenizer)
and rehashes what it touched, so no older rule (FILE-HASH, SCHEMA, ...) can be what catches it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from _decoder_cores import TinyCase, save_checkpoint
from conftest import CoreCopy
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import CoreLoadError
from ignition.serve.app import create_app
from ignition.validate.core import validate_core
from ignition.catalog.rules import RULES
from test_publish import word_tokenizer


def rules_of(root, check_graphs=False) -> set[str]:
    report = validate_core(root, check_graphs=check_graphs)
    assert all(v.rule in RULES for v in report.violations), report.violations
    return {v.rule for v in report.violations}


@pytest.fixture(scope="module")
def decoder_core(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    save_checkpoint(TinyCase("qwen3", torch.float32, tie=False, vocab_size=150), root / "checkpoint")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "checkpoint", capacities=(1, 2), chunk_limit=8,
                              max_seq_len=32), root / "core")
    return root / "core"


@pytest.fixture(scope="module")
def toy_with_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy-tok")
    export_core(ExportOptions(recipe="toy", capacities=(1,), tokenizer=word_tokenizer(root / "tok", 40)), root / "core")
    return root / "core"


def copy_of(core, tmp_path) -> CoreCopy:
    shutil.copytree(core, tmp_path / "core")
    return CoreCopy(tmp_path / "core")


def test_exported_cores_pass_every_geometry_rule(decoder_core, toy_with_tokenizer):
    assert rules_of(decoder_core) == set()
    assert rules_of(toy_with_tokenizer) == set()


@pytest.mark.parametrize("edit, rule", [
    (lambda m: m["model"].update(num_slots=16), "GEOM-SLOTS"),  # 16 slots over a 2-slot KV cache
    (lambda m: m["model"].pop("num_slots"), "GEOM-SLOTS"),  # the loader would guess the slot count
    (lambda m: m["model"].update(max_seq_len=4096), "GEOM-SEQ"),  # admits prompts that overflow the cache
    (lambda m: m["model"].pop("max_seq_len"), "GEOM-SEQ"),  # no context bound at all
    # MemoryError in serve; the bitmask's ceil(vocab_padded / 32) words and the sample window's extent (BUF-SHAPE)
    # witness the true width too
    (lambda m: m.update(vocab_size=10**18, vocab_padded=10**18), ("GEOM-VOCAB-TENSOR", "CONSTRAINT-WORDS", "BUF-SHAPE")),
    (lambda m: m.update(vocab_size=100, vocab_padded=100), ("GEOM-VOCAB-TENSOR", "CONSTRAINT-WORDS", "BUF-SHAPE")),
    (lambda m: m["model"].update(num_layers=3), "GEOM-KIND"),  # two layer kinds for three layers
    (lambda m: m["model"].pop("layer_kinds"), ("GEOM-KIND", "GEOM-KIND-BUFFERS")),
    # the k/v caches' first extent counts the full layers, now one
    (lambda m: m["model"]["layer_kinds"].__setitem__(0, "compressed"), "GEOM-KIND-BUFFERS"),  # no CSA buffers
    (lambda m: m["model"]["layer_kinds"].__setitem__(0, "windowed"), ("GEOM-KIND", "GEOM-KIND-BUFFERS")),
    # no window caches, no sliding_window / window_cells fields
    (lambda m: m["model"]["layer_kinds"].__setitem__(1, "sliding"), "GEOM-KIND-BUFFERS"),
    (lambda m: m["model"].update(head_dim=8), "GEOM-MODEL"),
    (lambda m: m["model"].update(hidden_size=64), "GEOM-MODEL"),
    (lambda m: m["model"].update(num_heads=8), "GEOM-MODEL"),  # against the q_proj rows in the weights header
    (lambda m: m["model"].update(dtype="bfloat16"), "GEOM-MODEL"),
    (lambda m: m.update(eos_token_id=150), "GEOM-VOCAB"),
    (lambda m: m.update(chunk_limit=16), "CATALOG-PREFILL"),
    # the pools [layers, kv_blocks, block_size, ...]: 2 slots x ceil(32 / 16) blocks of 16
    (lambda m: m["model"].update(block_size=8), ("GEOM-BLOCK-SIZE", "GEOM-SEQ")),  # the tables' width is 2, not 4
    (lambda m: m["model"].update(block_size=12), ("GEOM-BLOCK-SIZE", "GEOM-SEQ")),  # and 12 does not divide 32
    (lambda m: m["model"].pop("block_size"), "GEOM-BLOCK-SIZE"),
    (lambda m: m["model"].update(kv_blocks=64), "GEOM-KV-BLOCKS"),  # more blocks than the pools declare
    (lambda m: m["model"].pop("kv_blocks"), "GEOM-KV-BLOCKS"),
])
def test_manifest_geometry_edit_is_caught_by_its_rule(decoder_core, tmp_path, edit, rule):
    core = copy_of(decoder_core, tmp_path)
    core.edit("manifest.json", edit)
    assert rules_of(core.root) == ({rule} if isinstance(rule, str) else set(rule))


def test_block_tables_are_declared_by_every_variant_of_a_paged_core(decoder_core, tmp_path):
    core = copy_of(decoder_core, tmp_path)

    def drop(catalog):
        variant = catalog["variants"][-1]
        variant["arguments"] = [a for a in variant["arguments"] if a["name"] != "block_tables"]
        variant["contract"]["bindings"].pop("block_tables")
    core.edit("catalog.json", drop)
    assert "GEOM-BLOCK-TABLES" in rules_of(core.root)


def test_num_slots_below_the_widest_decode(decoder_core, tmp_path):
    core = copy_of(decoder_core, tmp_path)
    core.edit("manifest.json", lambda m: m["model"].update(num_slots=1))
    assert "GEOM-SLOTS" in rules_of(core.root)


def test_vocab_size_as_a_float_is_not_an_integer(decoder_core, tmp_path):
    core = copy_of(decoder_core, tmp_path)
    core.edit("manifest.json", lambda m: m.update(vocab_size=1e18))
    assert rules_of(core.root) == {"SCHEMA"}


def test_a_core_without_vocabulary_weights(core_copy):
    from safetensors.torch import load_file, save_file
    weights = load_file(str(core_copy.root / "weights.safetensors"))
    save_file({"renamed." + name: t for name, t in weights.items()}, str(core_copy.root / "weights.safetensors"))
    core_copy.rehash("weights.safetensors")
    assert "GEOM-VOCAB-TENSOR" in rules_of(core_copy.root)  # alongside WEIGHT-DECL for the renamed arguments


def _drop_variant(core: CoreCopy, name: str) -> None:
    catalog = core.load("catalog.json")
    variant = core.variant(catalog, name)
    catalog["variants"].remove(variant)
    (core.root / variant["graph"]).unlink()
    core.save("catalog.json", catalog)
    core.edit("manifest.json", lambda m: m["files"].pop(variant["graph"]))


def test_catalog_without_prefill_is_refused(core_copy):
    _drop_variant(core_copy, "prefill.t256")
    assert rules_of(core_copy.root, check_graphs=True) == {"CATALOG-PREFILL"}


def test_catalog_without_decode_is_refused(core_copy):
    _drop_variant(core_copy, "decode.c1")
    _drop_variant(core_copy, "decode.c4")
    core_copy.edit("manifest.json", lambda m: m.update(capacities=[]))
    assert rules_of(core_copy.root) == {"CATALOG-DECODE"}


def test_tokenizer_vocabulary_larger_than_the_core(toy_with_tokenizer, tmp_path):
    core = copy_of(toy_with_tokenizer, tmp_path)
    word_tokenizer(tmp_path / "big", 300)
    shutil.copyfile(tmp_path / "big" / "tokenizer.json", core.root / "tokenizer" / "tokenizer.json")
    core.rehash("tokenizer/tokenizer.json")
    assert rules_of(core.root) == {"GEOM-TOKENIZER"}


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", b'{"version": "1.0", "model": {"type": "Nope"}}'),
    ("tokenizer.json", b"not json"),
    ("tokenizer_config.json", b"[" * 100_000 + b"]" * 100_000),
    ("tokenizer_config.json", b'{"eos_token": NaN}'),
])
def test_corrupt_tokenizer_files_in_a_core(toy_with_tokenizer, tmp_path, name, content):
    core = copy_of(toy_with_tokenizer, tmp_path)
    (core.root / "tokenizer" / name).write_bytes(content)
    core.rehash(f"tokenizer/{name}")
    assert rules_of(core.root) == {"TOKENIZER-PARSE"}


@pytest.mark.parametrize("name", ["manifest.json", "catalog.json"])
def test_deeply_nested_json_is_a_parse_finding(core_copy, name):
    (core_copy.root / name).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    if name != "manifest.json":
        core_copy.rehash(name)
    assert rules_of(core_copy.root) == {"JSON-PARSE"}


def test_nesting_just_beyond_the_limit_is_a_parse_finding(core_copy):
    core_copy.edit("manifest.json", lambda m: m["model"].update(architecture=json.loads("[" * 40 + "]" * 40)))
    assert rules_of(core_copy.root) == {"JSON-PARSE"}


def test_serve_refuses_more_slots_than_the_kv_cache(decoder_core, tmp_path):
    core = copy_of(decoder_core, tmp_path)
    core.edit("manifest.json", lambda m: m["model"].update(num_slots=16))
    with pytest.raises(CoreLoadError, match="GEOM-SLOTS"):
        create_app(core.root)


@pytest.mark.parametrize("command", [["run", "--prompt-ids", "1,2"], ["serve", "--port", "1"]])
def test_run_and_serve_refuse_a_geometry_edit_cleanly(core_copy, command):
    core_copy.edit("manifest.json", lambda m: m.update(vocab_size=10**18, vocab_padded=10**18))
    result = CliRunner().invoke(app, [command[0], str(core_copy.root), *command[1:]])
    assert result.exit_code == 1, result.output
    assert "cannot load core" in result.output and "GEOM-VOCAB-TENSOR" in result.output
    assert isinstance(result.exception, SystemExit), result.exception  # typer.Exit, not an escaped error


@pytest.mark.parametrize("window", ["sample_window", "transform_window"])
def test_a_vocabulary_window_shorter_than_the_vocabulary_is_refused(decoder_core, tmp_path, window):
    """A runtime passes the sample window's whole extent when a lane samples, and the transform window's when a lane
    has a constraint or penalty: declared shorter than vocab_padded, sampled tokens would come from a prefix of the
    vocabulary, or the columns past it would escape the constraints and penalties."""
    core = copy_of(decoder_core, tmp_path)

    def shorten(catalog):
        for variant in catalog["variants"]:
            for argument in variant["arguments"]:
                if argument["name"] == window:
                    argument["shape"] = [64]
    core.edit("catalog.json", shorten)
    assert rules_of(core.root) == {"BUF-SHAPE"}


def test_the_program_reader_builds_torchs_graphs_for_a_decoders_graphs(decoder_core):
    """validate/program_reader.py on a GQA decoder's graphs: windows (symbolic extents and their bounds), mixed,
    scored; the same graphs, facts and runs as torch.export.load (tests/_program_oracle.py)."""
    from _program_oracle import assert_core_read_alike

    catalog = json.loads((decoder_core / "catalog.json").read_text())
    programs = assert_core_read_alike(decoder_core)
    windowed = [v["name"] for v in catalog["variants"] if v["contract"]["layout"].get("windows")]
    assert len(windowed) >= 2 and all(programs[name].bounds for name in windowed)


def test_the_schema_reader_builds_torchs_dataclasses_for_a_decoders_graphs(decoder_core):
    """validate/schema_reader.py on a GQA decoder's graphs (windows, symbolic extents); the toy core's are in
    tests/test_schema_reader.py."""
    from torch._export.serde import schema, serialize
    from torch._export.serde.union import _Union

    from ignition.validate.schema_reader import SchemaReader
    from tests.test_schema_reader import _program_json

    original = serialize._dict_to_dataclass
    original = original.replaced if isinstance(original, SchemaReader) else original
    reader = SchemaReader(schema, _Union)
    graphs = sorted((decoder_core / "graphs").glob("*.pt2"))
    assert len(graphs) >= 4
    for path in graphs:
        data = _program_json(path)
        assert reader(schema.ExportedProgram, data) == original(schema.ExportedProgram, data), path.name
