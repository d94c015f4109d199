"""benchmarks/_steps.py: the decode-step timing the step benchmarks share, and the data rows they write."""

from __future__ import annotations

import csv
import json

import pytest

import benchmarks._steps as steps_module
from benchmarks._steps import ROW_FIELDS, alternating_costs, decode_rates, paired_costs, step_row, write_rows


def test_decode_rates_alternate_the_settings_and_take_the_median_decode_step():
    calls = []

    def side(prompts, tokens, logprobs, steps):  # 0.05 s a decode step (0.1 s with logprobs 20); one step disturbed
        calls.append((tokens, logprobs))
        per_step = 0.1 if logprobs == 20 else 0.05
        steps.extend([per_step] * (tokens - 2) + [per_step * (1 + len(calls))])
        return 1.0, [[logprobs or 0, len(calls)]]

    rates = decode_rates(side, [[1, 2], [3, 4]], [None, 5, 20], tokens=5, repeats=4)
    # alternated, each round starting one setting later
    assert [k for _, k in calls] == [None, 5, 20, 5, 20, None, 20, None, 5, None, 5, 20]
    assert all(tokens == 5 for tokens, _ in calls)
    # two lanes over the median of sixteen steps, of which four (the disturbed ones) are slower
    assert abs(rates[None].rate - 2 / 0.05) < 1e-9 and abs(rates[20].rate - 2 / 0.1) < 1e-9
    assert rates[20].tokens == [[20, 3]] and rates[None].tokens == [[0, 1]]  # each setting's first run's tokens
    assert rates[20].rounds == [0.1] * 4  # each run's median step: its disturbed step is one of four
    # every step of its four runs (calls 3, 5, 7 and 12), the disturbed ones included
    assert rates[20].steps == pytest.approx(([0.1] * 3 + [0.4]) + ([0.1] * 3 + [0.6]) + ([0.1] * 3 + [0.8])
                                            + ([0.1] * 3 + [1.3]), abs=1e-12)
    assert paired_costs(rates, 20) == [2.0] * 4  # logprobs 20's run over off's, round by round


def test_alternating_costs_step_two_engines_in_turn(toy_core, monkeypatch):
    from ignition.runtime.core import load_core

    core = load_core(toy_core)
    stepped = []  # (the engine's core, whether its lanes ask for logprobs) of each timed step, in order
    timed = steps_module.timed

    def recording(fn):
        engine = fn.__self__
        stepped.append((engine.core, engine.running[0].request.logprobs))
        return timed(fn)

    monkeypatch.setattr(steps_module, "timed", recording)
    ratios = alternating_costs(core, [[3, 14, 15, 9], [2, 6, 5, 3, 5]], 5, rounds=2, steps=3)
    assert len(ratios) == 6 and all(ratio > 0 for ratio in ratios)
    # the engine that goes first alternates pair by pair; the core (not its replica) has logprobs in round 1 only
    assert [k for _, k in stepped] == [5, None, None, 5, 5, None] * 2
    first, second = stepped[0][0], stepped[1][0]
    assert first is core and second is not core and second.weights is core.weights
    assert [owner is core for owner, k in stepped if k == 5] == [True] * 3 + [False] * 3


def test_hf_step_profile_profiles_the_steps_generate_takes():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = Qwen3ForCausalLM(config).eval()
    prompts = [[3, 14, 15, 92], [6, 5, 35, 89]]
    shares, walls, others, tokens = steps_module.hf_step_profile(model, prompts, logprobs=5, steps=2)
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompts), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[:, 4:].tolist()
    assert tokens == expected
    assert len(shares) == len(walls) == len(others) == 2
    assert all(0.0 < share < 1.0 for share in shares) and all(0.0 < other < wall for other, wall in zip(others, walls))


def test_a_step_row_holds_the_percentiles_in_ms():
    row = step_row("realsize", "ours", "batch", 8, [0.001 * v for v in range(1, 11)], {"threads": 2, "logprobs": 5})
    # numpy's linear percentiles of 1..10 ms: 20th 2.8, 50th 5.5, 80th 8.2
    assert (row.p20, row.p50, row.p80, row.samples, row.unit) == (2.8, 5.5, 8.2, 10, "ms")
    assert (row.benchmark, row.side, row.metric, row.x_name, row.x_value) == ("realsize", "ours", "decode step",
                                                                              "batch", 8)
    assert row.config == '{"logprobs":5,"threads":2}' and row.device and row.timestamp.endswith("+00:00")
    with pytest.raises(ValueError, match="realsize ours at batch 8: no steps"):
        step_row("realsize", "ours", "batch", 8, [], {})


def test_write_rows_adds_rows_and_replaces_a_row_of_the_same_key(tmp_path):
    path = tmp_path / "steps.csv"
    first = [step_row("core_ab", side, "batch", 8, [0.010, 0.012], {"logprobs": 5}) for side in ("old", "new")]
    write_rows(path, first)
    later = step_row("core_ab", "new", "batch", 8, [0.020], {"logprobs": 5})  # the same key as first[1]
    other = step_row("decode_steps", "retained", "batch", 8, [0.030], {"logprobs": 5})
    write_rows(path, [later, other])
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == ROW_FIELDS
    assert [(r["benchmark"], r["side"], r["p50"]) for r in rows] == [("core_ab", "old", "11.0"),
                                                                    ("core_ab", "new", "20.0"),
                                                                    ("decode_steps", "retained", "30.0")]
    assert json.loads(rows[0]["config"]) == {"logprobs": 5} and not list(tmp_path.glob(".*partial"))


def test_write_rows_refuses_a_file_of_other_columns(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("name,value\na,1\n")
    with pytest.raises(ValueError, match=r"other.csv: not a step-row file \(columns \['name', 'value'\], expected"):
        write_rows(path, [step_row("core_ab", "old", "batch", 1, [0.01], {})])
    assert path.read_text() == "name,value\na,1\n"
