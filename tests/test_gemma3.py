"""Gemma 3 (sliding-window layers beside a global one) against transformers, and the cache-kind rules.

One tiny random checkpoint (examples/make_tiny_gemma3.py: window 8, layers sliding/full/sliding) is exported once
with chunks of 8 rows (every prompt here crosses window and chunk boundaries), prompt scoring, a verify family
and mixed graphs; its sliding layers keep a ring of 8 + 8 - 1 = 15 cells a slot.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM

from conftest import CoreCopy
from ignition.catalog.cache_kinds import CACHE_KINDS, kind_index, window_cells
from ignition.catalog.inspect import kind_memory
from ignition.catalog.rules import RULES
from ignition.exporter.export import export_core
from ignition.recipes.attention import sliding_mask
from ignition.recipes.base import ExportOptions
from ignition.recipes.checkpoint import CheckpointError, read_config
from ignition.recipes.gemma3 import Gemma3Config
from ignition.runtime.core import load_core
from ignition.runtime.drafters import NgramDrafter
from ignition.runtime.requests import Request
from ignition.runtime.engine import Engine
from ignition.validate.core import validate_core

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_gemma3", Path(__file__).parents[1] / "examples" / "make_tiny_gemma3.py")
make_tiny_gemma3 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_gemma3)

WINDOW, CHUNK, MAX_SEQ = 8, 8, 64
TOL = 1e-5  # fp32: our logits differ from transformers' by ~1e-6
VOCAB = 300  # the tokenizer's ids; the embedding has 320 rows
PROMPTS = ([(5 * i + 1) % VOCAB for i in range(21)],  # three chunks, past the window
           [(3 * i + 2) % VOCAB for i in range(5)],  # shorter than the window; decode goes past it
           [7, 8, 9, 10] * 7 + [7])  # 29 tokens, repetitive: prompt lookup proposes


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    make_tiny_gemma3.make_checkpoint(root / "ckpt", window=WINDOW)
    export_core(ExportOptions(recipe="gemma3", checkpoint=root / "ckpt", capacities=(1, 2), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ, prompt_logprobs=True, speculative_tokens=(3,), mixed=True),
                root / "core")
    hf = Gemma3ForCausalLM.from_pretrained(root / "ckpt", dtype=torch.float32, attn_implementation="eager").eval()
    return hf, root / "core", load_core(root / "core"), root / "ckpt"


def hf_rows(hf, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' full forward over ``tokens``: ``[len, vocab]`` float64."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1)


def hf_incremental(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' eager greedy decode with its own (sliding-window) cache: tokens and each step's logprobs."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    rows = torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1)  # [steps, vocab]
    return out.sequences[0, len(prompt):].tolist(), rows


def assert_entries_match(result, rows: torch.Tensor, k: int) -> None:
    for step, (token, entry) in enumerate(zip(result.token_ids, result.entries)):
        row = rows[step]
        assert token == int(row.argmax()), step
        assert abs(entry.logprob - row[token].item()) < TOL, step
        values = torch.tensor([v for _, v in entry.top], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(values, row[[i for i, _ in entry.top]], atol=TOL, rtol=0)


def test_the_window_changes_transformers_logits(gemma):
    """The oracle itself depends on the window: a prompt past it reads differently with a full-length window."""
    hf, _, _, checkpoint = gemma
    wide = Gemma3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager",
                                             sliding_window=MAX_SEQ).eval()
    assert (hf_rows(hf, PROMPTS[0]) - hf_rows(wide, PROMPTS[0]))[WINDOW:].abs().max() > 1e-2
    assert (hf_rows(hf, PROMPTS[0]) - hf_rows(wide, PROMPTS[0]))[:WINDOW].abs().max() < 1e-9


def test_generation_matches_transformers_incremental_decode(gemma):
    """Greedy tokens and K=20 logprobs equal transformers' eager incremental decode, prompts longer and shorter
    than the window, decoding well past it (packed prompt chunks, then decode lanes)."""
    hf, _, core, _ = gemma
    steps = 24
    results = Engine(core).generate([Request(p, max_tokens=steps, logprobs=20, ignore_eos=True) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        tokens, rows = hf_incremental(hf, prompt, steps)
        assert result.error is None and result.token_ids == tokens
        assert_entries_match(result, rows, 20)


def test_explicit_ids_match_transformers(gemma):
    hf, _, core, _ = gemma
    ids = [299, 0, 17, 3]
    (result,) = Engine(core).generate([Request(PROMPTS[0], max_tokens=12, logprob_token_ids=ids, ignore_eos=True)])
    rows = hf_rows(hf, PROMPTS[0] + result.token_ids)
    for step, entry in enumerate(result.entries):
        assert [i for i, _ in entry.top] == ids
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top], dtype=torch.float64),
                                   rows[len(PROMPTS[0]) + step - 1][ids], atol=TOL, rtol=0)


def test_prompt_logprobs_match_the_full_forward(gemma):
    hf, _, core, _ = gemma
    prompt = PROMPTS[2] + PROMPTS[0]  # 50 tokens: seven chunks
    (result,) = Engine(core).generate([Request(prompt, max_tokens=0, prompt_logprobs=20)])
    rows = hf_rows(hf, prompt)
    assert result.error is None and result.prompt_entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = result.prompt_entries[position], rows[position - 1]
        assert entry["id"] == prompt[position] and abs(entry["logprob"] - row[prompt[position]].item()) < TOL
        values = torch.tensor([t["logprob"] for t in entry["top_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:20], atol=TOL, rtol=0)


def summary(results):
    return [(r.token_ids, [[i for i, _ in e.top] for e in r.entries], r.error) for r in results]


def test_mixed_serial_batch_invariant_and_speculative_rounds_agree(gemma):
    """Mixed rounds (a prompt chunk beside a decode lane), serial chunks, batch-invariant decode and speculative
    verify rounds (rejected rows written into the ring, then rolled back) all give transformers' tokens."""
    hf, _, core, _ = gemma
    requests = [Request(p, max_tokens=16, logprobs=3, ignore_eos=True) for p in (PROMPTS[1], PROMPTS[0])]
    serial = Engine(core, mixed=False, packed=False).generate(requests)
    mixed_engine = Engine(core, packed=False)
    mixed = mixed_engine.generate(requests)
    invariant = Engine(core, batch_invariant=True).generate(requests)
    speculative_engine = Engine(core, drafter=NgramDrafter(), draft_tokens=3, mixed=False)
    speculative = speculative_engine.generate([Request(p, max_tokens=16, logprobs=3, ignore_eos=True)
                                               for p in (PROMPTS[2], PROMPTS[0])])
    assert mixed_engine.stats["mixed_rounds"] >= 1
    assert speculative_engine.stats["proposed"] > speculative_engine.stats["accepted"] > 0
    assert summary(serial) == summary(mixed) == summary(invariant)
    for prompt, result in [(PROMPTS[1], serial[0]), (PROMPTS[0], serial[1]), (PROMPTS[2], speculative[0]),
                           (PROMPTS[0], speculative[1])]:
        tokens, rows = hf_incremental(hf, prompt, 16)
        assert result.token_ids == tokens
        for step, entry in enumerate(result.entries):
            assert abs(entry.logprob - rows[step][entry.id].item()) < TOL
    for a, b in zip(serial + invariant, mixed + serial):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.entries, b.entries)) < TOL


def test_manifest_declares_each_layers_kind_and_the_ring(gemma):
    _, root, _, _ = gemma
    report = validate_core(root, check_graphs=False)  # the export checked every graph
    assert report.violations == []
    model = report.manifest["model"]
    assert model["layer_kinds"] == ["sliding", "full", "sliding"]
    assert (model["sliding_window"], model["window_cells"]) == (WINDOW, WINDOW + CHUNK - 1)
    state = {s["name"]: s["shape"] for s in report.manifest["state"]}
    assert state["k_window_cache"] == state["v_window_cache"] == [2, 2, WINDOW + CHUNK - 1, 2, 16]
    assert state["k_cache"] == state["v_cache"] == [1, 2 * MAX_SEQ // 16, 16, 2, 16]  # pools of 16-position blocks
    memory = kind_memory(report.manifest)
    assert memory["sliding"] == {"layers": 2, "state_bytes": 2 * 2 * 2 * 15 * 2 * 16 * 4, "positions_per_slot": 15,
                                 "buffers": ["k_window_cache", "v_window_cache"]}
    assert memory["full"]["positions_per_slot"] == MAX_SEQ and memory["full"]["layers"] == 1


@pytest.mark.parametrize("edit, rules", [
    (lambda m: m["model"].update(window_cells=16), {"GEOM-WINDOW"}),  # also the rings' position extent
    (lambda m: m["model"].update(sliding_window=4), {"GEOM-WINDOW"}),
    (lambda m: m["model"]["layer_kinds"].__setitem__(1, "compressed"), {"GEOM-KIND-BUFFERS"}),  # no CSA buffers
    (lambda m: m["model"]["layer_kinds"].__setitem__(1, "sliding"), {"GEOM-KIND-BUFFERS"}),  # k_cache has no layers
    (lambda m: m["model"].pop("sliding_window"), {"GEOM-KIND-BUFFERS"}),
])
def test_cache_kind_edits_are_caught(gemma, tmp_path, edit, rules):
    _, root, _, _ = gemma
    shutil.copytree(root, tmp_path / "core")
    copy = CoreCopy(tmp_path / "core")
    copy.edit("manifest.json", edit)
    found = {v.rule for v in validate_core(copy.root, check_graphs=False).violations}
    assert found == rules and rules <= set(RULES)


def test_the_ring_holds_every_position_a_row_reads():
    """Simulate chunked writes (and a verify round's rejected rows) into a ring sized by ``window_cells``: every
    row's visible cells (``sliding_mask``) hold exactly the positions (p - W, p]."""
    for window, rows_per_step in ((3, 1), (4, 5), (8, 8), (5, 2)):
        cells = window_cells(window, rows_per_step, 1000)
        ring = torch.full((cells,), -1)
        start = 0
        while start < 40:
            step = torch.arange(start, start + rows_per_step)
            ring[step % cells] = step  # every row writes before any reads
            hidden = sliding_mask(torch.arange(cells), step.view(1, -1), window, 1, torch.bool)[0, 0]  # [R, cells]
            for row, position in enumerate(step.tolist()):
                seen = sorted(ring[~hidden[row]].tolist())
                assert seen == list(range(max(0, position - window + 1), position + 1)), (window, position)
            start += 1 if rows_per_step > 1 and start % 3 == 0 else rows_per_step  # a rollback: accept one row


def test_kind_table_and_config_refusals(gemma):
    _, _, _, checkpoint = gemma
    assert kind_index(("sliding", "full", "sliding"), 2) == 1 and CACHE_KINDS["compressed"].built
    config = read_config(checkpoint)
    for field, value in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                         ("hidden_activation", "silu"), ("layer_types", ["sliding_attention"])):
        with pytest.raises(CheckpointError, match=field):
            Gemma3Config.from_hf_config(config | {field: value}, "config.json")
    legacy = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    parsed = Gemma3Config.from_hf_config(legacy | {"sliding_window_pattern": 2, "rope_theta": 5e5,
                                                   "rope_local_base_freq": 1e4}, "config.json")
    assert parsed.layer_kinds == ("sliding", "full", "sliding")
    assert (parsed.global_rope.rope_theta, parsed.local_rope.rope_theta) == (5e5, 1e4)


def test_multimodal_checkpoint_exports_its_text_model(gemma, tmp_path, caplog):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP tower beside the text model): the recipe reads
    text_config and the language model's tensors, leaves the tower out and says so in one log line."""
    from transformers import Gemma3Config as HFGemma3Config
    from transformers import Gemma3ForConditionalGeneration, SiglipVisionConfig

    from ignition.recipes.registry import build_recipe

    hf, _, _, checkpoint = gemma
    text = {k: v for k, v in read_config(checkpoint).items() if k not in ("architectures", "transformers_version")}
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    multimodal = Gemma3ForConditionalGeneration(HFGemma3Config(text_config=text, vision_config=vision.to_dict(),
                                                               mm_tokens_per_image=4, tie_word_embeddings=False))
    multimodal.model.language_model.load_state_dict(hf.model.state_dict())
    multimodal.lm_head.load_state_dict(hf.lm_head.state_dict())
    multimodal.save_pretrained(tmp_path / "multimodal")
    options = dict(recipe="gemma3", capacities=(1,), chunk_limit=CHUNK, max_seq_len=MAX_SEQ)
    with caplog.at_level("WARNING", logger="ignition.recipes"):
        built = build_recipe(ExportOptions(checkpoint=tmp_path / "multimodal", **options))
    assert [r.message for r in caplog.records if "text model only" in r.message] != [] and len(caplog.records) == 1
    text_only = build_recipe(ExportOptions(checkpoint=checkpoint, **options))
    assert built.weights.keys() == text_only.weights.keys()
    assert all(torch.equal(built.weights[name], text_only.weights[name]) for name in built.weights)
    assert built.model | {"architecture": "-"} == text_only.model | {"architecture": "-"}
    assert built.model["architecture"] == "Gemma3ForConditionalGeneration"


def test_tensor_parallel_two_ranks_match_one(gemma, tmp_path):
    """--tensor-parallel 2 (heads, MLP columns, vocabulary and both kinds' caches split by rank): the same tokens,
    ids and order as the single-rank core, logprobs within 1e-5, decoding past the window."""
    from _tp_runner import as_json, requests

    _, _, core, checkpoint = gemma
    export_core(ExportOptions(recipe="gemma3", checkpoint=checkpoint, capacities=(1,), chunk_limit=CHUNK,
                              max_seq_len=32, tensor_parallel=2), tmp_path / "tp2")
    state = {s["name"]: s["shape"] for s in json.loads((tmp_path / "tp2" / "manifest.json").read_text())["state"]}
    assert state["k_window_cache"] == [2, 1, WINDOW + CHUNK - 1, 1, 16] and state["k_cache"] == [1, 2, 16, 1, 16]  # a rank's pool: its KV head
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("_tp_runner.py")), str(tmp_path / "tp2"), "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (sharded,) = json.loads(done.stdout.splitlines()[-1])["results"]
    single = [as_json(r) for r in Engine(core).generate(requests())]
    for one, two in zip(single, sharded, strict=True):
        assert two["error"] is None and two["tokens"] == one["tokens"]
        for a, b in zip(one["entries"], two["entries"], strict=True):
            assert [i for i, _ in a["top"]] == [i for i, _ in b["top"]] and abs(a["logprob"] - b["logprob"]) < TOL
            assert max(abs(v - w) for (_, v), (_, w) in zip(a["top"], b["top"])) < TOL


@pytest.mark.parametrize("lanes", [2, 1])
def test_a_decode_step_copies_no_ring(gemma, lanes):
    """A decode step reads the sliding layers' rings in place (two lanes over both slots) or copies one slot's
    ring (one lane), never more; its sliding layers attend over the ring's cells, its full layer over the live
    key window (tests/test_decode_copies.py's watch)."""
    from test_decode_copies import CacheCopies

    from ignition.catalog.buffers import KEY_WINDOW, WINDOWS

    _, _, core, _ = gemma
    engine = Engine(core)
    for lane in range(lanes):
        engine.submit(Request(PROMPTS[0][:12 + lane], max_tokens=8, ignore_eos=True))
    while not engine.running or any(s.prefilled < len(s.context()) for s in engine.running):
        engine.step()  # every prompt prefilled: the next step is one decode round of every lane
    rings = [core.state[name] for name in ("k_window_cache", "v_window_cache")]
    watch = CacheCopies({t.untyped_storage().data_ptr() for t in rings}, rings[0][0, 0].nbytes)  # a layer's slot
    with watch:
        engine.step()
    assert watch.copies == [], watch.copies[:5]
    cells, window = WINDOW + CHUNK - 1, WINDOWS[KEY_WINDOW].granule
    assert sorted(keys[2] for keys in watch.attention_keys) == [cells, cells, window]  # sliding, sliding, full
