"""Scored prefill end to end on the toy core: catalog, validation, loader entries, preemption."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ignition.components.logprobs as L
from ignition.catalog.contract import scored_capacities
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.recipes.toy import batch_invariant_logits
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request

CHUNK = 256


@pytest.fixture(scope="module")
def scored_core(tmp_path_factory):
    out = tmp_path_factory.mktemp("scored") / "toy"
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), chunk_limit=CHUNK, prompt_logprobs=True), out)
    return out


@pytest.fixture(scope="module")
def loaded(scored_core):
    return load_core(scored_core)


@pytest.fixture(scope="module")
def bigram(scored_core):
    w = load_file(str(scored_core / "weights.safetensors"))
    logits = batch_invariant_logits(w["embedding.weight"], w["lm_head.weight"])[:, :250]  # the graph's FP32 logits
    lse = L._normalization(logits, 250)
    return (logits - lse[:, None]).numpy()  # FP32 reported values: [previous token, next token]


def test_flag_adds_only_scored_variants(scored_core, tmp_path):
    plain = tmp_path / "plain"
    export_core(ExportOptions(recipe="toy", capacities=(1, 4), chunk_limit=CHUNK), plain)
    with_flag = json.loads((scored_core / "catalog.json").read_text())["variants"]
    without = json.loads((plain / "catalog.json").read_text())["variants"]
    assert with_flag[:len(without)] == without
    extra = with_flag[len(without):]
    assert [(v["operation"], v["capacity"]) for v in extra] == [(12, c) for c in scored_capacities(CHUNK)]
    scored = extra[0]
    targets = next(a for a in scored["arguments"] if a["name"] == "prompt_target_tokens")
    assert targets == {"name": "prompt_target_tokens", "dtype": "int32", "shape": [128], "role": "input"}
    assert scored["contract"]["bindings"]["prompt_target_tokens"] == 39
    manifest = json.loads((scored_core / "manifest.json").read_text())
    assert manifest["features"]["prompt_logprobs"] is True


def test_fresh_process_validates_scored_core(scored_core):
    result = subprocess.run([sys.executable, "-m", "ignition.cli", "validate-core", str(scored_core)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def expected_entries(bigram, prompt, n):
    out = [None]
    for position in range(1, len(prompt)):
        row = bigram[prompt[position - 1]]
        token = prompt[position]
        order = sorted(range(250), key=lambda t: (-row[t], t))[:n]
        out.append((token, row[token], 1 + int(np.sum(row > row[token])), order))
    return out


@pytest.mark.parametrize("length", [2, 50, 128, 129, 256, 300, 600])
def test_prompt_entries_match_oracle(loaded, bigram, length):
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, 250, (length,), generator=g).tolist()
    if length > 10:
        prompt[length // 2:length // 2 + 3] = [7, 7, 7]  # repeated tokens
    (result,) = Engine(loaded).generate([Request(prompt, max_tokens=2, prompt_logprobs=5)])
    assert result.error is None and len(result.prompt_entries) == length
    for got, want in zip(result.prompt_entries, expected_entries(bigram, prompt, 5)):
        if want is None:
            assert got is None
            continue
        token, value, rank, order = want
        assert got["id"] == token and got["rank"] == rank
        assert got["logprob"] == pytest.approx(float(value), abs=0)  # the same FP32 arithmetic: bit-exact
        assert [t["id"] for t in got["top_logprobs"]] == order


def test_scoring_then_generating_equals_plain_prefill(loaded):
    prompt = list(range(3, 203))
    (scored,) = Engine(loaded).generate([Request(prompt, max_tokens=5, prompt_logprobs=0, logprobs=3)])
    (plain,) = Engine(loaded).generate([Request(prompt, max_tokens=5, logprobs=3)])
    assert scored.token_ids == plain.token_ids
    assert [(e.logprob, e.top) for e in scored.entries] == [(e.logprob, e.top) for e in plain.entries]
    assert all(len(e["top_logprobs"]) == 0 for e in scored.prompt_entries[1:])


def test_zero_budget_scores_only(loaded):
    (result,) = Engine(loaded).generate([Request(list(range(1, 40)), max_tokens=0, prompt_logprobs=1)])
    assert result.token_ids == [] and len(result.prompt_entries) == 39 and result.finish_reason == "length"


def test_requests_without_scoring_never_select_it(loaded):
    engine = Engine(loaded)
    used = []
    engine.decode_hook = lambda variant, reader, pending: used.append(variant.operation.name)
    engine.generate([Request([t % 250 for t in range(300)], max_tokens=2)])
    assert "SCORED_PREFILL" not in used and "PREFILL" in used


def test_preemption_keeps_scores_in_order_without_duplicates(loaded, bigram):
    prompt = [(i * 7) % 250 for i in range(600)]
    engine = Engine(loaded)
    preempted = []

    def preempt_once(variant, reader, pending):
        if variant.operation.name == "SCORED_PREFILL" and not preempted:
            preempted.append(True)
    engine.decode_hook = preempt_once
    request_id = engine.submit(Request(prompt, max_tokens=3, prompt_logprobs=2))
    engine.step()  # first scored chunk (256 rows) is published
    assert preempted
    engine.preempt(request_id)
    engine.run()
    result = engine.result(request_id)
    (alone,) = Engine(loaded).generate([Request(prompt, max_tokens=3, prompt_logprobs=2)])
    assert result.prompt_entries == alone.prompt_entries and len(result.prompt_entries) == 600
    assert result.token_ids == alone.token_ids


def test_preemption_during_decode_resumes(loaded):
    prompt = list(range(10, 60))
    engine = Engine(loaded)
    request_id = engine.submit(Request(prompt, max_tokens=6, prompt_logprobs=1, logprobs=1))
    for _ in range(4):
        engine.step()  # prefill, then decode rounds
    engine.preempt(request_id)
    engine.run()
    (alone,) = Engine(loaded).generate([Request(prompt, max_tokens=6, prompt_logprobs=1, logprobs=1)])
    result = engine.result(request_id)
    assert result.token_ids == alone.token_ids and result.prompt_entries == alone.prompt_entries
    assert [(e.logprob, e.top) for e in result.entries] == [(e.logprob, e.top) for e in alone.entries]
