"""Packed prefill (``packed.t{C}.c{capacity}``): several requests' prompt chunks in one submission.

Every lane's round must be its serial ``prefill.t{C}`` round, bit for bit on the CPU: tokens, logprob words,
records, KV cells and penalty counts; tokens and logprobs also match transformers within the FP32 tolerance of
tests/test_recipes.py. Also: the attention path against the chunk path, the copy bound, the window rule of the
scheduler, the exporter's choice, the input fill and the validator's PACKED rules.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from _decoder_cores import TinyCase, save_checkpoint
from conftest import CoreCopy
from test_decode_copies import CacheCopies
from test_validate_rules import rules_of

from ignition.catalog.abi import RecordField
from ignition.catalog.buffers import (KEY_WINDOW, PACKED_TOKENS, SAMPLE_WINDOW, SEGMENT_WINDOW, TOKEN_BITMASK,
                                     TRANSFORM_WINDOW)
from ignition.catalog.enums import Operation, RoundKind
from ignition.exporter.export import export_core
from ignition.recipes.attention import cached_attention, plan_attention
from ignition.recipes.packed_attention import packed_attention
from ignition.recipes.base import ExportOptions
from ignition.recipes.layers import Rows
from ignition.catalog.buffers import PACKED_LANES, WINDOWS
from ignition.recipes.llama import FAMILIES, packed_capacity
from ignition.runtime.bindings import ChunkPlan, Lane, Windowed, fill_inputs, replayed_extent
from ignition.runtime.constraints import LaneConstraints
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request, RequestState, SamplingParams
from ignition.validate.packed import check_packed

CHUNK, SLOTS, MAX_SEQ_LEN, VOCAB = 16, 4, 128, 300
PACKED = f"packed.t{CHUNK}.c{SLOTS}"
FP32_TOLERANCE = 1e-4  # tests/test_recipes.py: FP32 logprobs against an FP64 oracle of transformers' logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(core directory, transformers' model): a tiny FP32 Qwen3 with the default catalog at capacities 1 and 4."""
    root = tmp_path_factory.mktemp("packed")
    hf = save_checkpoint(TinyCase("qwen3", torch.float32, False, VOCAB, max_position_embeddings=MAX_SEQ_LEN),
                         root / "ckpt")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, SLOTS), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ_LEN), root / "core")
    return root / "core", hf


@pytest.fixture(scope="module")
def core(exported):
    return load_core(exported[0])


def prompt(index: int, length: int) -> list[int]:
    return [(37 * index + 11 * j) % (VOCAB - 1) + 1 for j in range(length)]


def first_token_requests() -> list[Request]:
    """Four requests whose rounds end at their first token (no decode round to co-batch differently): one to
    three chunks, natural, selected and no logprobs, greedy and seeded sampling with every penalty, a forced
    first token, and a prefill-only request."""
    penalties = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.25, seed=11)
    return [Request(prompt(0, 40), max_tokens=1, logprobs=5, request_id="three-chunks"),
            Request(prompt(1, 3), max_tokens=1, sampling=penalties, logprobs=20, request_id="sampled"),
            Request(prompt(2, 17), max_tokens=1, logprob_token_ids=[0, 5, 299], request_id="selected"),
            Request(prompt(3, 33), max_tokens=1, forced_tokens={0: 42}, request_id="forced")]


def run_fresh(core, requests, **engine) -> tuple[list, dict, int, dict]:
    """Run ``requests`` on a fresh engine over the same stale state (a previous request's cells and counts, which
    each prefill must reset or mask): (outcomes, state after, packed rounds, the PREFILL records of each
    (slot, epoch) in order, FRAME cleared)."""
    generator = torch.Generator().manual_seed(5)
    for tensor in core.state.values():
        stale = torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() \
            else torch.randint(0, 3, tensor.shape, generator=generator)
        tensor.copy_(stale)
    engine = Engine(core, **engine)
    records: dict[tuple[int, int], list] = {}

    def hook(variant, reader, pending):
        for lane, owner in enumerate(pending.lane_owner):
            words = reader.records_host[lane].numpy().copy()
            if owner is not None and words[RecordField.OPERATION] == Operation.PREFILL:
                words[RecordField.FRAME] = 0  # each variant alternates its own frames
                records.setdefault(owner, []).append(words.tolist())

    engine.decode_hook = hook
    results = engine.generate(requests)
    outcome = [(r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries], r.finish_reason, r.error)
               for r in results]
    return outcome, {name: t.clone() for name, t in core.state.items()}, engine.stats["packed_rounds"], records


def test_packed_rounds_equal_serial_rounds_bit_for_bit(core):
    requests = first_token_requests()
    serial, serial_state, serial_rounds, serial_records = run_fresh(core, requests, packed=False)
    packed, packed_state, packed_rounds, packed_records = run_fresh(core, requests)
    assert serial_rounds == 0 and packed_rounds == 3  # 16+3+16+16 rows, then 16+1+16, then 8+1
    assert all(error is None for *_, error in packed) and packed == serial
    assert packed_records == serial_records
    kinds = [[words[RecordField.ROUND_KIND] for words in rounds] for rounds in packed_records.values()]
    assert sorted(kinds) == sorted([[RoundKind.ADMISSION, RoundKind.PROMPT, RoundKind.SAMPLING], [RoundKind.SAMPLING],
                                    [RoundKind.ADMISSION, RoundKind.SAMPLING],
                                    [RoundKind.ADMISSION, RoundKind.PROMPT, RoundKind.SAMPLING]])
    for slot, request in enumerate(requests):  # slots are taken in order on a fresh engine
        written = len(request.prompt_ids)
        for name in ("k_cache", "v_cache"):
            assert torch.equal(packed_state[name][:, slot, :written], serial_state[name][:, slot, :written]), name
        assert torch.equal(packed_state["penalty_counts"][slot], serial_state["penalty_counts"][slot])
        assert int(packed_state["penalty_counts"][slot, 0].sum()) == written  # every prompt token counted once


def test_a_packed_round_projects_its_lanes_in_one_lm_head_product(core):
    """``sampled_row_logits``: the lanes' sampled rows are one ``[8, d_model]`` product, not one product a lane, and a
    serial chunk's one row is a row of a product of the same shape (the bits the packed-equals-serial test compares)."""
    from ignition.recipes.transformer import SAMPLED_ROW_BLOCK
    from ignition.validate.graph_json import FACTS

    def lm_head_rows(variant) -> list[int]:  # the LM head's weight: its own, or the tied embedding
        graph = variant.runner.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        names = variant.runner.names
        weight = placeholders[names.index(next((n for n in names if "lm_head" in n), None)
                                          or next(n for n in names if "embed" in n))]
        return [node.args[0].meta[FACTS].shape[0] for node in graph.nodes
                if node.op == "call_function" and "linear" in str(node.target) and node.args[1] is weight]

    assert SLOTS < SAMPLED_ROW_BLOCK  # the packed round's 4 lanes fill one block
    assert lm_head_rows(core.variants[PACKED]) == [SAMPLED_ROW_BLOCK]
    assert lm_head_rows(core.variants[f"prefill.t{CHUNK}"]) == [SAMPLED_ROW_BLOCK]


def test_packed_requests_match_transformers(exported, core):
    """Greedy generation after a packed prefill: tokens equal transformers', logprobs within the FP32 tolerance
    (the decode rounds read the KV cells the packed rounds wrote)."""
    _, hf = exported
    lengths = (40, 3, 17, 33)
    requests = [Request(prompt(i, n), max_tokens=5, logprobs=5, ignore_eos=True) for i, n in enumerate(lengths)]
    engine = Engine(core)
    results = engine.generate(requests)
    assert engine.stats["packed_rounds"] == 3
    for request, result in zip(requests, results):
        assert result.error is None
        ids = torch.tensor([request.prompt_ids + result.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(request.prompt_ids) - 1:-1].to(torch.float64)  # each generated position
        oracle = torch.log_softmax(logits, dim=-1)
        assert result.token_ids == logits.argmax(-1).tolist()
        for position, entry in enumerate(result.entries):
            assert abs(entry.logprob - oracle[position, entry.id].item()) <= FP32_TOLERANCE
            expected = oracle[position].topk(5).values.numpy()
            np.testing.assert_allclose([value for _, value in entry.top], expected, rtol=0, atol=FP32_TOLERANCE)


def test_batch_invariant_engine_packs_single_requests_with_the_same_results(core):
    requests = first_token_requests()[:2]
    alone = [run_fresh(core, [request], batch_invariant=True) for request in requests]
    assert [rounds for _, _, rounds, _ in alone] == [3, 1]  # one lane per packed round
    together, _, rounds, _ = run_fresh(core, requests, batch_invariant=True)
    assert rounds == 3 and together == [outcome[0] for outcome, *_ in alone]


def test_constrained_requests_are_packed_with_their_masks(core):
    """Structured output in a packed round: each lane samples from its own bitmask and bias rows."""
    assert TOKEN_BITMASK in core.variants[PACKED].buffers

    def requests():
        allowed = LaneConstraints.build(VOCAB, allowed_token_ids=[5, 17, 250])
        biased = LaneConstraints.build(VOCAB, logit_bias={"9": 100.0})
        return [Request(prompt(0, 20), max_tokens=1, logprobs=3, constraints=allowed),
                Request(prompt(1, 7), max_tokens=1, logprobs=3, constraints=biased),
                Request(prompt(2, 12), max_tokens=1, logprobs=3)]

    serial, _, _, _ = run_fresh(core, requests(), packed=False)
    packed, _, rounds, _ = run_fresh(core, requests())
    assert rounds == 1 and packed == serial  # 16+7+12 rows packed, then the first request's last 4 alone
    assert packed[0][0][0] in (5, 17, 250) and packed[1][0] == [9]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [(torch.float32, 4, 2, 16), (torch.bfloat16, 4, 2, 16),
                                                           (torch.float16, 4, 2, 16), (torch.float32, 16, 8, 128),
                                                           (torch.bfloat16, 16, 8, 128)])
def test_packed_attention_equals_each_chunk_alone(dtype, heads, kv_heads, head_dim):
    """Each lane's rows equal its chunk's through ``cached_attention`` (its own rows, the same key window), bit
    for bit: lanes of 5, 40, 0 (idle, slot -1) and 17 rows at later positions of their slots."""
    generator = torch.Generator().manual_seed(3)
    lengths, starts, slots, window = [5, 40, 0, 17], [0, 16, 0, 100], [3, 0, -1, 5], 192
    keys, values = (torch.randn(6, 256, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    rows = 80  # the packed rows, rounded up to 16
    query = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    packed = Rows.packed(rows, torch.tensor(starts), torch.tensor(lengths), torch.tensor(slots),
                         torch.zeros(48, dtype=torch.int64), torch.zeros(window, dtype=torch.int64))
    out = packed_attention(query, keys, values, packed)
    offset = 0
    for length, start, slot in zip(lengths, starts, slots):
        if length:
            chunk = torch.zeros(48, heads, head_dim, dtype=dtype)
            chunk[:length] = query[offset:offset + length]
            alone = Rows.prefill(48, torch.tensor([start]), torch.tensor([length]), torch.tensor([slot]),
                                 torch.zeros(window, dtype=torch.int64))
            plan = plan_attention(alone, keys.shape[0], keys.shape[1], heads // kv_heads, dtype)
            assert torch.equal(out[offset:offset + length], cached_attention(chunk, keys[None], values[None], 0, plan)[:length])
        offset += length
    assert packed.valid.tolist() == [True] * 62 + [False] * 18
    assert packed.positions[:6].tolist() == [0, 1, 2, 3, 4, 16] and packed.write_slots[44:47].tolist() == [0, 5, 5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eight_short_lanes_equal_each_chunk_alone(dtype):
    """Eight lanes whose forwards all end before 16 keys, at Qwen3-0.6B's attention width: each lane's rows (which
    take the brief rows, ``PackedPlan``, from one product over every lane and KV head) equal its chunk's through
    ``cached_attention`` (the padded in-order softmax), bit for bit."""
    heads, kv_heads, head_dim, window = 16, 8, 128, 32
    for trial in range(10):
        generator = torch.Generator().manual_seed(trial)
        lengths = torch.randint(1, 16, (8,), generator=generator).tolist()
        keys, values = (torch.randn(8, 64, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
        rows = -(-sum(lengths) // 16) * 16
        query = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
        packed = Rows.packed(rows, torch.zeros(8, dtype=torch.int64), torch.tensor(lengths), torch.arange(8),
                             torch.zeros(16, dtype=torch.int64), torch.zeros(window, dtype=torch.int64))
        out = packed_attention(query, keys, values, packed)
        offset = 0
        for slot, length in enumerate(lengths):
            chunk = torch.zeros(16, heads, head_dim, dtype=dtype)
            chunk[:length] = query[offset:offset + length]
            alone = Rows.prefill(16, torch.tensor([0]), torch.tensor([length]), torch.tensor([slot]),
                                 torch.zeros(window, dtype=torch.int64))
            plan = plan_attention(alone, keys.shape[0], keys.shape[1], heads // kv_heads, dtype)
            expected = cached_attention(chunk, keys[None], values[None], 0, plan)[:length]
            assert torch.equal(out[offset:offset + length], expected), f"trial {trial}, lane {slot} of {lengths}"
            offset += length


def test_a_packed_round_copies_each_lanes_window_once_and_no_cache(core):
    """Attention reads each lane's window (one key-window granule of the 128 cached positions) once; no op copies
    more than those windows."""
    granule = WINDOWS[KEY_WINDOW].granule  # every prompt below fits in one
    engine = Engine(core)
    for index, length in enumerate((5, 12, 3, 9)):
        engine.submit(Request(prompt(index, length), max_tokens=1))
    k_cache = core.state["k_cache"]  # [layers, slots, positions, kv_heads, head_dim]
    windows = SLOTS * granule * k_cache.shape[3] * k_cache.shape[4] * k_cache.element_size()
    watch = CacheCopies({t.untyped_storage().data_ptr() for t in core.state.values()}, windows)
    with watch:
        assert engine.step() and engine.stats["packed_rounds"] == 1
    assert watch.copies == [], watch.copies[:5]
    assert {keys for keys in watch.attention_keys} == {(SLOTS, k_cache.shape[3], granule, k_cache.shape[4])}
    engine.run()


def test_a_packed_prefill_is_scheduled_as_data(core):
    """The schedule of a packed prefill: every waiting request's first chunk in admission order (at most C rows each,
    as the serial round cuts it) in the packed variant; only a constrained lane whose chunk samples writes constraint
    rows. The next step's chunk of the longest prompt runs alone."""
    engine = Engine(core)
    biased = LaneConstraints.build(VOCAB, logit_bias={5: 2.0})
    engine.submit(Request(prompt(0, 5), request_id="a"))
    engine.submit(Request(prompt(1, 20), request_id="b", constraints=biased))
    engine.submit(Request(prompt(2, 3), request_id="c", constraints=biased))
    (round,) = engine.scheduler.schedule()
    assert round.variant.name == PACKED and engine.stats["packed_rounds"] == 1
    assert [lane.state.request_id for lane in round.lanes] == ["a", "b", "c"]
    assert round.chunk_rows == [(0, 0, 5), (1, 0, CHUNK), (2, 0, 3)]
    assert round.constraint_rows == [2]  # b's first chunk samples nothing
    engine.execute([round])
    assert [engine.state(r).prefilled for r in "abc"] == [5, CHUNK, 3]
    (following,) = engine.scheduler.schedule()
    assert following.variant.operation is Operation.PREFILL and following.chunk_rows == [(0, CHUNK, 20)]
    assert following.constraint_rows == [0]
    engine.execute([following])
    engine.run()


def test_only_lanes_of_one_key_window_are_packed(core):
    """The lead's window decides: a request whose next chunk ends past the lead's key window waits."""
    engine = Engine(core)
    variant = core.variants[PACKED]
    states = [RequestState(Request(prompt(0, 70)), "long"), RequestState(Request(prompt(1, 6)), "short")]
    states[0].prefilled = 64  # its next chunk ends at 70
    covering = WINDOWS[KEY_WINDOW].covering
    assert [engine.scheduler._window_of(variant, state, CHUNK) for state in states] == [covering(70, 128), covering(6, 128)]
    assert covering(70, 128) > covering(6, 128)
    assert not engine.scheduler._packed_prefill(states) and engine.stats["packed_rounds"] == 0
    scored = RequestState(Request(prompt(2, 6), prompt_logprobs=0), "scored")
    assert not engine.scheduler._packed_prefill([scored, states[1]])  # a scoring lead runs alone (scored prefill)
    assert not Engine(core, packed=False).scheduler.packed_variants


def test_windows_cover_every_lane(core):
    variant = core.variants[PACKED]
    lanes = [Lane(RequestState(Request(prompt(0, 30)), "a", slot=0, epoch=1), ChunkPlan(16, prompt(0, 30)[16:], True)),
             Lane(RequestState(Request(prompt(1, 5)), "b", slot=2, epoch=1), ChunkPlan(0, prompt(1, 5), True))]
    fill_inputs(variant, lanes, 0, core)
    windowed = Windowed(lambda buffers: None, variant.bindings, variant.layout["windows"])
    assert windowed.sizes(variant.buffers) == {KEY_WINDOW: WINDOWS[KEY_WINDOW].covering(30), PACKED_TOKENS: 32,
                                               SEGMENT_WINDOW: 16, SAMPLE_WINDOW: 64,  # greedy lanes: a short sorted row
                                               TRANSFORM_WINDOW: 64}  # no penalty: no transformed column
    sampling = Lane(RequestState(Request(prompt(1, 5), sampling=SamplingParams(temperature=0.7)), "c", slot=2,
                                 epoch=1), ChunkPlan(0, prompt(1, 5), True))
    fill_inputs(variant, [lanes[0], sampling], 0, core)
    sizes = windowed.sizes(variant.buffers)
    assert sizes[SAMPLE_WINDOW] == core.manifest["vocab_padded"] and sizes[TRANSFORM_WINDOW] == 64  # samples, neutral
    for penalty in ({"repetition_penalty": 1.2}, {"presence_penalty": -0.5}, {"frequency_penalty": 0.1}):
        penalized = Lane(RequestState(Request(prompt(1, 5), sampling=SamplingParams(**penalty)), "d", slot=2,
                                      epoch=1), ChunkPlan(0, prompt(1, 5), True))
        fill_inputs(variant, [lanes[0], penalized], 0, core)
        sizes = windowed.sizes(variant.buffers)  # a penalty transforms the row: all of it, even for greedy lanes
        assert (sizes[SAMPLE_WINDOW], sizes[TRANSFORM_WINDOW]) == (64, core.manifest["vocab_padded"]), penalty
    for constraints in (LaneConstraints.build(VOCAB, allowed_token_ids=[5, 250]),
                        LaneConstraints.build(VOCAB, logit_bias={"299": 1.0})):  # a bitmask, a bias: likewise
        constrained = Lane(RequestState(Request(prompt(1, 5), constraints=constraints), "e", slot=2, epoch=1),
                           ChunkPlan(0, prompt(1, 5), True))
        fill_inputs(variant, [lanes[0], constrained], 0, core)
        assert windowed.sizes(variant.buffers)[TRANSFORM_WINDOW] == core.manifest["vocab_padded"]
    fill_inputs(variant, lanes, 0, core)
    assert variant.buffers[PACKED_TOKENS][:20].tolist() == prompt(0, 30)[16:] + prompt(1, 5) + [0]
    granule = WINDOWS[KEY_WINDOW].granule  # the smallest multiple covering the positions, capped at 128
    assert replayed_extent(variant, KEY_WINDOW, 30) == granule and replayed_extent(variant, KEY_WINDOW, 127) == 128
    assert replayed_extent(variant, KEY_WINDOW, granule + 1) == 2 * granule
    with pytest.raises(RuntimeError, match="a lane takes at most 16"):
        fill_inputs(variant, [Lane(lanes[0].state, ChunkPlan(0, prompt(0, 17), True))], 0, core)
    with pytest.raises(RuntimeError, match="1 without a chunk"):
        fill_inputs(variant, [lanes[0], Lane(lanes[1].state)], 0, core)


@pytest.mark.parametrize("change,expected", [
    ({}, SLOTS), ({"capacities": (1,)}, None), ({"compile": "inductor"}, None), ({"onnx": True}, None),
    ({"tensor_parallel": 2}, None), ({"packed_prefill": False}, None), ({"recipe": "qwen3_moe"}, None),
    ({"capacities": (1, 8, 32)}, PACKED_LANES)])
def test_the_default_catalog_packs_where_it_pays(change, expected):
    options = ExportOptions(**{"recipe": "qwen3", "capacities": (1, SLOTS), **change})
    assert packed_capacity(options, FAMILIES[options.recipe]) == expected


@pytest.fixture
def packed_copy(exported, tmp_path) -> CoreCopy:
    copy = CoreCopy(tmp_path / "core")
    shutil.copytree(exported[0], copy.root)
    return copy


def _edit_variant(copy: CoreCopy, name: str, change) -> None:
    copy.edit("catalog.json", lambda catalog: change(copy.variant(catalog, name)))


def _drop(variant, argument):
    variant["arguments"] = [a for a in variant["arguments"] if a["name"] != argument]
    variant["contract"]["bindings"].pop(argument, None)


def _declare(variant, argument, dtype, shape, source):
    variant["arguments"].append({"name": argument, "dtype": dtype, "role": "input", "shape": shape})
    variant["contract"]["bindings"][argument] = source


@pytest.mark.parametrize("name,change,rules", [
    (PACKED, lambda v: _drop(v, "segment_emits"), {"PACKED-INPUTS"}),
    (PACKED, lambda v: _declare(v, "chunk_start", "int64", [1], 7), {"PACKED-INPUTS"}),
    (PACKED, lambda v: next(a for a in v["arguments"] if a["name"] == PACKED_TOKENS).update(shape=[CHUNK]),
     {"PACKED-INPUTS"}),
    ("decode.c4", lambda v: _declare(v, "segment_starts", "int64", [SLOTS], 18), {"PACKED-INPUTS"}),
    (PACKED, lambda v: v["contract"]["layout"].pop("packed"), {"PACKED-LAYOUT"}),
    (PACKED, lambda v: v["contract"]["layout"]["packed"].update(segment_rows=CHUNK // 2),
     {"PACKED-LAYOUT", "PACKED-INPUTS"}),
    ("decode.c4", lambda v: v["contract"]["layout"].update(packed={"tokens": PACKED_TOKENS, "segment_rows": CHUNK,
                                                                   "segment_window": SEGMENT_WINDOW}),
     {"PACKED-LAYOUT"}),
])
def test_validator_packed_rules(packed_copy, name, change, rules):
    _edit_variant(packed_copy, name, change)
    assert rules_of(packed_copy.root, check_graphs=False) == rules


def test_exported_packed_core_is_valid_and_lane_count_is_its_capacity(exported, core):
    assert rules_of(exported[0], check_graphs=False) == set()
    variant = core.variants[PACKED]
    assert variant.operation is Operation.PACKED_PREFILL and variant.lanes == SLOTS
    assert set(variant.layout["windows"]) == {KEY_WINDOW, PACKED_TOKENS, SEGMENT_WINDOW, SAMPLE_WINDOW,
                                              TRANSFORM_WINDOW}


def test_packed_capacity_must_fit_the_slots():
    variant = {"name": "packed.t16.c8", "capacity": 8, "arguments": [],
               "contract": {"layout": {"packed": {"tokens": PACKED_TOKENS, "segment_rows": 16,
                                                  "segment_window": SEGMENT_WINDOW}}}}
    variant["operation"] = int(Operation.PACKED_PREFILL)
    found = check_packed(variant, {"chunk_limit": 16, "model": {"num_slots": 4}}, 16)
    assert any(v.rule == "PACKED-LAYOUT" and "num_slots = 4" in v.message for v in found)


def test_packing_pays_only_when_the_padded_attention_is_small():
    """Short chunks always pack (per-round overhead dominates); long ones only when the lanes fill the variant:
    8 chunks of 256 rows in a 32-lane variant attend over 4x their rows and run serially."""
    from types import SimpleNamespace

    from ignition.runtime.scheduler import _packing_pays
    wide, narrow = SimpleNamespace(capacity=32), SimpleNamespace(capacity=8)
    assert _packing_pays(wide, [4] * 8) and _packing_pays(wide, [64] * 8) and _packing_pays(wide, [50, 3])
    assert not _packing_pays(wide, [256] * 8) and not _packing_pays(wide, [100, 7])
    assert _packing_pays(narrow, [256] * 8) and _packing_pays(narrow, [256] * 4) and not _packing_pays(narrow, [256] * 3)
    assert _packing_pays(wide, [256] * 16)  # half the lanes: padded rows 2x the chunks'
