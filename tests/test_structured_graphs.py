"""The structured-output inputs in exported graphs: the bitmask and the logit bias shape the sampling logits only.

Cores are exported and replayed by hand (``CoreReplay``): the session toy core (greedy bigram) and a tiny qwen3
checkpoint (the shared sampler: greedy and seeded Philox sampling). For each masked lane the emitted token must
be one the mask allows, and its reported logprob must be the *unconstrained* model's: bit-identical to what an
unmasked replay reports for that token as an explicit id, and within the existing tolerance of an FP64 oracle
(transformers' logits for qwen3, the bigram's own weights for the toy). Natural alternatives stay the unmasked
row's too: the reduction never sees the mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from _decoder_cores import CoreReplay, TinyCase, save_checkpoint
from ignition.catalog.buffers import BIAS_IDS, BIAS_VALUES, TOKEN_BITMASK
from ignition.catalog.contract import MAX_LOGIT_BIAS, MAX_SELECTED_IDS, bitmask_words
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.recipes.toy import VOCAB_PADDED, VOCAB_SIZE, batch_invariant_logits
from ignition.runtime.constraints import set_bits

TOY_TOL = 3e-5  # test_runtime.py's: fp32 bigram logits vs fp64, plus the FP32 reduction
QWEN_TOL = 1e-4  # test_recipes.py's fp32 tolerance against transformers through an FP64 log_softmax
QWEN = TinyCase("qwen3", torch.float32, tie=False, vocab_size=150)


def mask_rows(allowed: list[list[int] | None], vocab_padded: int) -> torch.Tensor:
    """int32 [lanes, words]: each lane's allowed ids, an all-zero row (no mask) for None."""
    rows = np.zeros((len(allowed), bitmask_words(vocab_padded)), dtype=np.int32)
    for lane, ids in enumerate(allowed):
        if ids is not None:
            set_bits(rows[lane], np.asarray(ids, dtype=np.int64))
    return torch.from_numpy(rows)


def bias_rows(biases: list[dict[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(biases), MAX_LOGIT_BIAS), -1, dtype=torch.int64)
    values = torch.zeros(len(biases), MAX_LOGIT_BIAS)
    for lane, bias in enumerate(biases):
        ids[lane, :len(bias)] = torch.tensor(list(bias), dtype=torch.int64)
        values[lane, :len(bias)] = torch.tensor(list(bias.values()))
    return ids, values


def explicit(ids: list[int]) -> dict:
    """Inputs asking every lane for the logprob of its own token ``ids[lane]`` as an explicit id."""
    table = torch.zeros(len(ids), MAX_SELECTED_IDS, dtype=torch.int32)
    table[:, 0] = torch.tensor(ids, dtype=torch.int32)
    return {"logprob_token_ids": table, "logprob_token_id_counts": 1}


def toy_oracle(core, token: int) -> np.ndarray:
    weights = load_file(str(core / "weights.safetensors"))
    logits = batch_invariant_logits(weights["embedding.weight"][token:token + 1], weights["lm_head.weight"])
    return torch.log_softmax(logits[0, :VOCAB_SIZE].double(), dim=-1).numpy()


def test_toy_core_declares_the_inputs(toy_core):
    replay = CoreReplay(toy_core)
    assert replay.manifest["features"]["structured_output"] is True
    for name, variant in replay.variants.items():
        shapes = {a["name"]: a["shape"] for a in variant["arguments"]}
        lanes = 1 if name.startswith("prefill") else variant["capacity"]
        assert shapes[TOKEN_BITMASK] == [lanes, VOCAB_PADDED // 32]
        assert shapes[BIAS_IDS] == shapes[BIAS_VALUES] == [lanes, MAX_LOGIT_BIAS]


def test_toy_mask_and_bias_shape_sampling_not_logprobs(toy_core):
    replay = CoreReplay(toy_core)
    inputs = dict(input_ids=[3, 4, 5, 6], positions=0, slot_ids=[0, 1, 2, 3], frame_index=0)
    free, free_buffers = replay.run("decode.c4", **inputs)
    free_rows = [replay.emitted(free_buffers, lane) for lane in range(4)]
    # lane 0: one allowed token (word 0's top bit, stored as a negative int32); lane 1: two allowed tokens and a
    # padded lane (never sampled); lane 2: unmasked with a bias that makes token 200 win; lane 3: all-zero row
    targets = [31, 57, 200, int(free[3])]
    mask = mask_rows([[31], [57, 58, VOCAB_SIZE + 2], None, None], VOCAB_PADDED)
    ids, values = bias_rows([{}, {58: -50.0}, {200: 1000.0}, {}])
    constrained = dict(inputs, token_bitmask=mask, logit_bias_ids=ids, logit_bias_values=values)
    tokens, buffers = replay.run("decode.c4", **constrained)
    assert tokens.tolist() == targets
    assert mask[0, 0] < 0  # bit 31 of an int32 word: the sign bit
    masked_rows = [replay.emitted(buffers, lane) for lane in range(4)]
    _, unmasked_buffers = replay.run("decode.c4", **inputs, **explicit(targets))
    for lane, token in enumerate(targets):
        unmasked = replay.emitted(unmasked_buffers, lane).packed
        got = masked_rows[lane].packed
        assert got.chosen_id == token and unmasked.alternatives[0][0] == token
        assert np.float32(got.chosen_logprob).tobytes() == np.float32(unmasked.alternatives[0][1]).tobytes()
        assert abs(got.chosen_logprob - toy_oracle(toy_core, inputs["input_ids"][lane])[token]) <= TOY_TOL
        assert got.alternatives == free_rows[lane].packed.alternatives  # natural top-K of the raw row
    assert masked_rows[3].packed == free_rows[3].packed  # a zero row and no bias: the lane is untouched


def test_toy_prefill_masks_its_one_lane(toy_core):
    replay = CoreReplay(toy_core)
    chunk = replay.manifest["chunk_limit"]
    prompt = [9, 8, 7]
    for allowed in ([0], [123], [VOCAB_SIZE - 1]):
        emitted = replay.prefill(prompt, 0, token_bitmask=mask_rows([allowed], VOCAB_PADDED))
        assert emitted.token == allowed[0] and emitted.packed.chosen_id == allowed[0]
        assert abs(emitted.packed.chosen_logprob - toy_oracle(toy_core, prompt[-1])[allowed[0]]) <= TOY_TOL
    assert chunk >= len(prompt)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-structured")
    hf = save_checkpoint(QWEN, root / "checkpoint")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "checkpoint", capacities=(1, 2), chunk_limit=8,
                              max_seq_len=32), root / "core")
    return root / "core", hf


def hf_logprobs(hf, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


SEEDED = dict(temperature=1.0, top_k=0, top_p=1.0)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(SEEDED, seed=5), dict(SEEDED, seed=77)],
                         ids=["greedy", "seed5", "seed77"])
def test_qwen_single_token_mask_emits_it_with_the_raw_logprob(qwen, sampling):
    core, hf = qwen
    vocab = QWEN.vocab_size
    prompts = {0: [3, 5, 7, 5, 3, 9, 11, 2, 4, 6], 1: [1, 2, 3]}  # the first takes two prefill chunks
    oracle = {slot: hf_logprobs(hf, prompt) for slot, prompt in prompts.items()}
    targets = {slot: int(np.argsort(oracle[slot])[vocab // 3]) for slot in prompts}  # far from the argmax
    replay = CoreReplay(core)
    first = {}
    for slot, prompt in prompts.items():
        first[slot] = replay.prefill(prompt, slot, token_bitmask=mask_rows([[targets[slot]]], vocab), **sampling)
        assert first[slot].token == targets[slot]
        assert abs(first[slot].packed.chosen_logprob - oracle[slot][targets[slot]]) <= QWEN_TOL
    # decode one step for both slots with a different single-token mask each
    steps = {slot: prompts[slot] + [targets[slot]] for slot in prompts}
    step_oracle = {slot: hf_logprobs(hf, steps[slot]) for slot in prompts}
    step_targets = [int(np.argsort(step_oracle[slot])[2]) for slot in (0, 1)]  # among the least likely
    inputs = dict(input_ids=[targets[0], targets[1]], positions=[len(prompts[0]), len(prompts[1])], slot_ids=[0, 1],
                  generated_counts=1, offset=1, **{k: v for k, v in sampling.items() if k != "seed"},
                  seed=[sampling.get("seed", 0), sampling.get("seed", 0) + 1])
    results = replay.decode(2, token_bitmask=mask_rows([[step_targets[0]], [step_targets[1]]], vocab), **inputs)
    unmasked = replay.decode(2, **inputs, **explicit(step_targets))
    for lane in (0, 1):
        got = results[lane].packed
        assert results[lane].token == step_targets[lane] == got.chosen_id
        reported = unmasked[lane].packed.alternatives[0][1]
        assert np.float32(got.chosen_logprob).tobytes() == np.float32(reported).tobytes()
        assert abs(got.chosen_logprob - step_oracle[lane][step_targets[lane]]) <= QWEN_TOL


def test_qwen_seeded_sampling_stays_inside_a_wider_mask(qwen):
    """Three allowed tokens, six seeds: every draw is one of them, and with top_k=1 the draw is the allowed token
    of the largest raw logit (the mask applies before top-k, like vLLM's allowed_token_ids)."""
    core, hf = qwen
    prompt = [1, 2, 3]
    oracle = hf_logprobs(hf, prompt)
    allowed = [int(t) for t in np.argsort(oracle)[[5, 40, 90]]]
    seen = set()
    for seed in range(6):
        replay = CoreReplay(core)
        emitted = replay.prefill(prompt, 0, token_bitmask=mask_rows([allowed], QWEN.vocab_size), **SEEDED, seed=seed)
        assert emitted.token in allowed
        assert abs(emitted.packed.chosen_logprob - oracle[emitted.token]) <= QWEN_TOL
        seen.add(emitted.token)
    assert len(seen) > 1  # the seed matters: the draw is sampled, not the top allowed token every time
    replay = CoreReplay(core)
    top1 = replay.prefill(prompt, 0, token_bitmask=mask_rows([allowed], QWEN.vocab_size), **dict(SEEDED, top_k=1),
                          seed=3)
    assert top1.token == max(allowed, key=lambda t: oracle[t])


def test_qwen_bias_moves_sampling_not_logprobs(qwen):
    core, hf = qwen
    prompt = [4, 4, 2]
    oracle = hf_logprobs(hf, prompt)
    target = int(np.argmin(oracle))
    ids, values = bias_rows([{target: 100.0, int(np.argmax(oracle)): -100.0}])
    emitted = CoreReplay(core).prefill(prompt, 0, logit_bias_ids=ids, logit_bias_values=values, temperature=0.0)
    assert emitted.token == target
    assert abs(emitted.packed.chosen_logprob - oracle[target]) <= QWEN_TOL
    free = CoreReplay(core).prefill(prompt, 0, temperature=0.0)
    assert free.token == int(np.argmax(oracle)) and emitted.packed.alternatives == free.packed.alternatives
