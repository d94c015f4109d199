"""Speculative acceptance and the speculative writer, eagerly: the rejection rule keeps the target
distribution (chi-square on the toy model), greedy acceptance, clipping, and which positions are reduced."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from ignition.catalog.abi import decode_packed_position, decode_record
from ignition.catalog.buffers import DRAFT_TOKENS, LANE_INPUTS, LOGPROBS, RECORDS, REQUESTED, resolve_shape
from ignition.catalog.enums import FinishReason, RoundKind
from ignition.components.completion import CompletionOutputs
from ignition.components.logprobs import reduce_logprobs_reference
from ignition.components.sampling import SamplingTensors, filtered_distribution
from ignition.components.speculative import accept_draft, commit_speculative_round, row_sampling, verify_rows
from ignition.recipes.base import ExportOptions
from ignition.recipes.toy import VOCAB_SIZE, batch_invariant_logits, load_weights

SAMPLES = 6000
P_VALUE_FLOOR = 1e-3  # fixed seeds make the statistic deterministic; the floor is the test's significance level


def toy_target(context_token: int = 17) -> torch.Tensor:
    """The toy bigram's raw logits after one context token: [1, vocab_padded]."""
    weights = load_weights(ExportOptions(recipe="toy"))
    return batch_invariant_logits(weights["embedding.weight"][[context_token]], weights["lm_head.weight"])


def first_tokens(logits: torch.Tensor, draft: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The first emitted token of SAMPLES one-draft verify rounds (seeds 0..SAMPLES-1) over the same target
    row: with the rejection rule, and with a broken rule that always takes the proposal (the control)."""
    rows = logits.expand(SAMPLES, -1).repeat_interleave(2, dim=0)  # [SAMPLES * P, V], P = 2
    params = row_sampling(SamplingTensors.from_requests(
        [{"temperature": temperature, "seed": seed} for seed in range(SAMPLES)]), 2)
    greedy, sorted_ids, probs = filtered_distribution(
        rows, torch.zeros(rows.shape, dtype=torch.int32), torch.zeros(rows.shape, dtype=torch.bool), params, VOCAB_SIZE)
    drafts, lengths = torch.full((SAMPLES, 1), draft), torch.ones(SAMPLES, dtype=torch.int64)
    tokens, counts = accept_draft(greedy, drafts, lengths, params, sorted_ids, probs)
    assert bool((counts >= 1).all())
    broken, _ = accept_draft(greedy, drafts, lengths, params, sorted_ids, torch.where(sorted_ids == draft, 1e9, probs))
    return tokens[:, 0].numpy(), broken[:, 0].numpy()


def chi_square_p(tokens: np.ndarray, target: np.ndarray) -> float:
    """Bins with an expected count >= 5, the rest pooled into one bin."""
    expected = target * len(tokens)
    observed = np.bincount(tokens, minlength=len(target)).astype(np.float64)
    big = expected >= 5
    f_obs = np.append(observed[big], observed[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    return float(chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue)


def test_rejection_rule_keeps_the_target_distribution():
    logits = toy_target()
    temperature = 1.5  # flattens the bigram: many bins, and the draft is likely but not certain
    target = torch.softmax(logits[0, :VOCAB_SIZE].double() / temperature, dim=0).numpy()
    draft = int(np.argsort(-target)[1])  # the second most likely token
    assert 0.02 < target[draft] < 0.9
    tokens, broken = first_tokens(logits, draft, temperature)
    assert 0 < (tokens == draft).mean() < 1
    assert chi_square_p(tokens, target) > P_VALUE_FLOOR
    assert chi_square_p(broken, target) < P_VALUE_FLOOR, "the test cannot tell a wrong rule from the right one"


def test_greedy_acceptance_takes_the_matching_prefix_then_the_target_token():
    greedy = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]]).reshape(-1)  # target greedy per row
    drafts = torch.tensor([[4, 5, 9], [8, 5, 6], [4, 5, 6]])
    lengths = torch.tensor([3, 3, 2])  # lane 2 proposed two tokens
    tokens, counts = accept_draft(greedy, drafts, lengths)
    assert counts.tolist() == [3, 1, 3]
    assert tokens.tolist() == [[4, 5, 6, -1], [4, -1, -1, -1], [4, 5, 6, -1]]


CAPACITY, POSITIONS, VOCAB, SENTINEL = 4, 4, 40, 0x5A5A5A5A


def verify_buffers() -> dict[str, torch.Tensor]:
    buffers = {spec.name: torch.zeros(resolve_shape(spec, capacity=CAPACITY), dtype=getattr(torch, spec.dtype))
               for spec in LANE_INPUTS}
    buffers |= CompletionOutputs.allocate(CAPACITY, POSITIONS + 1).tensors()
    buffers["slot_ids"][:] = torch.tensor([3, 1, 0, 2])
    buffers["slot_epochs"][:] = torch.tensor([2, 5, 1, 4])
    buffers["active_lanes"][:] = 1
    buffers["frame_index"][:] = 1
    buffers["positions"][:] = torch.tensor([10, 20, 30, 40])
    buffers["generated_counts"][:] = torch.tensor([0, 3, 5, 6])
    buffers["token_budget"][:] = torch.tensor([16, 5, 16, 6])  # lane 1: two tokens left; lane 3: exhausted
    buffers["eos_token_ids"][:] = torch.tensor([-1, -1, 12, -1])  # lane 2 emits its EOS at position 1
    buffers["forced_token_ids"][:] = -1
    buffers[REQUESTED][:] = torch.tensor([1, 1, 1, 1], dtype=torch.int32)
    buffers[LOGPROBS].fill_(SENTINEL)
    buffers[DRAFT_TOKENS] = torch.tensor([[4, 5, 6], [7, 8, 9], [11, 12, 13], [1, 2, 3]])
    return buffers


def test_commit_clips_and_the_writer_reduces_only_the_committed_prefix():
    buffers = verify_buffers()
    _, _, valid, lengths = verify_rows(buffers)
    assert lengths.tolist() == [3, 3, 3, 3] and bool(valid.all())
    raw = torch.randn(CAPACITY * POSITIONS, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens = torch.tensor([[4, 5, 6, 30], [7, 8, 9, 31], [11, 12, 13, 32], [1, 2, 3, 33]])  # everything accepted
    emitted = commit_speculative_round(buffers, raw, tokens, torch.full((CAPACITY,), POSITIONS), vocab_size=VOCAB, k=3)
    assert emitted.tolist() == [[4, 5, 6, 30], [7, 8, -1, -1], [11, 12, -1, -1], [-1, -1, -1, -1]]
    records = [decode_record(buffers[RECORDS][1, lane].numpy()) for lane in range(CAPACITY)]
    assert [r.emitted for r in records] == [(4, 5, 6, 30), (7, 8), (11, 12), ()]
    assert [r.round_kind for r in records] == [RoundKind.SPECULATIVE] * 3 + [RoundKind.MAINTENANCE]
    assert [r.finish_reason for r in records] == [FinishReason.NONE, FinishReason.LENGTH, FinishReason.EOS,
                                                 FinishReason.NONE]
    assert [r.sequence_length for r in records][:3] == [14, 22, 32]
    written = [[int(buffers[LOGPROBS][1, lane, j, 0]) != SENTINEL for j in range(POSITIONS)] for lane in range(CAPACITY)]
    assert written == [[True] * 4, [True, True, False, False], [True, True, False, False], [False] * 4]
    assert int(buffers[LOGPROBS][0].ne(SENTINEL).sum()) == 0, "the inactive frame is never written"
    expected = torch.full((1, 2 + 2 * 128), SENTINEL, dtype=torch.int32)
    reduce_logprobs_reference(raw[[1]], torch.tensor([5]), torch.ones(1, dtype=torch.int32), expected,
                              torch.zeros(1, dtype=torch.int64), torch.zeros(1, 128, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int32), VOCAB, 3)
    assert torch.equal(buffers[LOGPROBS][1, 0, 1], expected[0]), "position j reduces the target's row j"


def test_writer_skips_stale_forced_and_unrequested_lanes():
    buffers = verify_buffers()
    buffers["token_budget"][:] = 16
    buffers["eos_token_ids"][:] = -1
    buffers["forced_token_ids"][:] = torch.tensor([-1, 44, -1, -1])  # lane 1: a forced token, emitted alone
    buffers[REQUESTED][:] = torch.tensor([1, 1, 0, 1], dtype=torch.int32)  # lane 2 did not ask
    raw = torch.randn(CAPACITY * POSITIONS, VOCAB, generator=torch.Generator().manual_seed(6))
    tokens = torch.tensor([[4, 5, 6, 30]] * CAPACITY)
    real_slots = buffers["slot_ids"].clone()
    buffers["slot_ids"][3] = 9  # lane 3's record is written for slot 9; the writer then checks against slot 2
    from ignition.components import speculative
    original = speculative.reduce_speculative_logprobs

    def stale_then_reduce(buffers_, *args, **kwargs):
        buffers_["slot_ids"][:] = real_slots  # the row's owner differs from the record: a stale record
        return original(buffers_, *args, **kwargs)

    speculative.reduce_speculative_logprobs = stale_then_reduce
    try:
        commit_speculative_round(buffers, raw, tokens, torch.full((CAPACITY,), 3), vocab_size=VOCAB, k=3)
    finally:
        speculative.reduce_speculative_logprobs = original
    records = [decode_record(buffers[RECORDS][1, lane].numpy()) for lane in range(CAPACITY)]
    assert records[1].emitted == (44,) and records[1].forced == (True,)
    written = [[int(buffers[LOGPROBS][1, lane, j, 0]) != SENTINEL for j in range(POSITIONS)] for lane in range(CAPACITY)]
    assert written == [[True, True, True, False], [False] * 4, [False] * 4, [False] * 4]
    packed = decode_packed_position(buffers[LOGPROBS][1, 0, 2].numpy(), 3)
    assert packed.chosen_id == 6
