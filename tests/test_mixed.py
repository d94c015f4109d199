"""Mixed prompt/decode graphs: every request's output equals the serial schedule's, the merge writes only the
active frame, and the validator's MIXED rules."""

from __future__ import annotations

import shutil

import pytest
import torch

from ignition.catalog.buffers import LOGPROBS, PROMPT_LANE, RECORDS, ROLE_FRAMES
from ignition.components.merge import merge_role_frames
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.constraints import LaneConstraints
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request

from conftest import CoreCopy
from test_validate_rules import rules_of


@pytest.fixture(scope="module")
def mixed_toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "toy"
    export_core(ExportOptions(recipe="toy", capacities=(2,), chunk_limit=4, mixed=True), out)
    return out


@pytest.fixture(scope="module")
def mixed_core(mixed_toy):
    return load_core(mixed_toy)


def requests():
    """Six requests over two slots (four wait): prompts of 1 to 13 tokens (up to four chunks), natural and
    selected logprobs, none, and max_tokens 0 (prefill only)."""
    shapes = [(1, 6, 3, None), (3, 5, None, None), (9, 7, 0, None), (13, 4, None, [3, 4, 5]), (6, 0, None, None),
              (5, 8, 20, None)]
    return [Request([(7 * i + j) % 250 for j in range(n)], max_tokens=m, logprobs=lp, logprob_token_ids=ids,
                    request_id=f"r{i}") for i, (n, m, lp, ids) in enumerate(shapes)]


def outcome(results):
    return [(r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries], r.finish_reason, r.error) for r in results]


def test_mixed_rounds_equal_serial_rounds_for_every_request(mixed_core):
    core = mixed_core
    serial = Engine(core, mixed=False)
    mixed = Engine(core)
    assert outcome(mixed.generate(requests())) == outcome(serial.generate(requests()))
    assert serial.stats["mixed_rounds"] == 0 and mixed.stats["mixed_rounds"] >= 5


def test_scored_requests_never_take_the_prompt_role(mixed_core):
    engine = Engine(mixed_core)
    decoding = Request([1, 2], max_tokens=6, request_id="d")
    scoring = Request([3, 4, 5], max_tokens=2, request_id="s")
    scoring.prompt_logprobs = 0
    assert not engine.scheduler._mixed_round(engine_state(engine, scoring), [engine_state(engine, decoding)])
    assert engine.stats["mixed_rounds"] == 0


def test_a_mixed_round_is_scheduled_as_data(mixed_core):
    """The schedule of a mixed round: the decoding lane first, then the prompt chunk's lane (its context rows), in
    the smallest mixed variant that holds them; only the constrained lane writes constraint rows."""
    engine = Engine(mixed_core)
    biased = LaneConstraints.build(mixed_core.vocab_size, logit_bias={7: 5.0})
    engine.submit(Request([1, 2], max_tokens=6, ignore_eos=True, constraints=biased, request_id="d"))
    assert engine.step() and len(engine.state("d").generated) == 1  # its one prompt chunk emitted its first token
    engine.submit(Request(list(range(3, 12)), max_tokens=2, request_id="p"))
    (round,) = engine.scheduler.schedule()
    assert round.variant.name == "mixed.t4.c2" and engine.stats["mixed_rounds"] == 1
    assert [lane.state.request_id for lane in round.lanes] == ["d", "p"]
    assert round.chunk_rows == [(1, 0, 4)] and round.constraint_rows == [0]
    assert round.lanes[1].chunk.tokens == [3, 4, 5, 6] and not round.lanes[1].chunk.emits
    engine.execute([round])
    assert engine.state("p").prefilled == 4 and len(engine.state("d").generated) == 2
    (following,) = engine.scheduler.schedule()
    assert following.variant.name == "mixed.t4.c2" and following.chunk_rows == [(1, 4, 8)]


def engine_state(engine, request):
    from ignition.runtime.requests import RequestState
    return RequestState(request, request.request_id)


def test_merge_copies_only_the_active_frame_of_each_lanes_role():
    frames, capacity, width = 2, 3, 5
    buffers = {"frame_index": torch.tensor([1]), PROMPT_LANE: torch.tensor([2])}
    for role, (records, logprobs) in ROLE_FRAMES.items():
        fill = 1 if role == "prompt" else 2
        buffers[records] = torch.full((frames, capacity, width), fill, dtype=torch.int64)
        buffers[logprobs] = torch.full((frames, capacity, 2, width), fill, dtype=torch.int32)
    buffers[RECORDS] = torch.full((frames, capacity, width), 7, dtype=torch.int64)
    buffers[LOGPROBS] = torch.full((frames, capacity, 2, width), 7, dtype=torch.int32)
    merge_role_frames(buffers, torch.tensor([False, False, True]))
    assert buffers[RECORDS][0].eq(7).all() and buffers[LOGPROBS][0].eq(7).all(), "the inactive frame is untouched"
    assert buffers[RECORDS][1, :, 0].tolist() == [2, 2, 1] and buffers[LOGPROBS][1, :, 0, 0].tolist() == [2, 2, 1]


@pytest.fixture
def mixed_copy(mixed_toy, tmp_path) -> CoreCopy:
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(mixed_toy, copy.root)
    return copy


def test_exported_mixed_core_is_valid(mixed_toy):
    assert rules_of(mixed_toy, check_graphs=False) == set()


def test_role_frames_must_be_declared(mixed_copy):
    mixed_copy.edit("catalog.json", lambda c: mixed_copy.variant(c, "mixed.t4.c2")["arguments"].__setitem__(
        slice(None), [a for a in mixed_copy.variant(c, "mixed.t4.c2")["arguments"] if a["name"] != "decode_role_logprobs"]))
    assert rules_of(mixed_copy.root, check_graphs=False) == {"MIXED-ROLES"}


def test_merge_must_be_declared(mixed_copy):
    mixed_copy.edit("catalog.json", lambda c: mixed_copy.variant(c, "mixed.t4.c2")["contract"]["layout"].pop("mixed"))
    assert rules_of(mixed_copy.root, check_graphs=False) == {"MIXED-MERGE"}


def test_no_scored_prompt_role(mixed_copy):
    def change(catalog):
        variant = mixed_copy.variant(catalog, "mixed.t4.c2")
        variant["arguments"].append({"name": "prompt_target_tokens", "dtype": "int32", "role": "input", "shape": [4]})
        variant["contract"]["bindings"]["prompt_target_tokens"] = 39
    mixed_copy.edit("catalog.json", change)
    assert "MIXED-SCORED" in rules_of(mixed_copy.root, check_graphs=False)
