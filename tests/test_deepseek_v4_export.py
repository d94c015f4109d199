"""The exported ``deepseek_v4`` recipe (recipes/deepseek_v4_export.py) against transformers.

The tiny checkpoint (examples/make_tiny_deepseek_v4.py, its first 3 layers: HCA, CSA and sliding, window 8, hash
and top-k MoE) is exported once with 16-row prompt chunks (over the window), a decode capacity of 2, prompt
scoring and mixed graphs and a verify family of 3 drafts. Generation (K=20 and explicit ids) is transformers'
incremental decode, prompt logprobs its full forward, each within 1e-5 in FP32 (``TOL``). As the specification
asks, accuracy is compared with the spread across fresh runs: two freshly loaded cores and two freshly loaded
transformers models (``_fp64_oracle.spread``; both repeat bit for bit on a CPU, a spread of 0) widen the FP32
bound, and the FP64 forward (``_fp64_oracle.Float64``) is the exact reference both FP32 forwards are within
``TOL`` of. ``ranking_gaps`` shows the indexer's tie rule cannot matter on these sequences
(tests/test_deepseek_v4.py explains the rule and pins it on a tie-prone checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _fp64_oracle import full, incremental, spread
from conftest import CoreCopy
from ignition.catalog.rules import RULES
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes import deepseek_v4_attention
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.checkpoint import open_checkpoint, read_config
from ignition.recipes.deepseek_v4 import read_checkpoint
from ignition.recipes.deepseek_v4_model import allocate_state, deepseek_v4_decoder
from ignition.recipes.registry import build_recipe
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request
from ignition.validate.core import validate_core
from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads

transformers = pytest.importorskip("transformers")

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
make_tiny = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny)

CHUNK, MAX_SEQ, STEPS = 16, 64, 8
TOL = 1e-5  # FP32: measured 5.8e-6 from transformers at most (generation), 4.0e-6 from the FP64 forward
TIE_MARGIN = 2e-5  # 20 times the rounding between us and transformers: a ranking this far apart cannot swap
VOCAB = 300  # the tokenizer's ids
PROMPTS = ([(5 * i + 1) % VOCAB for i in range(21)],  # two chunks, past the window
           [(3 * i + 2) % VOCAB for i in range(5)],  # shorter than the window; decode goes past it
           [(11 * i + 7) % VOCAB for i in range(40)])  # three chunks, four CSA entries of a chunk


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4-export")
    checkpoint = make_tiny.make_checkpoint(root / "ckpt", layers=3)
    export_core(ExportOptions(recipe="deepseek_v4", checkpoint=checkpoint, capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ, prompt_logprobs=True, mixed=True, speculative_tokens=(3,)),
                root / "core")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return checkpoint, root / "core", load_core(root / "core"), hf


@pytest.fixture(scope="module")
def references(exported):
    """(a second, freshly loaded FP32 transformers model; the checkpoint in FP64, its experts in transformers'
    eager loop: its grouped product has no FP64 kernel)."""
    checkpoint = exported[0]
    fresh = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    exact = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float64,
                                                               experts_implementation="eager").eval()
    return fresh, exact


def fresh_runs_bound(ours: list[torch.Tensor], oracle: list[torch.Tensor]) -> float:
    """The specification's accuracy bound: the spread of our fresh runs plus the oracle's, plus FP32 rounding."""
    return float(spread(ours).max() + spread(oracle).max()) + TOL


def hf_incremental(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` with its cache: tokens and each step's logprobs (FP64)."""
    return incremental(hf, prompt, steps)


def hf_full(hf, tokens: list[int]) -> torch.Tensor:
    return full(hf, tokens)


def ranking_gaps(checkpoint, sequences: list[list[int]], monkeypatch) -> float:
    """The smallest gap between a row's k-th and (k+1)-th indexer score over ``sequences`` (our step forward, one
    step a sequence): above ``TIE_MARGIN``, no tie rule (ours or ``topk``'s) can choose differently."""
    cfg, weights = read_checkpoint(open_checkpoint(checkpoint), read_config(checkpoint))
    gaps = []
    keep_best = deepseek_v4_attention.keep_best

    def recorded(total, k):
        ranked = torch.sort(total, dim=-1, descending=True).values
        if ranked.shape[-1] > k:
            gap = ranked[:, k - 1] - ranked[:, k]
            gaps.append(float(torch.where(torch.isinf(ranked[:, k]), float("inf"), gap).min()))
        return keep_best(total, k)

    monkeypatch.setattr(deepseek_v4_attention, "keep_best", recorded)
    for tokens in sequences:
        state = allocate_state(cfg, 1, 2 * MAX_SEQ, len(tokens))  # a ring for one step of every row
        deepseek_v4_decoder(weights, cfg, torch.tensor(tokens), 0, 0, state)
    return min(gaps)


def assert_entries_match(result, rows: torch.Tensor, k: int) -> None:
    for step, (token, entry) in enumerate(zip(result.token_ids, result.entries, strict=True)):
        row = rows[step]
        assert token == int(row.argmax()), step
        assert abs(entry.logprob - row[token].item()) < TOL, step
        values = torch.tensor([v for _, v in entry.top], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(values, row[[i for i, _ in entry.top]], atol=TOL, rtol=0)


def test_generation_matches_transformers_incremental_decode(exported, references, monkeypatch):
    """Greedy tokens and K=20 logprobs: prompts of 21, 5 and 40 rows in 16-row chunks, decoding past the window,
    two lanes at a time; two fresh runs of ours against two of transformers (their spread plus ``TOL``), and
    within ``TOL`` of the FP64 forward."""
    checkpoint, root, core, hf = exported
    requests = [Request(p, max_tokens=STEPS, logprobs=20, ignore_eos=True) for p in PROMPTS]
    runs = [Engine(loaded).generate(requests) for loaded in (core, load_core(root))]
    oracles = [[hf_incremental(model, prompt, STEPS) for prompt in PROMPTS] for model in (hf, references[0])]
    exact = [incremental(references[1], prompt, STEPS, fp64=True) for prompt in PROMPTS]
    assert ranking_gaps(checkpoint, [p + t for p, (t, _) in zip(PROMPTS, oracles[0])], monkeypatch) > TIE_MARGIN
    for lane, (tokens, rows) in enumerate(exact):
        ids = [[i for i, _ in entry.top] for entry in runs[0][lane].entries]
        ours = [torch.tensor([[v for _, v in e.top] for e in run[lane].entries], dtype=torch.float64) for run in runs]
        theirs = [torch.stack([row[i] for row, i in zip(oracle[lane][1], ids)]) for oracle in oracles]
        assert all(run[lane].error is None and run[lane].token_ids == tokens for run in runs)
        assert all(oracle[lane][0] == tokens for oracle in oracles)
        assert all([[i for i, _ in e.top] for e in run[lane].entries] == ids for run in runs)
        assert float((ours[0] - theirs[0]).abs().max()) <= fresh_runs_bound(ours, theirs)
        assert float((ours[0] - torch.stack([row[i] for row, i in zip(rows, ids)])).abs().max()) <= TOL
        assert_entries_match(runs[0][lane], oracles[0][lane][1], 20)


def test_explicit_ids_match_transformers(exported):
    _, _, core, hf = exported
    ids = [299, 0, 17, 3]
    (result,) = Engine(core).generate([Request(PROMPTS[0], max_tokens=8, logprob_token_ids=ids, ignore_eos=True)])
    rows = hf_full(hf, PROMPTS[0] + result.token_ids)
    for step, entry in enumerate(result.entries):
        assert [i for i, _ in entry.top] == ids
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top], dtype=torch.float64),
                                   rows[len(PROMPTS[0]) + step - 1][ids], atol=TOL, rtol=0)


def test_prompt_logprobs_match_the_full_forward(exported, references, monkeypatch):
    """Scored prefill (all layers on all rows, every row's candidates stored) in 16-row chunks: transformers'
    full forward over the prompt, two fresh runs of each (their spread plus ``TOL``), and within ``TOL`` of the
    FP64 forward."""
    checkpoint, root, core, hf = exported
    prompt = PROMPTS[2] + PROMPTS[0]  # 61 rows: four chunks
    assert ranking_gaps(checkpoint, [prompt], monkeypatch) > TIE_MARGIN
    request = Request(prompt, max_tokens=1, logprobs=1, prompt_logprobs=20, ignore_eos=True)
    runs = [Engine(loaded).generate([request])[0] for loaded in (core, load_core(root))]
    rows, fresh, exact = hf_full(hf, prompt), hf_full(references[0], prompt), full(references[1], prompt, fp64=True)
    result = runs[0]
    assert result.error is None and result.prompt_entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = result.prompt_entries[position], rows[position - 1]
        assert entry["id"] == prompt[position]
        ids = [entry["id"]] + [t["id"] for t in entry["top_logprobs"]]
        ours = [torch.tensor([run.prompt_entries[position]["logprob"]]
                             + [t["logprob"] for t in run.prompt_entries[position]["top_logprobs"]],
                             dtype=torch.float64) for run in runs]
        theirs = [rows[position - 1][ids], fresh[position - 1][ids]]
        assert float((ours[0] - theirs[0]).abs().max()) <= fresh_runs_bound(ours, theirs)
        assert float((ours[0] - exact[position - 1][ids]).abs().max()) <= TOL
        torch.testing.assert_close(ours[0][1:], torch.sort(row, descending=True).values[:20], atol=TOL, rtol=0)
    assert abs(result.entries[0].logprob - rows[-1][result.token_ids[0]].item()) < TOL  # the last row's score


def summary(results):
    return [(r.token_ids, [[i for i, _ in e.top] for e in r.entries], r.error) for r in results]


def test_mixed_serial_and_batch_invariant_rounds_agree(exported):
    """Mixed rounds (a prompt chunk beside a decode lane), serial chunks and batch-invariant decode give the same
    tokens and alternatives; the logprobs agree within rounding (batch-invariant ones bit for bit with alone)."""
    _, _, core, _ = exported
    requests = [Request(p, max_tokens=6, logprobs=3, ignore_eos=True) for p in (PROMPTS[1], PROMPTS[2])]
    serial = Engine(core, mixed=False).generate(requests)
    mixed_engine = Engine(core)
    mixed = mixed_engine.generate(requests)
    invariant = Engine(core, batch_invariant=True).generate(requests)
    alone = [Engine(core, batch_invariant=True).generate([request])[0] for request in requests]
    assert mixed_engine.stats["mixed_rounds"] >= 1
    assert summary(serial) == summary(mixed) == summary(invariant) == summary(alone)
    for a, b in zip(invariant, alone):
        assert [e.logprob for e in a.entries] == [e.logprob for e in b.entries]
    for a, b in zip(serial, mixed):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.entries, b.entries)) < TOL


class ScriptedDrafter:
    """Proposes each request's true continuation (transformers' greedy tokens) with its last proposal wrong, so
    every verify round accepts some drafts and rejects one (``runtime/drafters.py``'s ``propose``/``release``)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        proposals = []
        for _, tokens, limit in requests:
            prompt = next(p for p in self.continuations if tuple(tokens[:len(p)]) == p)
            truth = self.continuations[prompt][len(tokens) - len(prompt):][:limit]
            proposals.append(truth[:-1] + [(truth[-1] + 1) % VOCAB] if truth else [])
        return proposals

    def release(self, request_id: str) -> None:
        """Nothing is held per request."""


def test_speculative_rounds_give_transformers_tokens(exported, monkeypatch):
    """Verify rounds of 3 drafts (the last one wrong: rejected rows left in the rings and entry tables) emit
    transformers' greedy tokens with its logprobs, as plain decode does."""
    checkpoint, _, core, hf = exported
    prompts = (PROMPTS[0], PROMPTS[1])
    expected = [hf_incremental(hf, prompt, 10) for prompt in prompts]
    drafter = ScriptedDrafter({tuple(p): tokens for p, (tokens, _) in zip(prompts, expected)})
    engine = Engine(core, drafter=drafter, draft_tokens=3, mixed=False)
    results = engine.generate([Request(p, max_tokens=10, logprobs=3, ignore_eos=True) for p in prompts])
    assert engine.stats["proposed"] > engine.stats["accepted"] > 0
    assert ranking_gaps(checkpoint, [p + t for p, (t, _) in zip(prompts, expected)], monkeypatch) > TIE_MARGIN
    for result, (tokens, rows) in zip(results, expected):
        assert result.error is None and result.token_ids == tokens
        assert max(abs(e.logprob - rows[step][e.id].item()) for step, e in enumerate(result.entries)) < TOL


def test_fresh_runs_repeat_bit_for_bit(exported):
    """Accuracy is compared with the spread across fresh runs (``fresh_runs_bound``): on these graphs (experts
    summed in expert order, one fixed product per step) two freshly loaded cores give the same bits, a spread of 0,
    so the bound of the comparisons with transformers above is the FP32 rounding tolerance."""
    _, root, core, _ = exported
    request = Request(PROMPTS[2], max_tokens=4, logprobs=5, ignore_eos=True)
    runs = [Engine(loaded).generate([request])[0] for loaded in (core, load_core(root))]
    assert summary(runs[:1]) == summary(runs[1:])
    assert [e.logprob for e in runs[0].entries] == [e.logprob for e in runs[1].entries]


def test_the_fresh_runs_bound_widens_by_both_spreads():
    ours = [torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([0.5, -1.0 + 3e-6], dtype=torch.float64)]
    theirs = [torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([0.5 - 2e-6, -1.0], dtype=torch.float64)]
    assert fresh_runs_bound(ours, theirs) == pytest.approx(TOL + 5e-6, abs=1e-12)
    assert fresh_runs_bound(ours[:1], theirs[:1]) == TOL  # runs that repeat: the FP32 bound alone


def test_cli_run_prints_the_engines_tokens(exported):
    _, root, core, _ = exported
    prompt = PROMPTS[0]
    result = CliRunner().invoke(app, ["run", str(root), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens",
                                      "3", "--logprobs", "2", "--ignore-eos", "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (expected,) = Engine(core).generate([Request(prompt, max_tokens=3, ignore_eos=True)])
    printed = json.loads(result.output.strip().splitlines()[-1])  # after the loader's progress lines
    assert [token["id"] for token in printed["tokens"]] == expected.token_ids, printed


def test_serve_answers_as_the_engine_does(exported):
    """``ignition serve``'s app on the core: a completion's tokens and logprobs are the engine's."""
    import httpx
    from _served import serve_in_thread
    from ignition.serve.app import create_app

    _, root, core, _ = exported
    server, thread, url = serve_in_thread(create_app(root, model_name="tiny-v4"))
    try:
        body = {"model": "tiny-v4", "prompt": PROMPTS[0], "max_tokens": 3, "logprobs": 2, "temperature": 0}
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert response.status_code == 200, response.text
    served = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    (expected,) = Engine(core).generate([Request(PROMPTS[0], max_tokens=3, logprobs=2)])
    assert len(served) == len(expected.entries) >= 1
    assert max(abs(a - e.logprob) for a, e in zip(served, expected.entries)) < 1e-6


def test_manifest_declares_every_v4_buffer(exported):
    _, root, _, _ = exported
    report = validate_core(root, check_graphs=False)  # the export checked every graph
    assert report.violations == []
    model = report.manifest["model"]
    assert model["layer_kinds"] == ["heavily_compressed", "compressed", "shared_window"]
    assert (model["sliding_window"], model["window_cells"]) == (8, 8 + CHUNK - 1)
    assert (model["csa_entries"], model["hca_entries"]) == (MAX_SEQ // 4 + 1, MAX_SEQ // 8 + 1)
    state = {s["name"]: s["shape"] for s in report.manifest["state"]}
    assert state["csa_source"] == [1, 2, 2 * 4 + CHUNK - 1, 2, 2, 32]
    assert state["csa_index_cache"] == [1, 2, MAX_SEQ // 4 + 1, 16]
    assert state["hca_source"] == [1, 2, 8 + CHUNK - 1, 2, 1, 32]
    assert state["swa_kv_cache"] == [1, 2, 8 + CHUNK - 1, 32]


def test_scoring_cost_counts_the_compressed_entries(exported):
    """``inspect-core --memory-budget``: a cached token costs its share of the entry tables (a CSA entry and an
    indexer entry each 4 positions, an HCA entry each 8; the rings are per slot), and the flag's scored graphs and
    buffers displace that many tokens of a budget."""
    _, root, _, _ = exported
    budget = 1 << 22
    inspected = CliRunner().invoke(app, ["inspect-core", str(root), "--json", "--memory-budget", str(budget)])
    assert inspected.exit_code == 0, inspected.output
    memory = json.loads(inspected.output)["memory"]
    per_token = (32 + 16) * 4 // 4 + 32 * 4 // 8
    fixed = memory["prompt_scoring_buffer_bytes"] + memory["prompt_scoring_graph_bytes"]
    assert memory["kv_bytes_per_token"] == per_token and memory["prompt_scoring_buffer_bytes"] > 0
    assert memory["kv_tokens_without_scoring"] == budget // per_token
    assert memory["kv_tokens_with_scoring"] == (budget - fixed) // per_token
    print(f"scoring cost: {fixed} fixed bytes, {memory['kv_capacity_loss']:.1%} of a {budget}-byte budget")


@pytest.mark.parametrize("edit, rules", [
    (lambda m: m["model"].update(csa_entries=MAX_SEQ // 4), {"GEOM-COMPRESS"}),
    (lambda m: m["model"].update(hca_source_cells=8), {"GEOM-COMPRESS"}),
    (lambda m: m["model"].update(window_cells=8), {"GEOM-WINDOW"}),
    (lambda m: m["model"]["layer_kinds"].__setitem__(2, "sliding"), {"GEOM-KIND-BUFFERS"}),
    (lambda m: m["model"].pop("csa_rate"), {"GEOM-KIND-BUFFERS"}),
    (lambda m: next(s for s in m["state"] if s["name"] == "csa_index_cache")["shape"].__setitem__(3, 32),
     {"GEOM-MODEL", "STATE-DECL"}),  # the indexer's entries at head_dim, not index_head_dim
])
def test_tampered_manifest_is_caught(exported, tmp_path, edit, rules):
    _, root, _, _ = exported
    shutil.copytree(root, tmp_path / "core")
    copy = CoreCopy(tmp_path / "core")
    copy.edit("manifest.json", edit)
    found = {v.rule for v in validate_core(copy.root, check_graphs=False).violations}
    assert found == rules and rules <= set(RULES)


def test_onnx_graphs_replay_as_the_torch_ones(exported, tmp_path):
    """``--onnx``: the indexer's stable sort is one ONNX ``TopK`` (lower index first among ties, the tie rule);
    onnxruntime gives the torch graphs' tokens and logprobs within 1e-5 (measured 1.7e-6)."""
    export_core(ExportOptions(recipe="deepseek_v4", checkpoint=exported[0], capacities=(1,), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ // 2, onnx=True, structured_output=False), tmp_path / "core")
    request = Request(PROMPTS[0], max_tokens=4, logprobs=3, ignore_eos=True)
    torch_run, onnx_run = (Engine(load_core(tmp_path / "core", runtime=runtime)).generate([request])[0]
                           for runtime in ("torch", "onnxruntime"))
    assert onnx_run.error is None and onnx_run.token_ids == torch_run.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(onnx_run.entries, torch_run.entries)) < TOL / 2


@pytest.mark.parametrize("options, words", [
    (dict(tensor_parallel=2, mixed=True), "--speculative-tokens and --mixed are single-rank variants"),
])
def test_unsupported_options_are_refused(exported, options, words):
    checkpoint = exported[0]
    with pytest.raises(RecipeError, match=words):
        build_recipe(ExportOptions(recipe="deepseek_v4", checkpoint=checkpoint, capacities=(2,), chunk_limit=CHUNK,
                                   max_seq_len=MAX_SEQ, **options))


def test_the_graphs_call_bindings_that_dispatch_as_their_overloads(exported):
    """The loader's rewrite onto torch's Python bindings (runtime/backends/direct_calls.py) keeps every operator
    call and every bit of each variant."""
    _, _, core, _ = exported
    Engine(core).generate([Request([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=3, logprobs=2, ignore_eos=True)])
    assert assert_direct_calls_dispatch_as_overloads(core) > 0
