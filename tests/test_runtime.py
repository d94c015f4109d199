"""The minimal loader against the toy core: replay, decoding, admission, slots and epochs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ignition.catalog.manifest import Features
from ignition.cli import app
from ignition.runtime.core import CoreLoadError, load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import AdmissionError, Request

TOL = 3e-5  # fp32 logits of a 32-wide matmul vs fp64 (< 1e-5) plus the FP32 reduction (< 5e-6)


@pytest.fixture(scope="module")
def core(toy_core):
    return load_core(toy_core)


@pytest.fixture(scope="module")
def oracle(toy_core):
    w = load_file(str(toy_core / "weights.safetensors"))
    logits = w["embedding.weight"].double() @ w["lm_head.weight"].double().T
    return torch.log_softmax(logits[:, :250], dim=1)  # [previous token, next token]


def greedy_chain(oracle, last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = int(oracle[last].argmax())
        out.append(last)
    return out


def test_invalid_core_is_refused(core_copy):
    core_copy.edit("manifest.json", lambda m: m.update(capacities=[2]))
    with pytest.raises(CoreLoadError, match="CATALOG-CAPACITIES"):
        load_core(core_copy.root)


def test_features_and_memory(core):
    assert core.features == {"allow_logprobs": True, "explicit_ids": True, "prompt_logprobs": False,
                             "structured_output": True} and core.k == 20
    memory = core.memory_report()
    assert memory["weights_bytes"] == 2 * 256 * 32 * 4
    assert memory["completion_frame_bytes"] == sum(2 * c * 24 * 8 + 2 * c * 8 * 258 * 4 for c in (1, 4, 1))


def test_generation_matches_oracle(core, oracle):
    (result,) = Engine(core).generate([Request([10, 20, 30], max_tokens=6, logprobs=5)])
    assert result.token_ids == greedy_chain(oracle, 30, 6)
    previous = [30] + result.token_ids[:-1]
    for prev, entry in zip(previous, result.entries):
        row = oracle[prev]
        assert abs(entry.logprob - row[entry.id].item()) < TOL
        order = sorted(range(250), key=lambda t: (-row[t].item(), t))[:5]
        assert [i for i, _ in entry.top] == order
        np.testing.assert_allclose([v for _, v in entry.top], row[order].numpy(), atol=TOL, rtol=0)


def test_explicit_ids_in_caller_order(core, oracle):
    ids = [249, 0, 17, 3]
    (result,) = Engine(core).generate([Request([5], max_tokens=3, logprob_token_ids=ids)])
    previous = [5] + result.token_ids[:-1]
    for prev, entry in zip(previous, result.entries):
        assert [i for i, _ in entry.top] == ids
        np.testing.assert_allclose([v for _, v in entry.top], oracle[prev][ids].numpy(), atol=TOL, rtol=0)


def test_concurrent_requests_get_what_they_get_alone(core):
    requests = [Request([1, 2], max_tokens=4, logprobs=3), Request([9], max_tokens=5),
                Request([4, 4, 4], max_tokens=3, logprob_token_ids=[7, 8]), Request([100], max_tokens=2, logprobs=0),
                Request([3], max_tokens=4, logprobs=20), Request([6], max_tokens=1)]
    together = Engine(core).generate(requests)
    for request, got in zip(requests, together):
        (alone,) = Engine(core).generate([request])
        assert got.token_ids == alone.token_ids
        assert [(e.id, e.logprob, e.top) for e in got.entries] == [(e.id, e.logprob, e.top) for e in alone.entries]
        assert got.finish_reason == "length" and got.error is None


def test_slots_are_reused_with_new_epochs(core):
    engine = Engine(core)
    results = engine.generate([Request([i], max_tokens=2) for i in range(11)])  # 4 slots, 11 requests
    assert all(r.finish_reason == "length" for r in results)
    assert max(engine.epochs) >= 3 and sorted(engine.free_slots) == list(range(engine.num_slots))


def test_stale_record_fails_only_its_request(core):
    engine = Engine(core)

    fired = []

    def make_stale(variant, reader, pending):
        if variant.name == "decode.c4" and not fired:
            fired.append(True)
            reader.records_host[1, 1] -= 1  # the epoch of a previous owner of the slot
    engine.decode_hook = make_stale
    results = engine.generate([Request([1], max_tokens=3), Request([2], max_tokens=3), Request([3], max_tokens=3)])
    assert results[1].finish_reason == "error" and "epoch" in results[1].error
    assert [r.finish_reason for r in (results[0], results[2])] == ["length", "length"]
    assert len(results[0].token_ids) == 3


def test_corrupted_payload_fails_only_its_request(core):
    engine = Engine(core)

    def corrupt(variant, reader, pending):
        if variant.name == "decode.c4":
            reader.payload_host[0, 0, 0] += 1  # chosen id no longer matches the emitted token
    engine.decode_hook = corrupt
    results = engine.generate([Request([1], max_tokens=3, logprobs=2), Request([2], max_tokens=3, logprobs=2)])
    assert results[0].finish_reason == "error" and "does not match emitted token" in results[0].error
    assert results[1].finish_reason == "length" and len(results[1].entries) == 3


def test_frames_without_requesting_lanes_copy_no_payload(core):
    engine = Engine(core)
    engine.generate([Request([1], max_tokens=4)])
    assert sum(r.payload_copies for r in engine.readers.values()) == 0
    engine.generate([Request([1], max_tokens=4, logprob_token_ids=list(range(30)))])
    reader = engine.readers["decode.c1"]
    assert reader.payload_copies == 3  # one per decode round; W = max(K=20, 30 selected ids) = 30
    assert reader.payload_words_copied == 3 * 1 * 8 * (2 + 2 * 30)


def test_frames_alternate(core):
    engine = Engine(core)
    frames = []
    engine.decode_hook = lambda variant, reader, pending: frames.append((variant.name, pending.frame))
    engine.generate([Request([1], max_tokens=5)])
    decode = [f for name, f in frames if name == "decode.c1"]
    assert decode == [i % 2 for i in range(len(decode))] or decode == [(i + 1) % 2 for i in range(len(decode))]


def test_forced_tokens_and_stops(core, oracle):
    (forced,) = Engine(core).generate([Request([1], max_tokens=3, logprobs=1, forced_tokens={1: 77})])
    assert forced.token_ids[1] == 77 and forced.entries[1].logprob is None and forced.entries[1].top == []
    assert forced.entries[2].logprob is not None
    assert [e.forced for e in forced.entries] == [False, True, False]  # only the forced token reads "forced"
    chain = greedy_chain(oracle, 1, 4)
    (stopped,) = Engine(core).generate([Request([1], max_tokens=8, stop_token_ids=[chain[2]])])
    assert stopped.token_ids == chain[:2] and stopped.finish_reason == "stop"


def test_eos_terminates_without_entry(core, oracle):
    chain = greedy_chain(oracle, 2, 5)
    eos_core = dataclasses.replace(core, _spec=dataclasses.replace(core.spec, eos_token_id=chain[3]))  # core unchanged
    (result,) = Engine(eos_core).generate([Request([2], max_tokens=8, logprobs=1)])
    (ignored,) = Engine(eos_core).generate([Request([2], max_tokens=5, ignore_eos=True)])
    assert result.token_ids == chain[:3] and result.finish_reason == "stop"
    assert ignored.token_ids == chain and ignored.finish_reason == "length"


@pytest.mark.parametrize("request_kwargs,message", [
    ({"logprobs": 21}, "logprobs must be between 0 and 20, got 21"),
    ({"logprobs": -1}, "logprobs must be between 0 and 20, got -1"),
    ({"logprob_token_ids": []}, "logprob_token_ids must hold 1 to 128 ids, got 0"),
    ({"logprob_token_ids": list(range(129))}, "logprob_token_ids must hold 1 to 128 ids, got 129"),
    ({"logprob_token_ids": [3, 4, 3]}, "logprob_token_ids contains duplicate id 3"),
    ({"logprob_token_ids": [3, 250]}, "logprob_token_ids id 250 is outside the vocabulary [0, 250)"),
    ({"logprob_token_ids": [3], "logprobs": 2}, "logprob_token_ids cannot be combined with logprobs > 0"),
    ({"prompt_ids": []}, "prompt must contain at least one token"),
    ({"prompt_ids": [250]}, "prompt token id 250 is outside the vocabulary [0, 250)"),
    ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
    ({"prompt_logprobs": 1}, "this core was exported without prompt scoring (--prompt-logprobs)"),
])
def test_admission_rejections(core, request_kwargs, message):
    engine = Engine(core)
    kwargs = {"prompt_ids": [1], "max_tokens": 2} | request_kwargs
    with pytest.raises(AdmissionError) as raised:
        engine.submit(Request(**kwargs))
    assert str(raised.value) == message
    assert not engine.waiting and not engine.running
    (ok,) = engine.generate([Request([1], max_tokens=2)])
    assert ok.finish_reason == "length"


def test_admission_on_cores_without_features(toy_core_no_logprobs):
    core = load_core(toy_core_no_logprobs)
    assert core.features["allow_logprobs"] is False and core.k == 0
    engine = Engine(core)
    with pytest.raises(AdmissionError, match=r"^this core was exported without logprob outputs \(allow_logprobs: false\)$"):
        engine.submit(Request([1], logprobs=0))
    features = Features(allow_logprobs=True, explicit_ids=False, prompt_logprobs=False)
    engine = Engine(dataclasses.replace(core, _spec=dataclasses.replace(core.spec, features=features, k=5)))
    with pytest.raises(AdmissionError, match=r"^this core does not support logprob_token_ids \(no explicit-ID inputs\)$"):
        engine.submit(Request([1], logprob_token_ids=[1]))
    (result,) = engine.generate([Request([1], max_tokens=3)])
    assert len(result.token_ids) == 3


def test_cli_run_json(toy_core, oracle):
    result = CliRunner().invoke(app, ["run", str(toy_core), "--prompt-ids", "4,5", "--max-tokens", "3",
                                      "--logprobs", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["prompt_ids"] == [4, 5] and out["finish_reason"] == "length"
    assert [t["id"] for t in out["tokens"]] == greedy_chain(oracle, 5, 3)
    assert all(len(t["top_logprobs"]) == 2 and set(t) == {"id", "text", "logprob", "top_logprobs"} for t in out["tokens"])
    rejected = CliRunner().invoke(app, ["run", str(toy_core), "--prompt-ids", "4", "--logprobs", "30"])
    assert rejected.exit_code == 2 and "--logprobs: logprobs must be between 0 and 20, got 30" in rejected.output
