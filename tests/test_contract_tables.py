"""The contract tables, CompletionOutputs, the ABI decoders and the docs generated from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ignition.catalog import docs
from ignition.catalog.abi import RecordField, decode_packed_position, decode_record, has_payload
from ignition.catalog.buffers import BUFFERS, COMPLETION_BUFFERS, resolve_shape, shape_expression
from ignition.catalog.contract import resolve_completion_token_capacity, scored_capacities
from ignition.catalog.enums import ENUMS, Operation, RoundKind, ValueSource
from ignition.components.completion import CompletionOutputs


def test_fixed_protobuf_codes():
    assert Operation.SCORED_PREFILL == 12
    assert ValueSource.PROMPT_TARGET_TOKEN == 39


def test_enum_codes_are_unique():
    for enum in ENUMS:
        values = [m.value for m in enum]
        assert len(values) == len(set(values)), enum


def test_buffer_table_matches_specification():
    expected = {
        "completion_records": ("int64", "[2, capacity, 16+T]"),
        "completion_logprobs": ("int32", "[2, capacity, T, 258]"),
        "logprob_requested": ("int32", "[capacity]"),
        "logprob_token_ids": ("int32", "[capacity, 128]"),
        "logprob_token_id_counts": ("int32", "[capacity]"),
        "prompt_logprobs": ("int32", "[2, C, 43]"),
        "prompt_target_tokens": ("int32", "[C]"),
    }
    for name, (dtype, shape) in expected.items():
        assert (BUFFERS[name].dtype, shape_expression(BUFFERS[name])) == (dtype, shape)
    assert resolve_shape(BUFFERS["completion_logprobs"], capacity=3, T=5) == [2, 3, 5, 258]


@pytest.mark.parametrize("value,expected", [(None, 8), (0, 8), (1, 1), (12, 12)])
def test_token_capacity_resolution(value, expected):
    assert resolve_completion_token_capacity(value) == expected


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_token_capacity_rejects(value):
    with pytest.raises(ValueError, match="completion_token_capacity"):
        resolve_completion_token_capacity(value)


@pytest.mark.parametrize("limit,expected", [(100, [100]), (128, [128]), (256, [128, 256]),
                                            (2048, [128, 512, 2048]), (4096, [128, 512, 2048, 4096])])
def test_scored_capacities(limit, expected):
    assert scored_capacities(limit) == expected


def test_completion_outputs_allocate():
    bundle = CompletionOutputs.allocate(4)
    assert bundle.token_capacity == 8
    for spec, tensor in zip(COMPLETION_BUFFERS, bundle.tensors().values()):
        assert tensor.dtype == getattr(torch, spec.dtype) and tensor.is_contiguous()
        assert list(tensor.shape) == resolve_shape(spec, capacity=4, T=8)
    assert bundle.physical_bytes() == 2 * 4 * 24 * 8 + 2 * 4 * 8 * 258 * 4 + 4 * 4 + 4 * 128 * 4 + 4 * 4
    assert [d.name for d in bundle.declarations()] == [s.name for s in COMPLETION_BUFFERS]
    assert CompletionOutputs.allocate(2, 3).completion_records.shape == (2, 2, 19)


@pytest.mark.parametrize("capacity", [0, -2, 1.5])
def test_completion_outputs_rejects_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        CompletionOutputs.allocate(capacity)


def test_record_worked_example_from_docs():
    words = [5, 3, 1, 1, 0, 0, 0, 4, 12, 1, 2, 0, 0, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0, 0]
    record = decode_record(words)
    assert (record.slot, record.epoch, record.round_kind, record.emitted) == (5, 3, RoundKind.SAMPLING, (17,))
    assert record.forced == (False,) and has_payload(record, 0, requested=True)
    assert not has_payload(record, 0, requested=False) and not has_payload(record, 1, requested=True)
    assert (record.generated_before, record.sequence_length, record.frame, record.operation) == (4, 12, 1, 2)
    assert RecordField.OPERATION == 10


def test_packed_worked_example_from_docs():
    words = np.array([17, 0xBF9A0000, 17, 0xBF9A0000, 4, 0xC0100000], dtype=np.uint32).view(np.int32)
    position = decode_packed_position(words, 2)
    assert position.chosen_id == 17 and position.chosen_logprob == -1.203125
    assert position.alternatives == ((17, -1.203125), (4, -2.25))


def test_docs_are_generated_from_the_tables():
    current = docs.DOC.read_text()
    assert docs.render(current) == current, "run: python -m ignition.catalog.docs"


def test_reserved_codes_say_what_a_core_gets_today():
    import re

    from ignition.catalog.enums import ENUMS, Operation, RoundKind, reserved_status
    from ignition.catalog.rules import RULES

    reserved = {(type(m).__name__, m.name) for enum in ENUMS for m in enum if reserved_status(m)}
    assert {("Operation", "DRAFT_PROPOSE"), ("RoundKind", "VISION")} <= reserved
    for built in (Operation.DECODE, Operation.MIXED, Operation.SPECULATIVE_VERIFY, RoundKind.ADMISSION,
                  RoundKind.SPECULATIVE):
        assert reserved_status(built) is None, built
    for enum in ENUMS:
        for member in enum:
            for rule in re.findall(r"`([A-Z]+-[A-Z-]+)`", reserved_status(member) or ""):
                assert rule in RULES, (member, rule)
    assert ("| `DRAFT_PROPOSE` | 5 | reserved, not built yet: a core declaring it is rejected by `ENUM-RESERVED` |"
            in docs.DOC.read_text())
