"""GPT-OSS (sinks on sliding and full layers, routed clamped-SwiGLU experts, YaRN) against transformers, and MXFP4.

One tiny random checkpoint (examples/make_tiny_gpt_oss.py: window 8, layers sliding/full/sliding, non-zero sinks,
4 experts with 2 a token) is exported once with chunks of 8 rows (every prompt here crosses window and chunk
boundaries), prompt scoring, a verify family and mixed graphs; the oracle is transformers' eager ``GptOssForCausalLM``.
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
from test_gemma3 import PROMPTS, TOL, VOCAB, assert_entries_match, hf_incremental, hf_rows
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.recipes.checkpoint import CheckpointError, open_checkpoint, read_config
from ignition.recipes.gpt_oss import WEIGHT_MAP, GptOssConfig
from ignition.recipes.mxfp4 import dequantize_mxfp4, open_gpt_oss_checkpoint
from ignition.recipes.weights import load_weights
from ignition.runtime.core import load_core
from ignition.runtime.drafters import NgramDrafter
from ignition.runtime.requests import Request
from ignition.runtime.engine import Engine
from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_gpt_oss", Path(__file__).parents[1] / "examples" / "make_tiny_gpt_oss.py")
make_tiny_gpt_oss = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny_gpt_oss)

WINDOW, CHUNK, MAX_SEQ = 8, 8, 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_gpt_oss.make_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ckpt", window=WINDOW)


@pytest.fixture(scope="module")
def gpt_oss(checkpoint):
    core = checkpoint.parent / "core"
    export_core(ExportOptions(recipe="gpt_oss", checkpoint=checkpoint, capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ, prompt_logprobs=True, speculative_tokens=(3,), mixed=True),
                core)
    hf = GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return hf, core, load_core(core), checkpoint


def test_generation_matches_transformers_incremental_decode(gpt_oss):
    """Greedy tokens and K=20 logprobs equal transformers' eager incremental decode, prompts longer and shorter
    than the window, decoding well past it (two lanes at once, then one)."""
    hf, _, core, _ = gpt_oss
    steps = 16
    results = Engine(core).generate([Request(p, max_tokens=steps, logprobs=20, ignore_eos=True) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        tokens, rows = hf_incremental(hf, prompt, steps)
        assert result.error is None and result.token_ids == tokens
        assert len(set(tokens)) >= 3  # the tiny model does not repeat one token
        assert_entries_match(result, rows, 20)


def test_prompt_logprobs_match_the_full_forward(gpt_oss):
    hf, _, core, _ = gpt_oss
    prompt = PROMPTS[2]  # 29 tokens: four chunks
    (result,) = Engine(core).generate([Request(prompt, max_tokens=0, prompt_logprobs=20)])
    rows = hf_rows(hf, prompt)
    assert result.error is None and result.prompt_entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = result.prompt_entries[position], rows[position - 1]
        assert entry["id"] == prompt[position] and abs(entry["logprob"] - row[prompt[position]].item()) < TOL
        values = torch.tensor([t["logprob"] for t in entry["top_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:20], atol=TOL, rtol=0)


def test_the_sinks_and_the_window_change_transformers_logits(gpt_oss):
    """The oracle depends on what the export must reproduce: without sinks (a sink of -inf takes no probability)
    or with a full-length window, transformers' rows move by far more than the tolerance."""
    hf, _, _, checkpoint = gpt_oss
    reference = hf_rows(hf, PROMPTS[0])
    no_sinks = GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    for layer in no_sinks.model.layers:
        assert layer.self_attn.sinks.abs().min() > 0
        layer.self_attn.sinks.data.fill_(float("-inf"))
    assert (reference - hf_rows(no_sinks, PROMPTS[0])).abs().max() > 1e-2
    wide = GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager",
                                             sliding_window=MAX_SEQ).eval()
    assert (reference - hf_rows(wide, PROMPTS[0]))[WINDOW:].abs().max() > 1e-2


def test_speculative_rounds_give_transformers_tokens(gpt_oss):
    """Verify rounds write rejected rows, which the next round rewrites; tokens and logprobs stay transformers'."""
    hf, _, core, _ = gpt_oss
    engine = Engine(core, drafter=NgramDrafter(), draft_tokens=3)
    results = engine.generate([Request(p, max_tokens=12, logprobs=3, ignore_eos=True) for p in PROMPTS[1:]])
    assert engine.stats["proposed"] > engine.stats["accepted"] > 0
    for prompt, result in zip(PROMPTS[1:], results):
        tokens, rows = hf_incremental(hf, prompt, 12)
        assert result.token_ids == tokens
        assert max(abs(e.logprob - rows[step][e.id].item()) for step, e in enumerate(result.entries)) < TOL


def test_mixed_serial_and_batch_invariant_rounds_agree(gpt_oss):
    """Mixed rounds (a prompt chunk beside a decode lane), serial chunks and batch-invariant decode give the same
    tokens and logprobs, transformers' ones."""
    hf, _, core, _ = gpt_oss
    requests = [Request(p, max_tokens=10, logprobs=3, ignore_eos=True) for p in (PROMPTS[1], PROMPTS[0])]
    serial = Engine(core, mixed=False).generate(requests)
    mixed_engine = Engine(core)
    mixed = mixed_engine.generate(requests)
    invariant = Engine(core, batch_invariant=True).generate(requests)
    assert mixed_engine.stats["mixed_rounds"] >= 1
    summary = [[(r.token_ids, [[i for i, _ in e.top] for e in r.entries], r.error)] for r in (serial + mixed)]
    assert summary[:2] == summary[2:]
    for prompt, result in zip((PROMPTS[1], PROMPTS[0]), serial):
        assert result.token_ids == hf_incremental(hf, prompt, 10)[0]
    for a, b in zip(serial + invariant, mixed + serial):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.entries, b.entries)) < TOL


def test_packed_prompt_chunks_match_transformers_and_the_serial_rounds(gpt_oss):
    """The packed prefill (its rows static, as the experts' capacity ladder needs; only valid rows are routed, and
    only the segment window narrows): two prompts' chunks a submission, crossing window and chunk boundaries, give
    transformers' tokens and K=5 logprobs, and the serial rounds' tokens and values."""
    hf, root, core, _ = gpt_oss
    catalog = json.loads((root / "catalog.json").read_text())
    (packed,) = [v for v in catalog["variants"] if v["name"].startswith("packed.")]
    assert packed["name"] == f"packed.t{CHUNK}.c2" and "segment_window" in packed["contract"]["layout"]["windows"]
    assert "packed_input_ids" not in packed["contract"]["layout"]["windows"]
    requests = [Request(p, max_tokens=8, logprobs=5, ignore_eos=True) for p in (PROMPTS[0], PROMPTS[2])]
    engine = Engine(core, mixed=False)
    results = engine.generate(requests)
    assert engine.stats["packed_rounds"] >= 3  # 8+8, 8+8, 5+8 rows
    serial = Engine(core, mixed=False, packed=False).generate(requests)
    for prompt, result, alone in zip((PROMPTS[0], PROMPTS[2]), results, serial):
        tokens, rows = hf_incremental(hf, prompt, 8)
        assert result.error is None and result.token_ids == tokens == alone.token_ids
        assert_entries_match(result, rows, 5)
        assert max(abs(x.logprob - y.logprob) for x, y in zip(result.entries, alone.entries)) < TOL


def test_padding_rows_run_no_expert():
    """Dispatch.sort with a validity mask: an invalid row's assignments are counted by no expert and sort after
    every segment, so a static graph's padding rows never reach an expert's GEMM."""
    from ignition.recipes.moe import Dispatch

    experts = torch.tensor([[2, 0], [1, 2], [0, 1]])
    weights = torch.arange(6, dtype=torch.float32).view(3, 2)
    every = Dispatch.sort(experts, weights, 3)
    some = Dispatch.sort(experts, weights, 3, valid=torch.tensor([True, False, True]))
    assert every.counts.tolist() == [2, 2, 2] and some.counts.tolist() == [2, 1, 1]
    assert some.starts.tolist() == [0, 2, 3] and some.rows[:4].tolist() == [0, 2, 2, 0]
    assert some.weights[:4].tolist() == [1.0, 4.0, 5.0, 0.0] and some.rows[4:].tolist() == [1, 1]


def test_manifest_declares_each_layers_kind(gpt_oss):
    model = gpt_oss[2].manifest["model"]  # the module's loaded core (a second load_core took 5 s)
    assert model["layer_kinds"] == ["sliding", "full", "sliding"]
    assert (model["sliding_window"], model["window_cells"]) == (WINDOW, WINDOW + CHUNK - 1)


def test_tensor_parallel_two_ranks_match_one(gpt_oss, tmp_path):
    """--tensor-parallel 2 (query and KV heads with their sinks and biases, every expert's intermediate columns, the
    vocabulary and both kinds' caches split by rank; router replicated): the same tokens, ids and order as the
    single-rank core, logprobs within 1e-5 (the experts' partial sums are added in another order), decoding past the
    window."""
    from _tp_runner import as_json, requests

    _, _, core, checkpoint = gpt_oss
    export_core(ExportOptions(recipe="gpt_oss", checkpoint=checkpoint, capacities=(1,), chunk_limit=CHUNK,
                              max_seq_len=32, tensor_parallel=2), tmp_path / "tp2")
    manifest = json.loads((tmp_path / "tp2" / "manifest.json").read_text())
    state = {s["name"]: s["shape"] for s in manifest["state"]}
    assert state["k_window_cache"] == [2, 3, 16, 1, 16] and state["k_cache"] == [1, 2, 16, 1, 16]  # a rank's pools: its KV head
    shards = manifest["tensor_parallel"]["shards"]
    assert (shards["layers.0.sinks"]["shard"], shards["layers.0.experts.gate_up"]["shard"]) == ([2], [4, 64, 64])
    assert (shards["layers.0.experts.down"]["shard"], shards["layers.0.router"]["kind"]) == ([4, 32, 64],
                                                                                             "replicated")
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


def test_onnx_graphs_replay_the_torch_core(tmp_path):
    """--onnx: the sinks, the ring and the experts' conds translate; onnxruntime's replay gives the torch graphs'
    tokens, ids in order and values (tests/test_onnx_runtime.py's tolerance), prompts longer than the window. The
    checkpoint's first two layers (one sliding, one full) have every kind the translation meets: the third layer
    only lengthened the ONNX translation, which takes most of this test's time (its experts' conds)."""
    pytest.importorskip("onnxruntime")
    from test_onnx_runtime import assert_same_results, replay_both

    checkpoint = make_tiny_gpt_oss.make_checkpoint(tmp_path / "ckpt", window=WINDOW, layers=2)
    export_core(ExportOptions(recipe="gpt_oss", checkpoint=checkpoint, capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ, onnx=True), tmp_path / "onnx")
    assert json.loads((tmp_path / "onnx" / "manifest.json").read_text())["model"]["layer_kinds"] == ["sliding", "full"]
    want, got, _ = replay_both(tmp_path / "onnx", VOCAB, scored=False)
    assert_same_results(want, got)
    assert max(len(r.token_ids) for r in got) > 1 and all(r.error is None for r in got)


def test_mxfp4_experts_are_dequantized_as_transformers_does(checkpoint, tmp_path):
    """An MXFP4-stored copy of the checkpoint (the published layout: ``*_blocks``/``*_scales``) reads back as the
    exact values its codes stand for, equal to transformers' own dequantization (its function, and the model it
    loads from the MXFP4 checkpoint) and within one e2m1 step of the BF16 weights; everything else is the BF16
    checkpoint's."""
    shutil.copytree(checkpoint, tmp_path / "mxfp4")
    recovered = make_tiny_gpt_oss.store_mxfp4(tmp_path / "mxfp4")
    stored = open_checkpoint(tmp_path / "mxfp4")
    cfg = GptOssConfig.from_hf_config(read_config(tmp_path / "mxfp4"), "config.json")
    assert cfg.mxfp4 and any(name.endswith("_blocks") for name in stored.names())
    ours = load_weights(open_gpt_oss_checkpoint(tmp_path / "mxfp4"), cfg, WEIGHT_MAP)
    plain = load_weights(open_checkpoint(checkpoint), cfg, WEIGHT_MAP)
    hf = GptOssForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32,
                                           quantization_config=Mxfp4Config(dequantize=True))
    for layer in range(cfg.num_layers):
        experts = hf.model.layers[layer].mlp.experts
        assert torch.equal(ours[f"layers.{layer}.experts.gate_up"], experts.gate_up_proj)
        assert torch.equal(ours[f"layers.{layer}.experts.down"], experts.down_proj)
        for hf_name, name in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            full = f"model.layers.{layer}.mlp.experts.{hf_name}"
            blocks, scales = stored.load(full + "_blocks"), stored.load(full + "_scales")
            theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            value = ours[f"layers.{layer}.experts.{name}"]
            assert torch.equal(value, theirs) and torch.equal(value, recovered[full])
            original = plain[f"layers.{layer}.experts.{name}"]
            step = 2.0 ** (scales.float() - 127 + 1).transpose(-2, -1).repeat_interleave(32, -2)  # widest e2m1 gap
            assert ((value - original).abs() <= step / 2).all() and (value != original).any()
    assert all(torch.equal(ours[name], plain[name]) for name in plain if ".experts." not in name)


def test_dequantize_mxfp4_codes_and_scales():
    """Each nibble (low first) is its e2m1 value times 2 ** (scale - 127); negative zero keeps its sign."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x1F  # values 0, 1: code 15 (-6.0), code 1 (0.5)
    blocks[0, 0, 1] = 0x87  # values 2, 3: code 7 (6.0), code 8 (-0.0)
    values = dequantize_mxfp4(blocks, torch.tensor([[129]], dtype=torch.uint8))[0]
    assert values[:4].tolist() == [-24.0, 2.0, 24.0, -0.0] and torch.signbit(values[3])
    assert values[4:].abs().sum() == 0
    with pytest.raises(CheckpointError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], torch.tensor([[127]], dtype=torch.uint8))


def test_config_refusals_name_the_field(checkpoint):
    config = read_config(checkpoint)
    for field, value in (("hidden_act", "gelu"), ("attention_bias", False), ("layer_types", ["full_attention"]),
                         ("quantization_config", {"quant_method": "fp8"})):
        with pytest.raises(CheckpointError, match=field):
            GptOssConfig.from_hf_config(config | {field: value}, "config.json")
    with pytest.raises(CheckpointError, match="BF16 checkpoint"):
        GptOssConfig.from_hf_config(config | {"quantization_config": {"quant_method": "bitsandbytes"}}, "x")
    legacy = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    parsed = GptOssConfig.from_hf_config(legacy, "config.json")  # transformers' defaults: alternating, YaRN x32
    assert parsed.layer_kinds == ("sliding", "full", "sliding")
    assert (parsed.rope.rope_scaling.kind, parsed.rope.rope_scaling.factor) == ("yarn", 32.0)


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json (legacy rope_scaling form, MXFP4 experts), layer_types below
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088, "layer_types": ["sliding_attention", "full_attention"] * 12}


def test_a_published_config_parses_and_its_yarn_is_transformers():
    """gpt-oss-20b's config: alternating kinds, MXFP4, and YaRN (untruncated) frequencies and cos/sin multiplier
    bit-identical to transformers' rotary embedding for that config."""
    from transformers import GptOssConfig as HfConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from ignition.recipes.rope import rope_frequencies

    parsed = GptOssConfig.from_hf_config(GPT_OSS_20B, "config.json")
    assert parsed.layer_kinds == ("sliding", "full") * 12 and parsed.mxfp4 and parsed.moe.experts_per_token == 4
    assert (parsed.rope.rope_theta, parsed.rope.rope_scaling.truncate) == (150000.0, False)
    hf = GptOssRotaryEmbedding(HfConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}))
    inv_freq, multiplier = rope_frequencies(parsed.rope)
    assert torch.equal(inv_freq, hf.inv_freq) and multiplier == hf.attention_scaling


def test_the_graphs_call_bindings_that_dispatch_as_their_overloads(gpt_oss):
    """The loader's rewrite onto torch's Python bindings (runtime/backends/direct_calls.py) keeps every operator
    call and every bit of each variant."""
    _, _, core, _ = gpt_oss
    Engine(core).generate([Request([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=3, logprobs=2, ignore_eos=True)])
    assert assert_direct_calls_dispatch_as_overloads(core) > 0
