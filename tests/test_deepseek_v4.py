"""DeepSeek V4 (recipes/deepseek_v4*.py) against transformers on a tiny random checkpoint (examples/
make_tiny_deepseek_v4.py): a pure sliding layer, CSA and HCA layers, a window of 8 under prompts of 37 and 300
rows, hash-routed MoE layers.

- Generation logprobs are transformers' incremental decode (``generate`` with its cache), within 1e-5 in FP32
  with the same greedy tokens.
- Prompt logprobs, scored in 128-row chunks, are transformers' full forward over the 300-row prompt.
- The indexer's tie rule (lowest entry first): transformers' ``topk`` breaks exact ties by the vector's length,
  so the parity checks run on a checkpoint whose indexer never ties where it matters. Its 8 indexer heads make an
  exact 0 score (every head's ReLU at 0) a 1-in-256 event, and ``tie_free`` asserts, for every row the oracle and
  we both rank, that the k-th and (k+1)-th scores it sees differ by more than ``TIE_MARGIN`` (20 times the 1e-6
  rounding between us and transformers). A 2-head checkpoint, where ties are common, pins the rule itself.
- The cache kinds' table entries and GEOM-COMPRESS; config and checkpoint refusals name the field or tensor.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ignition.catalog.cache_kinds import CACHE_KINDS, compressed_entries, source_cells
from ignition.catalog.geometry import STATE_SHAPES
from ignition.catalog.rules import RULES
from ignition.recipes.checkpoint import CheckpointError, open_checkpoint, read_config
from ignition.recipes.deepseek_v4 import DeepseekV4Config, TOP_LEVEL_NAMES, read_checkpoint
from ignition.recipes import deepseek_v4_attention
from ignition.recipes.deepseek_v4_attention import keep_best
from ignition.recipes.deepseek_v4_model import STATE_BUFFERS, allocate_state, deepseek_v4_decoder, state_geometry
from ignition.validate.cache_kinds import check_cache_kinds

transformers = pytest.importorskip("transformers")

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
make_tiny = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny)

MAX_SEQ, CHUNK, NEW_TOKENS = 320, 128, 8
TOLERANCE = 1e-5
TIE_MARGIN = 2e-5


@pytest.fixture
def tie_free(monkeypatch):
    """Records every ranking our indexer makes in the test; afterwards asserts none could go either way: where a
    row sees more than k entries, its k-th best score exceeds the next by more than ``TIE_MARGIN``."""
    margins = []

    def recorded(total, k):
        ranked = torch.sort(total, dim=-1, descending=True).values
        if ranked.shape[-1] > k:
            gap = ranked[:, k - 1] - ranked[:, k]
            margins.append(float(torch.where(torch.isinf(ranked[:, k]), float("inf"), gap).min()))
        return keep_best(total, k)

    monkeypatch.setattr(deepseek_v4_attention, "keep_best", recorded)
    yield margins
    assert margins and min(margins) > TIE_MARGIN, f"an indexer ranking within {TIE_MARGIN}: {min(margins)}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny.make_checkpoint(tmp_path_factory.mktemp("dsv4") / "tiny")
    cfg, weights = read_checkpoint(open_checkpoint(path), read_config(path))
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(1, cfg.vocab_size, (300,), generator=generator)
    return path, cfg, weights, model, long_prompt


@pytest.fixture(scope="module")
def full_forward(tiny):
    """transformers' full forward over the 300-row prompt: logprobs ``[300, vocab]``."""
    model, long_prompt = tiny[3], tiny[4]
    with torch.no_grad():
        return model(long_prompt[None]).logits[0].float().log_softmax(-1)


def _logprobs(weights, hidden):
    return (hidden @ weights["head"].T).float().log_softmax(-1)


def _generate(cfg, weights, prompt, new_tokens, chunk=CHUNK):
    """Greedy generation: the prompt in ``chunk``-row steps, then one row a step; each step's last-row logprobs."""
    state = allocate_state(cfg, 1, MAX_SEQ, chunk)
    for start in range(0, prompt.shape[0], chunk):
        hidden = deepseek_v4_decoder(weights, cfg, prompt[start:start + chunk], start, 0, state)
    logprobs = [_logprobs(weights, hidden[-1])]
    position = prompt.shape[0]
    for _ in range(new_tokens - 1):
        hidden = deepseek_v4_decoder(weights, cfg, logprobs[-1].argmax().view(1), position, 0, state)
        logprobs.append(_logprobs(weights, hidden[-1]))
        position += 1
    return torch.stack(logprobs)


def test_generation_logprobs_match_transformers_incremental_decode(tiny, tie_free):
    _, cfg, weights, model, long_prompt = tiny
    prompt = long_prompt[:37]  # 9 CSA entries (3 kept per row), 4 HCA entries, window 8
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    expected = torch.stack([logits[0].float().log_softmax(-1) for logits in out.logits])
    ours = _generate(cfg, weights, prompt, NEW_TOKENS)
    assert ours.argmax(-1).tolist() == out.sequences[0, prompt.shape[0]:].tolist()
    torch.testing.assert_close(ours, expected, atol=TOLERANCE, rtol=0)


def test_prompt_logprobs_in_chunks_match_transformers_full_forward(tiny, full_forward, tie_free):
    _, cfg, weights, _, long_prompt = tiny
    expected = full_forward
    state = allocate_state(cfg, 1, MAX_SEQ, CHUNK)
    rows = [deepseek_v4_decoder(weights, cfg, long_prompt[start:start + CHUNK], start, 0, state)
            for start in range(0, long_prompt.shape[0], CHUNK)]
    ours = _logprobs(weights, torch.cat(rows))
    torch.testing.assert_close(ours, expected, atol=TOLERANCE, rtol=0)


def test_last_row_score_against_first_generated_logprob(tiny, full_forward, tie_free):
    """Scoring sees the whole prompt at once; ordinary prefill runs it in 128-row chunks. On a checkpoint whose
    indexer never ties, transformers' chunked incremental forward gives the full forward's last row (its first
    generated logprob equals the last-row score within 1e-5), and so do we: the two paths differ only where
    ``topk`` meets a tie (``test_tie_rule_makes_the_choice_independent_of_chunking``). Measured and reported in
    docs/recipes.md."""
    _, cfg, weights, model, long_prompt = tiny
    scored = full_forward[-1]
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        for start in range(0, long_prompt.shape[0], CHUNK):
            logits = model(long_prompt[None, start:start + CHUNK], cache=cache, use_cache=True).logits
        hf_generated = logits[0, -1].float().log_softmax(-1)
    ours = _generate(cfg, weights, long_prompt, 1)[0]
    torch.testing.assert_close(ours, hf_generated, atol=TOLERANCE, rtol=0)
    token = int(ours.argmax())
    difference = float(ours[token] - scored[token])
    print(f"last-row score vs first generated logprob (token {token}): {difference:+.7f} nats; "
          f"max over the vocabulary {float((ours - scored).abs().max()):.7f}")
    assert abs(difference) < TOLERANCE and float((hf_generated - scored).abs().max()) < TOLERANCE


def test_keep_best_keeps_the_lowest_entries_among_equal_scores():
    inf = float("inf")
    total = torch.tensor([[0.0, 0.5, 0.0, 0.0, -inf, 0.5], [0.0] * 6, [1.0, -inf, -inf, -inf, -inf, -inf]])
    kept = keep_best(total, 3)
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 5]  # both 0.5s, then the first of the three zeros
    assert kept[1].nonzero().flatten().tolist() == [0, 1, 2]
    assert kept[2].nonzero().flatten().tolist()[0] == 0 and kept.sum(-1).tolist() == [3, 3, 3]
    assert deepseek_v4_attention.INDEXER_TIE_RULE == "lowest entry first"


def test_tie_rule_makes_the_choice_independent_of_chunking(tmp_path):
    """With 2 indexer heads exact ties (rows whose best entries score 0) are common: transformers' chunked forward
    and its full forward then keep different entries (its ``topk`` breaks ties by the vector's length), while
    ours keeps the same whatever the steps (one 300-row step or 16-row chunks), within rounding."""
    path = make_tiny.make_checkpoint(tmp_path / "ties", index_heads=2)
    cfg, weights = read_checkpoint(open_checkpoint(path), read_config(path))
    prompt = torch.randint(1, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        full = model(prompt[None]).logits[0, -1].float().log_softmax(-1)
        cache = transformers.DynamicCache(config=model.config)
        for start in range(0, prompt.shape[0], CHUNK):
            chunked = model(prompt[None, start:start + CHUNK], cache=cache, use_cache=True).logits[0, -1]
    assert float((chunked.float().log_softmax(-1) - full).abs().max()) > 0.1  # the oracle depends on the cut
    one_step, chunked = (_generate(cfg, weights, prompt, 1, chunk)[0] for chunk in (300, 16))
    torch.testing.assert_close(chunked, one_step, atol=TOLERANCE, rtol=0)


def test_cache_kinds_and_state_geometry(tiny):
    _, cfg, _, _, _ = tiny
    assert [CACHE_KINDS[k].code for k in ("compressed", "heavily_compressed", "shared_window")] == [4, 5, 6]
    for kind, roles in STATE_BUFFERS.items():
        assert set(roles.values()) == set(CACHE_KINDS[kind].buffers), kind
    geometry = state_geometry(cfg, 2, MAX_SEQ, CHUNK)
    assert geometry["csa_entries"] == MAX_SEQ // 4 + 1 == compressed_entries(MAX_SEQ, 4)
    assert geometry["hca_source_cells"] == 8 + CHUNK - 1 == source_cells(8, CHUNK, False)
    assert geometry["csa_source_cells"] == 2 * 4 + CHUNK - 1
    state = allocate_state(cfg, 2, MAX_SEQ, CHUNK)
    assert tuple(state["csa_source"].shape) == (2, 2, 2 * 4 + CHUNK - 1, 2, 2, cfg.head_dim)
    assert tuple(state["hca_kv_cache"].shape) == (1, 2, MAX_SEQ // 8 + 1, cfg.head_dim)
    assert tuple(state["swa_kv_cache"].shape) == (1, 2, 8 + CHUNK - 1, cfg.head_dim)
    assert set(state) <= set(STATE_SHAPES)


def _manifest(cfg, **model_edits):
    geometry = state_geometry(cfg, 1, MAX_SEQ, CHUNK)
    model = {"num_layers": cfg.num_layers, "layer_kinds": list(cfg.layer_kinds), "max_seq_len": MAX_SEQ,
             "sliding_window": cfg.sliding_window, "csa_rate": cfg.csa_rate, "hca_rate": cfg.hca_rate,
             **{k: geometry[k] for k in ("window_cells", "csa_entries", "hca_entries", "csa_source_cells",
                                         "hca_source_cells", "index_head_dim")}} | model_edits
    state = [{"name": name} for kind in set(cfg.layer_kinds) for name in STATE_BUFFERS[kind].values()]
    return {"model": model, "state": state, "chunk_limit": CHUNK}


@pytest.mark.parametrize("edit, rules", [
    ({}, set()),
    ({"csa_entries": MAX_SEQ // 4}, {"GEOM-COMPRESS"}),  # no cell for the stand-in writes
    ({"hca_source_cells": 8}, {"GEOM-COMPRESS"}),  # a step's rows would overwrite what they read
    ({"csa_source_cells": 4 + CHUNK - 1}, {"GEOM-COMPRESS"}),  # CSA reads two windows back
    ({"window_cells": 8}, {"GEOM-WINDOW"}),
    ({"hca_rate": None}, {"GEOM-KIND-BUFFERS"}),
])
def test_compressed_kind_rules(tiny, edit, rules):
    _, cfg, _, _, _ = tiny
    manifest = _manifest(cfg, **edit)
    manifest["model"] = {k: v for k, v in manifest["model"].items() if v is not None}
    found = {v.rule for v in check_cache_kinds(manifest, [])}
    assert found == rules and rules <= set(RULES)


def test_missing_buffer_is_named(tiny):
    _, cfg, _, _, _ = tiny
    manifest = _manifest(cfg)
    manifest["state"] = [s for s in manifest["state"] if s["name"] != "csa_index_source"]
    (violation,) = check_cache_kinds(manifest, [])
    assert violation.rule == "GEOM-KIND-BUFFERS" and "csa_index_source" in violation.message


@pytest.mark.parametrize("field, value, words", [
    ("scoring_func", "softmax", "'scoring_func' must be 'sqrtsoftplus'"),
    ("num_key_value_heads", 2, "'num_key_value_heads' must be 1"),
    ("layer_types", ["full_attention"] * 4, "'layer_types' must list one of"),
    ("mlp_layer_types", ["dense"] * 4, "'mlp_layer_types' must list"),
    ("quantization_config", {"quant_method": "fp8"}, "must be dequantized"),
])
def test_config_refusals_name_the_field(tiny, field, value, words):
    path = tiny[0]
    config = read_config(path) | {field: value}
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        DeepseekV4Config.from_hf_config(config)


def test_release_names_load_the_same_weights(tiny, tmp_path):
    """DeepSeek's release layout (``embed.weight``, ``layers.N...``, ``hc_head_fn``) reads as transformers' saved one;
    a missing tensor is named."""
    from safetensors.torch import load_file, save_file
    path, cfg, weights, _, _ = tiny
    saved = load_file(str(path / "model.safetensors"))
    renamed = {name: value for name, value in saved.items()}
    for release, transformers_name in TOP_LEVEL_NAMES.values():
        renamed[release] = renamed.pop(transformers_name)
    renamed = {name.removeprefix("model."): value for name, value in renamed.items()}
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "config.json").write_text(json.dumps(read_config(path)))
    save_file(renamed, str(tmp_path / "release" / "model.safetensors"))
    release_cfg, release_weights = read_checkpoint(open_checkpoint(tmp_path / "release"), read_config(path))
    assert release_cfg.top_names == "release" and release_weights.keys() == weights.keys()
    assert all(torch.equal(release_weights[name], weights[name]) for name in weights)
    renamed.pop("layers.1.attn.indexer.wq_b.weight")
    save_file(renamed, str(tmp_path / "release" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.attn.indexer.wq_b.weight'"):
        read_checkpoint(open_checkpoint(tmp_path / "release"), read_config(path))


def test_a_step_the_state_cannot_hold_is_refused(tiny):
    _, cfg, weights, _, long_prompt = tiny
    state = allocate_state(cfg, 1, MAX_SEQ, 16)
    with pytest.raises(ValueError, match=r"buffer 'hca_window_cache' must be \[1 layers, slots > 0, >= 24 cells"):
        deepseek_v4_decoder(weights, cfg, long_prompt[:17], 16, 0, state)  # a ring of 8 + 16 - 1 cells
    with pytest.raises(ValueError, match="buffer 'hca_kv_cache' must be"):
        deepseek_v4_decoder(weights, cfg, long_prompt[:1], 330, 0, state)  # past the entry table
    with pytest.raises(ValueError, match="buffer 'csa_index_source' is required"):
        deepseek_v4_decoder(weights, cfg, long_prompt[:1], 0, 0, {k: v for k, v in state.items()
                                                                   if k != "csa_index_source"})


def test_rejected_verify_rows_need_no_rollback(tiny):
    """A verify round writes all its rows; after only the first is accepted, decoding on from the next position
    does not depend on what the rejected rows were (bit for bit: the rings hold a step's rows beyond what it
    reads, and an entry a rejected row closed is rewritten before any row sees it), and matches decoding one row
    at a time within rounding (the accepted row was computed in a 4-row step)."""
    _, cfg, weights, _, long_prompt = tiny
    prompt, rounds = long_prompt[:37], 4  # rows 37..40 close CSA window 9 and HCA window 4 (position 39)
    states = [allocate_state(cfg, 1, MAX_SEQ, rounds) for _ in range(3)]
    for state in states:
        for start in range(0, prompt.shape[0], rounds):
            deepseek_v4_decoder(weights, cfg, prompt[start:start + rounds], start, 0, state)
    position, accepted = prompt.shape[0], long_prompt[100:101]
    deepseek_v4_decoder(weights, cfg, accepted, position, 0, states[0])
    for state, rejected in zip(states[1:], (long_prompt[101:104], long_prompt[150:153])):
        deepseek_v4_decoder(weights, cfg, torch.cat([accepted, rejected]), position, 0, state)
    for step, token in enumerate(long_prompt[200:206]):
        one_by_one, *verified = (deepseek_v4_decoder(weights, cfg, token.view(1), position + 1 + step, 0, state)
                                 for state in states)
        assert torch.equal(verified[0], verified[1]), step
        torch.testing.assert_close(verified[0], one_by_one, atol=TOLERANCE, rtol=0)
