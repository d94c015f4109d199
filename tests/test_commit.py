"""The shared commit, eagerly: records-only rounds, and the in-graph slot/epoch/emission gate of the reduction."""

from __future__ import annotations

import torch

from ignition.catalog.abi import RecordField, decode_packed_position, decode_record, has_payload
from ignition.catalog.buffers import LANE_INPUTS, LOGPROBS, RECORDS, REQUESTED, resolve_shape
from ignition.catalog.enums import Operation, RoundKind
from ignition.components.commit import (commit_sampling_round, prompt_round_kind, reduce_emitted_logprobs,
                                        write_round_records)
from ignition.components.completion import CompletionOutputs

CAPACITY, VOCAB, SENTINEL = 4, 50, 0x5A5A5A5A


def lane_buffers(frame: int = 1) -> dict[str, torch.Tensor]:
    """Four active lanes (slots 5, 1, 0, 2; epochs 3, 7, 1, 2), all requesting, stale payload everywhere."""
    buffers = {spec.name: torch.zeros(resolve_shape(spec, capacity=CAPACITY), dtype=getattr(torch, spec.dtype))
               for spec in LANE_INPUTS}
    buffers |= CompletionOutputs.allocate(CAPACITY, 2).tensors()
    buffers["slot_ids"][:] = torch.tensor([5, 1, 0, 2])
    buffers["slot_epochs"][:] = torch.tensor([3, 7, 1, 2])
    buffers["active_lanes"][:] = 1
    buffers["frame_index"][:] = frame
    buffers["token_budget"][:] = 16
    buffers["eos_token_ids"][:] = -1
    buffers["forced_token_ids"][:] = -1
    buffers[REQUESTED][:] = 1
    buffers[LOGPROBS].fill_(SENTINEL)
    return buffers


def logits() -> torch.Tensor:
    return torch.randn(CAPACITY, VOCAB, generator=torch.Generator().manual_seed(3))


def payload_written(buffers, lane: int, frame: int = 1) -> bool:
    return int(buffers[LOGPROBS][frame, lane, 0, 0]) != SENTINEL


def test_reduction_skips_rows_whose_record_is_stale_or_foreign(monkeypatch):
    """A row is reduced only when the active frame's record carries its slot and epoch and emits."""
    buffers, raw = lane_buffers(), logits()
    tokens = torch.tensor([7, 8, 9, 10])
    emitting = torch.tensor([True, True, True, False])
    write_round_records(buffers, tokens, emitting, torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.int64),
                        operation=Operation.DECODE, sequence_lengths=torch.full((4,), 3), round_kind=RoundKind.SAMPLING,
                        idle_round_kind=RoundKind.PROMPT)
    records = buffers[RECORDS]
    records[1, 1, RecordField.EPOCH] -= 1  # another writer's record for slot 1: an older epoch
    records[1, 2, RecordField.SLOT] = 3  # a record that belongs to another slot
    seen, real = [], torch.ops.ignition.reduce_logprobs
    # the prepared kernels index chosen[row] with unit stride: it must not be a column view into the records
    monkeypatch.setattr(torch.ops.ignition, "reduce_logprobs",
                        lambda logits, chosen, *rest: seen.append(chosen.is_contiguous()) or real(logits, chosen, *rest))
    reduce_emitted_logprobs(buffers, raw, vocab_size=VOCAB, k=3)
    assert seen == [True]
    assert [payload_written(buffers, lane) for lane in range(4)] == [True, False, False, False]
    packed = decode_packed_position(buffers[LOGPROBS][1, 0, 0].numpy(), 3)
    assert packed.chosen_id == 7  # the chosen token is the one the record emitted
    expected = torch.log_softmax(raw[0].double(), 0)[7].item()
    assert abs(packed.chosen_logprob - expected) < 1e-5
    assert (buffers[LOGPROBS][0] == SENTINEL).all(), "the inactive frame is never written"


def test_forced_and_non_emitting_rows_create_no_payload():
    buffers = lane_buffers()
    buffers["forced_token_ids"][2] = 11
    emits = torch.tensor([True, False, True, True])
    out = commit_sampling_round(buffers, logits(), torch.tensor([1, 2, 3, 4]), operation=Operation.DECODE,
                                vocab_size=VOCAB, k=2, sequence_lengths=torch.full((4,), 3), emits=emits)
    assert out.tolist() == [1, -1, 11, 4]
    records = [decode_record(buffers[RECORDS][1, lane].numpy()) for lane in range(4)]
    assert records[1].round_kind is RoundKind.PROMPT and records[1].emitted == ()
    assert records[2].forced == (True,)
    assert [payload_written(buffers, lane) for lane in range(4)] == [True, False, False, True]
    assert [has_payload(r, 0, requested=True) for r in records] == [True, False, False, True]
    assert all(int(buffers[RECORDS][1, lane, 6]) == 0 for lane in range(4)), "word 6 is reserved and zero"


def test_records_only_rounds_admission_prompt_maintenance_invalid():
    """Admission, maintenance and invalid rounds write records only: nothing emitted, no payload."""
    buffers = lane_buffers(frame=0)
    buffers["active_lanes"][3] = 0  # INVALID: outside the submission
    buffers["generated_counts"][2] = 16  # budget 16 exhausted: MAINTENANCE (a retired, cancelled lane)
    chunk_start = torch.tensor([0, 8, 0, 0])
    out = commit_sampling_round(buffers, logits(), torch.tensor([1, 2, 3, 4]), operation=Operation.PREFILL,
                                vocab_size=VOCAB, k=2, sequence_lengths=torch.full((4,), 8),
                                emits=torch.tensor([False, False, True, True]),
                                idle_round_kind=prompt_round_kind(chunk_start))
    assert out.tolist() == [-1, -1, -1, -1]
    records = [decode_record(buffers[RECORDS][0, lane].numpy()) for lane in range(4)]
    assert [r.round_kind for r in records] == [RoundKind.ADMISSION, RoundKind.PROMPT, RoundKind.MAINTENANCE,
                                               RoundKind.INVALID]
    assert all(r.emitted == () for r in records) and [r.slot for r in records] == [5, 1, 0, -1]
    assert not any(payload_written(buffers, lane, frame=0) for lane in range(4))


def test_exhausted_lane_never_emits_even_when_it_samples():
    buffers = lane_buffers()
    buffers["generated_counts"][:] = torch.tensor([15, 16, 17, 0])
    out = commit_sampling_round(buffers, logits(), torch.tensor([1, 2, 3, 4]), operation=Operation.DECODE,
                                vocab_size=VOCAB, k=2, sequence_lengths=torch.full((4,), 3))
    assert out.tolist() == [1, -1, -1, 4]
    kinds = [decode_record(buffers[RECORDS][1, lane].numpy()).round_kind for lane in range(4)]
    assert kinds == [RoundKind.SAMPLING, RoundKind.MAINTENANCE, RoundKind.MAINTENANCE, RoundKind.SAMPLING]
    assert [payload_written(buffers, lane) for lane in range(4)] == [True, False, False, True]
