"""Gemma 3 (sliding-window layers beside a global one) against transformers, and the cache-kind rules.

One tiny random checkpoint (examples/make_tiny_gemma3.py: window 8, layers sliding/full/sliding) is exported once
with chunks of 8 rows (every prompt here crosses window and chunk boundaries), prompt scoring, a verify family
and mixed graphs; its sliding layers page their own pools: a step reads 8 + 8 - 1 = 15 positions, two blocks of 16,
and the blocks a request's window has left go back to the pool.
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
from ignition.catalog.cache_kinds import CACHE_KINDS, kind_index
from ignition.catalog.geometry import NULL_BLOCK
from ignition.catalog.inspect import kind_memory
from ignition.catalog.rules import RULES
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.recipes.checkpoint import CheckpointError, read_config
from ignition.recipes.gemma3 import Gemma3Config
from ignition.runtime.core import load_core
from ignition.runtime.drafters import NgramDrafter
from ignition.runtime.options import LoadOptions
from ignition.runtime.requests import Request
from ignition.runtime.engine import Engine
from ignition.validate.core import validate_core
from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads

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
    verify rounds (rejected rows written, rewritten by the next round) all give transformers' tokens."""
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


def test_manifest_declares_each_layers_kind_and_the_sliding_pools(gemma):
    _, root, _, _ = gemma
    report = validate_core(root, check_graphs=False)  # the export checked every graph
    assert report.violations == []
    model = report.manifest["model"]
    assert model["layer_kinds"] == ["sliding", "full", "sliding"]
    assert (model["sliding_window"], model["window_cells"]) == (WINDOW, WINDOW + CHUNK - 1)
    state = {s["name"]: s["shape"] for s in report.manifest["state"]}
    # every slot's window (15 positions from anywhere in a block: 2 blocks) and the null block, whatever max_seq_len
    assert model["window_kv_blocks"] == 2 * 2 + 1
    assert state["k_window_cache"] == state["v_window_cache"] == [2, 5, 16, 2, 16]
    assert state["k_cache"] == state["v_cache"] == [1, 2 * MAX_SEQ // 16, 16, 2, 16]  # pools of 16-position blocks
    memory = kind_memory(report.manifest)
    assert memory["sliding"] == {"layers": 2, "state_bytes": 2 * 2 * 5 * 16 * 2 * 16 * 4, "positions_per_slot": 32,
                                 "buffers": ["k_window_cache", "v_window_cache"]}
    assert memory["full"]["positions_per_slot"] == MAX_SEQ and memory["full"]["layers"] == 1


@pytest.mark.parametrize("edit, rules", [
    (lambda m: m["model"].update(window_cells=16), {"GEOM-WINDOW"}),
    (lambda m: m["model"].update(window_kv_blocks=9), {"GEOM-WINDOW-BLOCKS"}),  # also the sliding pools' extent
    (lambda m: m["model"].pop("window_kv_blocks"), {"GEOM-WINDOW-BLOCKS"}),
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


def test_window_block_tables_are_declared_by_every_variant(gemma, tmp_path):
    _, root, _, _ = gemma
    shutil.copytree(root, tmp_path / "core")
    copy = CoreCopy(tmp_path / "core")

    def drop(catalog):
        variant = catalog["variants"][-1]
        variant["arguments"] = [a for a in variant["arguments"] if a["name"] != "window_block_tables"]
        variant["contract"]["bindings"].pop("window_block_tables")
    copy.edit("catalog.json", drop)
    found = {v.rule for v in validate_core(copy.root, check_graphs=False).violations}
    assert found == {"GEOM-WINDOW-TABLES"}


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
    assert state["k_window_cache"] == [2, 3, 16, 1, 16] and state["k_cache"] == [1, 2, 16, 1, 16]  # a rank's pools: its KV head
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
def test_a_decode_step_copies_no_pool(gemma, lanes, monkeypatch):
    """A decode step reads each lane's window blocks from the sliding layers' pools (two blocks of 16: the 15
    positions a step reads from anywhere in a block) and its full layer's live key window, never a pool
    (tests/test_decode_copies.py's watch): gathered for ATen's attention, or read in place by the paged attention
    kernel (``runtime/backends/paged_attention.py``), which then gathers nothing."""
    from test_decode_copies import CacheCopies

    from ignition.catalog.buffers import KEY_WINDOW, WINDOWS
    from ignition.runtime.backends import paged_attention

    _, _, core, _ = gemma
    engine = Engine(core)
    for lane in range(lanes):
        engine.submit(Request(PROMPTS[0][:12 + lane], max_tokens=8, ignore_eos=True))
    while not engine.running or any(s.prefilled < len(s.context()) for s in engine.running):
        engine.step()  # every prompt prefilled: the next step is one decode round of every lane
    pools = [core.state[name] for name in ("k_window_cache", "v_window_cache", "k_cache", "v_cache")]
    window = lanes * 2 * 16 * pools[0][0, 0, 0].nbytes  # a layer's gather: the lanes' two blocks
    watch = CacheCopies({t.untyped_storage().data_ptr() for t in pools}, window)
    windows = []
    attend = paged_attention._graph_attend

    def recorded(query, key_cache, value_cache, layer, cells, mask, scale):
        windows.append(cells.shape[0] // query.shape[0])
        return attend(query, key_cache, value_cache, layer, cells, mask, scale)

    monkeypatch.setattr(paged_attention, "_graph_attend", recorded)
    with watch:
        engine.step()
    assert watch.copies == [], watch.copies[:5]
    granule = WINDOWS[KEY_WINDOW].granule
    read = windows if core.options.native_kernels else [keys[2] for keys in watch.attention_keys]
    assert sorted(read) == sorted([32, 32, granule])  # sliding, sliding, full
    assert not (windows and watch.attention_keys)


def test_a_long_requests_sliding_blocks_stay_bounded_while_its_full_blocks_grow(gemma):
    """Prompt past the window, decode past it: after every step the request holds at most ceil((W + chunk) / bs)
    + 1 live sliding blocks (the rest of its window table the null block), while its full table covers the whole
    context; the tokens stay transformers'."""
    hf, _, core, _ = gemma
    engine = Engine(core, prefix_caching=False)
    prompt = PROMPTS[2] + PROMPTS[0][:11]  # 40 tokens
    engine.submit(Request(prompt, max_tokens=20, ignore_eos=True))
    live, full = [], []
    for _ in range(100):  # every step a round: its chunk or its decode
        engine.step()
        if not engine.running:
            break
        (state,) = engine.running
        table = list(state.window_table)
        live.append(sum(block != NULL_BLOCK for block in table))
        full.append(len(state.block_table))
    assert table[:2] == [NULL_BLOCK] * 2  # the blocks the window left (positions 0-31) were released
    assert max(live) <= -(-(WINDOW + CHUNK) // 16) + 1 and max(full) == -(-(40 + 19) // 16) == 4
    tokens, _ = hf_incremental(hf, prompt, 20)
    (state,) = engine.scheduler.finished.values()
    assert state.generated == tokens
    assert engine.scheduler.blocks.window.num_free == engine.scheduler.blocks.window.num_blocks


def test_prefix_reuse_resumes_the_windows_blocks(gemma):
    """A shared prefix longer than the window is resumed (its full blocks, and the sliding blocks of the window
    before the hit) with the tokens and logprobs of a cold prefill."""
    _, _, core, _ = gemma
    shared = PROMPTS[0] + PROMPTS[2][:16]  # 37 tokens: two full blocks of 16
    requests = [Request(shared + tail, max_tokens=6, logprobs=2, ignore_eos=True) for tail in ([], [9, 10, 11])]
    cold = [Engine(core, prefix_caching=False).generate([r])[0] for r in requests]
    engine = Engine(core)
    warm = [engine.generate([r])[0] for r in requests]
    assert engine.kv_cache_stats()["prefix_cache_hits"] == 2 * 16
    assert engine.stats["prompt_tokens_prefilled"] == 37 + (40 - 32)
    for got, want in zip(warm, cold, strict=True):
        assert got.token_ids == want.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.entries, want.entries)) < TOL


def test_preemption_and_readmission_with_a_small_pool(gemma):
    """A budget of the sliding pools and four full blocks (one max_seq_len sequence): requests are preempted and
    readmitted, and every one gets the tokens of the unbudgeted core."""
    _, root, core, _ = gemma
    sliding = core.kv_pool.window.num_blocks * core.kv_pool.window.bytes_per_block
    small = load_core(root, LoadOptions.create("cpu", kv_cache_memory=sliding + 5 * core.kv_pool.bytes_per_block))
    assert small.kv_pool.num_blocks == 5 and small.kv_pool.window.num_blocks == 5
    requests = [Request(PROMPTS[0][:14 + 3 * i] + [i + 1], max_tokens=20, logprobs=1, ignore_eos=True)
                for i in range(2)]  # 3 blocks each at their longest
    expected = Engine(core).generate(requests)
    engine = Engine(small)
    results = engine.generate(requests)
    assert engine.stats["preemptions"] > 0
    for got, want in zip(results, expected, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.entries, want.entries)) < TOL


def test_a_sliding_core_drafts_for_itself(gemma):
    """A draft core's lanes hold no block tables: the sliding pools give each slot a ring of its window's blocks
    (``KVPool.slot_layout``), and the core drafting for itself proposes transformers' tokens, all accepted."""
    from ignition.runtime.drafters import DraftCoreDrafter

    hf, _, core, _ = gemma
    engine = Engine(core, drafter=DraftCoreDrafter(core.replica(), core), draft_tokens=3, mixed=False)
    (result,) = engine.generate([Request(PROMPTS[0], max_tokens=16, logprobs=1, ignore_eos=True)])
    tokens, _ = hf_incremental(hf, PROMPTS[0], 16)
    assert result.token_ids == tokens
    assert engine.stats["proposed"] == engine.stats["accepted"] > 0


def test_the_graphs_call_bindings_that_dispatch_as_their_overloads(gemma):
    """The loader's rewrite onto torch's Python bindings (runtime/backends/direct_calls.py) keeps every operator
    call and every bit of each variant."""
    _, _, core, _ = gemma
    Engine(core).generate([Request([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=3, logprobs=2, ignore_eos=True)])
    assert assert_direct_calls_dispatch_as_overloads(core) > 0
