"""The qwen3 and llama recipes against transformers: exported cores replayed by hand.

Each case is a tiny random checkpoint written by transformers' ``save_pretrained`` and exported
with two decode capacities and an 8-row prefill chunk, so an 11-token prompt takes a
non-emitting chunk and an emitting one. Every graph is replayed with ``torch.export.load``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from _decoder_cores import LLAMA3_ROPE, CoreReplay, TinyCase, save_checkpoint
from ignition.catalog.abi import RecordField, has_payload
from ignition.catalog.contract import NATURAL_K
from ignition.catalog.enums import FinishReason, Operation, RoundKind
from ignition.components.sampling import SAMPLING_DEFAULTS, SamplingTensors, sample
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.recipes.graphs import OUTPUT_PLANE, PENALTY_COUNTS, PROMPT_PLANE
from ignition.recipes.registry import build_recipe
from ignition.validate.core import validate_core

CASES = {
    # vocabularies are not multiples of any tile; qwen3 has head_dim 16 != hidden/heads
    "qwen3_fp32_sharded": TinyCase("qwen3", torch.float32, tie=False, vocab_size=150, max_shard_size="20KB"),
    "llama_fp32_tied_llama3": TinyCase("llama", torch.float32, tie=True, vocab_size=300, rope=LLAMA3_ROPE),
    "qwen3_bf16_tied": TinyCase("qwen3", torch.bfloat16, tie=True, vocab_size=150),
}
CAPACITIES, CHUNK_LIMIT, MAX_SEQ_LEN = (1, 2), 8, 32

# Tolerances on logprobs against transformers' logits through an FP64 log_softmax.
# fp32: our logits differ from HF's only by matmul reduction order (~2e-6 on logits of magnitude
# ~5, see test_transformer.py) and the FP32 logsumexp adds ~1e-6: measured logprob errors are at
# most 1.6e-6, so 1e-4 is a 60x margin, while a wrong normalization or position moves them by 1e-2.
# bf16: the logits were measured bit-identical to HF on AVX-512 CPUs without AMX (logprob error
# ~3e-7, FP32 logsumexp only); other kernels (AMX, other shapes) may flip a bf16 rounding of a logit
# (1 ulp = 2**-5 at |logit| < 8), which moves logit - logsumexp by at most 2 ulps. A structural bug moves it by O(1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2 * 2**-5}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case name -> (core path, transformers model), each exported once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            case, root = CASES[name], tmp_path_factory.mktemp(name)
            hf = save_checkpoint(case, root / "checkpoint")
            options = ExportOptions(recipe=case.family, checkpoint=root / "checkpoint", capacities=CAPACITIES,
                                    chunk_limit=CHUNK_LIMIT, max_seq_len=MAX_SEQ_LEN)
            export_core(options, root / "core")
            cache[name] = (root / "core", hf)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_core_validates_and_stores_weights_once(exported, name: str) -> None:
    core, hf = exported(name)
    report = validate_core(core)
    assert report.ok, report.violations
    manifest = json.loads((core / "manifest.json").read_text())
    case = CASES[name]
    dtype = str(case.dtype).removeprefix("torch.")
    assert manifest["capacities"] == list(CAPACITIES) and manifest["chunk_limit"] == CHUNK_LIMIT
    assert manifest["model"]["dtype"] == dtype and manifest["model"]["max_seq_len"] == MAX_SEQ_LEN
    assert [s["name"] for s in manifest["state"]] == ["k_cache", "v_cache", PENALTY_COUNTS]
    variants = json.loads((core / "catalog.json").read_text())["variants"]
    assert [v["name"] for v in variants] == [f"prefill.t{CHUNK_LIMIT}", "decode.c1", "decode.c2",
                                             f"packed.t{CHUNK_LIMIT}.c2"]
    with safe_open(str(core / "weights.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"F32" if dtype == "float32" else "BF16"}
    hf_tensors = {n for n, _ in hf.named_parameters()}
    assert len(names) == len(hf_tensors)  # HF's named_parameters lists a tied head once, too
    assert ("lm_head" in names) != case.tie


def oracle_logprobs(logits: torch.Tensor) -> np.ndarray:
    return torch.log_softmax(logits.to(torch.float64), dim=-1).numpy()


def assert_logprobs_match(emitted, logits: torch.Tensor, tolerance: float, where: str) -> None:
    """Chosen pair and the K natural alternatives against the FP64 oracle; IDs where not near-tied."""
    oracle = oracle_logprobs(logits)
    packed = emitted.packed
    assert packed is not None and packed.chosen_id == emitted.token, where
    assert abs(packed.chosen_logprob - oracle[emitted.token]) <= tolerance, where
    order = sorted(range(oracle.shape[0]), key=lambda token: (-oracle[token], token))[:NATURAL_K + 1]
    values = np.array([v for _, v in packed.alternatives])
    np.testing.assert_allclose(values, oracle[order[:NATURAL_K]], rtol=0, atol=tolerance, err_msg=where)
    for rank, (token, _) in enumerate(packed.alternatives):
        neighbours = [oracle[order[i]] for i in (rank - 1, rank + 1) if 0 <= i <= NATURAL_K]
        if all(abs(oracle[order[rank]] - v) > 2 * tolerance for v in neighbours):
            assert token == order[rank], f"{where}: alternative {rank}"


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_graphs_match_transformers_greedy_generation(exported, name: str) -> None:
    """Two requests: chunked prefill each, then batched decode; the shorter one leaves a padded lane."""
    core, hf = exported(name)
    tolerance = TOLERANCE[CASES[name].dtype]
    generator = torch.Generator().manual_seed(7)
    vocab = CASES[name].vocab_size
    prompts = {1: torch.randint(0, vocab, (11,), generator=generator).tolist(),  # slot -> prompt
               0: torch.randint(0, vocab, (5,), generator=generator).tolist()}
    steps = {1: 6, 0: 3}
    expected = {}
    for slot, prompt in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps[slot], output_logits=True,
                              return_dict_in_generate=True)
        expected[slot] = (out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits])

    replay = CoreReplay(core)
    generated = {slot: [] for slot in prompts}
    for slot, prompt in prompts.items():
        first = replay.prefill(prompt, slot)
        assert first.record.round_kind is RoundKind.SAMPLING and first.record.operation == Operation.PREFILL
        assert first.record.sequence_length == len(prompt)
        assert_logprobs_match(first, expected[slot][1][0], tolerance, f"slot {slot} prefill")
        generated[slot].append(first.token)
    for step in range(1, max(steps.values())):
        slots = [slot for slot in prompts if step < steps[slot]]
        lanes = {"input_ids": [], "positions": [], "slot_ids": [], "active_lanes": [], "generated_counts": []}
        for slot in slots + [-1] * (2 - len(slots)):  # padded lane: inactive, slot -1
            active = slot >= 0
            lanes["input_ids"].append(generated[slot][-1] if active else 0)
            lanes["positions"].append(len(prompts[slot]) + step - 1 if active else 0)
            lanes["slot_ids"].append(slot)
            lanes["active_lanes"].append(int(active))
            lanes["generated_counts"].append(step if active else 0)
        results = replay.decode(2, **lanes)
        for lane, slot in enumerate(slots):
            emitted = results[lane]
            assert emitted.record.slot == slot and emitted.record.sequence_length == len(prompts[slot]) + step
            assert_logprobs_match(emitted, expected[slot][1][step], tolerance, f"slot {slot} step {step}")
            generated[slot].append(emitted.token)
        if len(slots) < 2:
            assert results[1].record.round_kind is RoundKind.INVALID and results[1].record.emitted == ()
    assert generated == {slot: tokens for slot, (tokens, _) in expected.items()}
    # penalty state: prompt tokens and emitted tokens counted per slot
    penalty = replay.state[PENALTY_COUNTS]
    for slot, prompt in prompts.items():
        assert torch.equal(penalty[slot, PROMPT_PLANE], torch.bincount(torch.tensor(prompt), minlength=vocab).int())
        assert torch.equal(penalty[slot, OUTPUT_PLANE],
                           torch.bincount(torch.tensor(generated[slot]), minlength=vocab).int())


SAMPLING = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.2,
                frequency_penalty=0.1)


def sample_trajectory(core, logprobs: int, seeds=(11, 12)) -> tuple[list, list]:
    """Prefill two slots, then 5 sampled decode rounds; returns tokens and raw records per round."""
    replay = CoreReplay(core)
    prompts = {0: [3, 5, 7, 5, 3, 9, 11, 2, 4, 6], 1: [1, 2, 3]}
    tokens, records = {}, []
    for slot, prompt in prompts.items():
        first = replay.prefill(prompt, slot, seed=seeds[slot], offset=0, logprob_requested=logprobs, **SAMPLING)
        tokens[slot] = [first.token]
        records.append(first.record)
    for step in range(1, 6):
        results = replay.decode(2, input_ids=[tokens[0][-1], tokens[1][-1]], slot_ids=[0, 1],
                                positions=[len(prompts[0]) + step - 1, len(prompts[1]) + step - 1],
                                generated_counts=step, seed=list(seeds), offset=step, logprob_requested=logprobs,
                                **SAMPLING)
        for slot in (0, 1):
            tokens[slot].append(results[slot].token)
            records.append(results[slot].record)
            assert (results[slot].packed is not None) == bool(logprobs)
    return tokens, records, replay.state[PENALTY_COUNTS].clone()


def test_sampled_tokens_identical_with_and_without_logprobs(exported) -> None:
    core, _ = exported("qwen3_fp32_sharded")
    with_lp, records_lp, penalty_lp = sample_trajectory(core, logprobs=1)
    without, records, penalty = sample_trajectory(core, logprobs=0)
    assert with_lp == without
    strip = lambda r: (r.slot, r.round_kind, r.emitted, r.finish_reason, r.sequence_length)  # noqa: E731
    assert [strip(r) for r in records_lp] == [strip(r) for r in records]
    assert torch.equal(penalty_lp, penalty)
    assert sample_trajectory(core, logprobs=0)[0] == without  # seeded: reproducible
    assert sample_trajectory(core, logprobs=0, seeds=(21, 22))[0] != without  # and the seed matters


def test_forced_token_eos_budget_and_prompt_chunks(exported) -> None:
    core, _ = exported("llama_fp32_tied_llama3")
    replay = CoreReplay(core)
    prompt = list(range(1, 12))
    name = f"prefill.t{CHUNK_LIMIT}"
    _, buffers = replay.run(name, chunk_input_ids=prompt[:8], chunk_start=0, chunk_length=8, chunk_emits=0,
                            slot_ids=1, frame_index=1)
    idle = replay.emitted(buffers, 0)
    assert (idle.record.round_kind, idle.record.emitted, idle.record.sequence_length) == (RoundKind.ADMISSION, (), 8)
    first = replay.prefill(prompt, slot=1, forced_token_ids=42)  # re-prefill from 0 resets the slot's counts
    assert first.token == 42 and first.record.forced == (True,) and first.packed is None
    assert not has_payload(first.record, 0, requested=True)
    penalty = replay.state[PENALTY_COUNTS][1]
    assert int(penalty[PROMPT_PLANE].sum()) == len(prompt) and int(penalty[OUTPUT_PLANE, 42]) == 1
    greedy = replay.decode(1, input_ids=42, positions=len(prompt), slot_ids=1, generated_counts=1)[0]
    again = replay.decode(1, input_ids=42, positions=len(prompt), slot_ids=1, generated_counts=1,
                          eos_token_ids=greedy.token)[0]
    assert again.token == greedy.token and again.record.finish_reason is FinishReason.EOS
    budget = replay.decode(1, input_ids=42, positions=len(prompt), slot_ids=1, generated_counts=3, token_budget=4)[0]
    assert budget.record.finish_reason is FinishReason.LENGTH
    words = replay.run("decode.c1", input_ids=42, positions=len(prompt), slot_ids=1, frame_index=0)[1]
    assert int(words["completion_records"][0, 0, RecordField.OPERATION]) == Operation.DECODE


def test_penalties_read_the_slot_state(exported) -> None:
    """Greedy with all three penalties equals eager ``sample`` on transformers' logits and the slot's history."""
    core, hf = exported("qwen3_fp32_sharded")
    vocab = CASES["qwen3_fp32_sharded"].vocab_size
    penalties = dict(temperature=0.0, repetition_penalty=3.0, presence_penalty=0.5, frequency_penalty=0.7)
    replay = CoreReplay(core)
    prompt = torch.randint(0, vocab, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    sequence, generated, penalized_steps = list(prompt), [], 0
    for step in range(4):
        if step == 0:
            emitted = replay.prefill(prompt, slot=1, **penalties)
        else:
            emitted = replay.decode(1, input_ids=sequence[-1], positions=len(sequence) - 1, slot_ids=1,
                                    generated_counts=step, **penalties)[0]
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0, -1:]  # [1, vocab]
        output_counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=vocab).int()[None]
        prompt_mask = torch.bincount(torch.tensor(prompt), minlength=vocab)[None] > 0
        params = SamplingTensors.from_requests([dict(SAMPLING_DEFAULTS) | penalties])
        assert emitted.token == int(sample(logits, output_counts, prompt_mask, params, vocab)[0]), f"step {step}"
        penalized_steps += emitted.token != int(logits.argmax())
        sequence.append(emitted.token)
        generated.append(emitted.token)
    assert penalized_steps >= 2  # the penalties changed the greedy choice


def test_dtype_and_slots_options_shape_weights_and_state(exported) -> None:
    core, _ = exported("qwen3_fp32_sharded")
    build = build_recipe(ExportOptions(recipe="qwen3", checkpoint=core.parent / "checkpoint", capacities=(1, 2),
                                       chunk_limit=8, max_seq_len=32, dtype="bfloat16", num_slots=3))
    assert {tensor.dtype for tensor in build.weights.values()} == {torch.bfloat16}
    state = {decl.name: decl for decl in build.state}
    # the pool at its declared bound: 3 slots x ceil(32 / 16) blocks of 16 positions
    assert (state["k_cache"].dtype, state["k_cache"].shape) == ("bfloat16", [2, 6, 16, 2, 16])
    assert (state[PENALTY_COUNTS].dtype, state[PENALTY_COUNTS].shape) == ("int32", [3, 2, 150])
    assert (build.model["dtype"], build.model["num_slots"], build.chunk_limit) == ("bfloat16", 3, 8)
    assert (build.model["block_size"], build.model["kv_blocks"]) == (16, 6)
    prefill = build.graphs[0].variant
    assert [a.name for a in prefill.arguments if a.role.name == "INPUT"][:3] == ["slot_ids", "slot_epochs",
                                                                                  "active_lanes"]
    for graph in build.graphs:  # every variant reads and writes the pool through the slots' tables
        (tables,) = [a for a in graph.variant.arguments if a.name == "block_tables"]
        assert (tables.dtype, tables.shape) == ("int32", [3, 2])


def test_minimal_loader_serves_the_core_like_transformers(exported) -> None:
    """The runtime's own scheduling (chunking, padded decode capacities) reproduces HF greedy generation."""
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    core, hf = exported("llama_fp32_tied_llama3")
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (3, 9, 17)]
    results = Engine(load_core(core)).generate([Request(prompt_ids=p, max_tokens=4, ignore_eos=True) for p in prompts])
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4)[0, len(prompt):]
        assert result.token_ids == expected.tolist() and result.error is None


def test_a_slot_limited_decode_variant_matches_transformers(tmp_path) -> None:
    """``decode.c2`` of a 4-slot core declares slot limit 2; lanes it cannot serve (a slot of 2 or more) run in
    ``decode.c4``. Both give transformers' greedy tokens and logprobs."""
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    case = CASES["qwen3_fp32_sharded"]
    hf = save_checkpoint(case, tmp_path / "checkpoint")
    export_core(ExportOptions(recipe="qwen3", checkpoint=tmp_path / "checkpoint", capacities=(1, 2, 4),
                              chunk_limit=CHUNK_LIMIT, max_seq_len=MAX_SEQ_LEN), tmp_path / "core")
    core = load_core(tmp_path / "core")
    assert {name: v.layout.get("slot_limit") for name, v in core.variants.items() if name.startswith("decode")} == \
        {"decode.c1": None, "decode.c2": 2, "decode.c4": None}
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, case.vocab_size, (length,), generator=generator).tolist() for length in (4, 7, 5, 9)]
    budgets = [2, 2, 6, 6]  # slots 0 and 1 finish first: slots 2 and 3 then decode alone, two lanes

    def run(requests: list[Request]) -> tuple[list, list[tuple[str, tuple[int, ...]]]]:
        engine, rounds = Engine(core), []
        engine.runner.hook = lambda variant, reader, pending: rounds.append(
            (variant.name, tuple(sorted(owner[0] for owner in pending.lane_owner if owner is not None))))
        return engine.generate(requests), [r for r in rounds if r[0].startswith("decode")]

    pair, low = run([Request(prompt_ids=p, max_tokens=4, logprobs=5, ignore_eos=True) for p in prompts[:2]])
    assert low and set(low) == {("decode.c2", (0, 1))}, low  # two lanes in slots 0 and 1: the limited variant
    results, rounds = run([Request(prompt_ids=p, max_tokens=b, logprobs=5, ignore_eos=True)
                           for p, b in zip(prompts, budgets)])
    assert ("decode.c4", (2, 3)) in rounds and all(name != "decode.c2" for name, _ in rounds), rounds
    for prompt, budget, result in [*zip(prompts, budgets, results), *zip(prompts[:2], (4, 4), pair)]:
        with torch.no_grad():  # the whole prompt attended: generate masks token 0 as padding otherwise
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=budget,
                              output_logits=True, return_dict_in_generate=True)
        assert result.token_ids == out.sequences[0, len(prompt):].tolist() and result.error is None
        for entry, logits in zip(result.entries, out.logits):
            expected = oracle_logprobs(logits[0])
            assert abs(entry.logprob - expected[entry.id]) < TOLERANCE[torch.float32]
            assert all(abs(value - expected[token]) < TOLERANCE[torch.float32] for token, value in entry.top)
