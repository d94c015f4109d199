"""Speculative decoding on a tiny Qwen3: greedy output with ngram or draft-core proposals equals greedy
output without them (tokens, logprob ids and order), and every value matches transformers teacher-forced."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from _decoder_cores import TinyCase, save_checkpoint
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.runtime.drafters import (DraftCoreDrafter, NgramDrafter, SpeculativeError, engine_options,
                                       parse_speculative)
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request, SamplingParams

VOCAB = 250  # the toy core's vocabulary: the toy bigram serves as the wild draft core
CHUNK = 24  # the 40-token prompt spans two prefill chunks
DRAFT_TOKENS = (1, 3, 5)
TOL = 1e-5  # fp32 model: our logits differ from transformers' by ~1e-6


@pytest.fixture(scope="module")
def cores(tmp_path_factory, toy_core):
    """The target (verify.s5.c2, which also runs S = 1 and 3: shorter proposals; and mixed.t24.c2); a replica of
    it as a draft core (its proposals are the target's greedy tokens, so they are accepted); the toy bigram as
    a wild draft core (it disagrees)."""
    root = tmp_path_factory.mktemp("speculative")
    hf = save_checkpoint(TinyCase("qwen3", torch.float32, tie=False, vocab_size=VOCAB, max_position_embeddings=128),
                         root / "target")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "target", capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=128, speculative_tokens=(max(DRAFT_TOKENS),), mixed=True), root / "core")
    core = load_core(root / "core")
    return hf, core, core.replica(), load_core(toy_core)


PROMPTS = ([(5 * i + 1) % VOCAB for i in range(30)],  # two chunks
           [7, 8, 9, 10, 7, 8, 9, 10, 7, 8])  # repetitive: prompt lookup proposes


def generate(core, drafter=None, draft_tokens=0, **request):
    engine = Engine(core, drafter=drafter, draft_tokens=draft_tokens, mixed=False)  # serial prompt chunks
    results = engine.generate([Request(p, **{"max_tokens": 10, "logprobs": 5, "ignore_eos": True} | request)
                               for p in PROMPTS])
    return results, engine


def summary(results):
    return [(r.token_ids, [[i for i, _ in e.top] for e in r.entries], r.finish_reason, r.error) for r in results]


def hf_rows(hf, tokens):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1)


@pytest.fixture(scope="module")
def plain(cores):
    return generate(cores[1])[0]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_decoding_and_transformers(cores, plain, kind):
    hf, core, draft, _ = cores
    for draft_tokens in DRAFT_TOKENS:
        drafter = NgramDrafter() if kind == "ngram" else DraftCoreDrafter(draft, core)
        results, engine = generate(core, drafter, draft_tokens)
        assert summary(results) == summary(plain), (kind, draft_tokens)
        assert engine.stats["accepted"] > 0, "no proposal was ever accepted: the multi-position path is untested"
        for prompt, result, reference in zip(PROMPTS, results, plain):
            oracle = hf_rows(hf, prompt + result.token_ids)
            for step, (entry, base) in enumerate(zip(result.entries, reference.entries)):
                row = oracle[len(prompt) + step - 1]
                assert entry.id == int(row.argmax())
                assert abs(entry.logprob - row[entry.id].item()) < TOL
                assert abs(entry.logprob - base.logprob) < TOL
                torch.testing.assert_close(torch.tensor([v for _, v in entry.top], dtype=torch.float64),
                                           row[[i for i, _ in entry.top]], atol=TOL, rtol=0)


def test_wild_draft_core_reports_only_target_logprobs(cores, plain):
    """A draft that disagrees almost always: outputs and every logprob equal the run without speculation."""
    _, core, _, wild = cores
    results, engine = generate(core, DraftCoreDrafter(wild, core), 5)
    assert engine.stats["proposed"] > 0
    assert summary(results) == summary(plain)
    for result, reference in zip(results, plain):
        for entry, base in zip(result.entries, reference.entries):
            assert abs(entry.logprob - base.logprob) < TOL and [i for i, _ in entry.top] == [i for i, _ in base.top]


def test_seeded_sampling_with_speculation_reproduces(cores):
    _, core, _, _ = cores
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=1234)
    first, engine = generate(core, NgramDrafter(), 3, sampling=sampling)
    second, _ = generate(core, NgramDrafter(), 3, sampling=sampling)
    assert engine.stats["proposed"] > 0
    assert summary(first) == summary(second)
    assert [[e.logprob for e in r.entries] for r in first] == [[e.logprob for e in r.entries] for r in second]


def test_speculative_option_errors(cores):
    _, core, draft, _ = cores
    assert parse_speculative("ngram:4").draft_tokens == 4
    assert parse_speculative("draft:/a:b/core:3").draft_core.as_posix() == "/a:b/core"
    for bad in ("ngram", "ngram:0", "ngram:x", "draft:4", "medusa:2", "ngram:c:2", "mtp:c:2", "mtp:0"):
        with pytest.raises(SpeculativeError, match="expected ngram:S, mtp:S or draft:CORE:S"):
            parse_speculative(bad)
    mtp = parse_speculative("mtp:2")
    assert (mtp.kind, mtp.draft_tokens, mtp.draft_core) == ("mtp", 2, None)
    with pytest.raises(SpeculativeError, match=f"mtp:2: core {core.path} has no multi-token-prediction draft graphs"):
        engine_options(mtp, core, load_core)
    with pytest.raises(ValueError, match="no verify variants for 6 draft tokens .*S = \\[5\\]"):
        Engine(core, drafter=NgramDrafter(), draft_tokens=6)
    assert Engine(core, drafter=NgramDrafter(), draft_tokens=3).scheduler.proposer.verify_variants[0].name == "verify.s5.c2"


def test_run_with_speculation_equals_run_without(cores):
    """``ignition run --json`` with ``--speculative ngram:3`` and with the target as its own draft core, against
    the same command without: the same tokens, logprob ids and order, and values within TOL (a verify round's GEMM
    has S+1 rows a lane, so values may differ by a few ulps, as with co-batching)."""
    path = str(cores[1].path)

    def run(*speculative: str) -> dict:
        result = CliRunner().invoke(app, ["run", path, "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--max-tokens",
                                          "10", "--logprobs", "5", "--json", *speculative])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    plain = run()
    for value in ("ngram:3", f"draft:{path}:3"):
        tokens = run("--speculative", value)["tokens"]
        assert [t["id"] for t in tokens] == [t["id"] for t in plain["tokens"]], value
        for got, want in zip(tokens, plain["tokens"], strict=True):
            assert [t["id"] for t in got["top_logprobs"]] == [t["id"] for t in want["top_logprobs"]], value
            values = [(got["logprob"], want["logprob"])] + [(a["logprob"], b["logprob"]) for a, b in
                                                            zip(got["top_logprobs"], want["top_logprobs"])]
            assert all(abs(a - b) < TOL for a, b in values), (value, values)


def test_mixed_rounds_equal_serial_rounds(cores, plain):
    """The 30-token prompt's two chunks ride in mixed rounds beside the other request's decode lane (no packed
    prefill: it would run both prompts' first chunks in one round before anything decodes)."""
    _, core, _, _ = cores
    mixed = Engine(core, packed=False)
    requests = [Request(p, max_tokens=10, logprobs=5, ignore_eos=True) for p in reversed(PROMPTS)]
    results = list(reversed(mixed.generate(requests)))
    assert mixed.stats["mixed_rounds"] >= 2
    assert summary(results) == summary(plain)
    for result, reference in zip(results, plain):
        for entry, base in zip(result.entries, reference.entries):
            assert abs(entry.logprob - base.logprob) < TOL


def test_the_program_reader_reads_the_verify_graphs_lifted_constant(cores):
    """validate/program_reader.py on the verify and mixed graphs: a lifted tensor constant becomes the attribute
    torch's unlifted module reads, with the same bytes; the same nodes and runs as torch.export.load."""
    from _program_oracle import assert_core_read_alike

    from ignition.runtime.device import foreign_devices, move_program

    programs = assert_core_read_alike(cores[1].path)
    assert sum(len(list(p.graph_module.named_buffers())) for p in programs.values()) >= 1
    meta = torch.device("meta")
    for name, program in programs.items():  # the constants move with the program (runtime/device.py)
        assert foreign_devices(move_program(program, meta), meta) == [], name
