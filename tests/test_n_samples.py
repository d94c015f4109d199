"""n > 1 and best_of (issue 26, item 3): a prompt's samples share one prefill, each decodes with its own seed.

The engine tests run a tiny Qwen3 core (a real KV cache and penalty counts to copy between slots); each
sample is compared with an ``n = 1`` request of the same effective seed. The HTTP tests run conftest's
toy servers: choices, seeds, the prefill counter of /metrics, streaming, best_of and cancellation.
"""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from _served import Served, serve_in_thread
from _serving_tokenizers import byte_level_tokenizer, write_tokenizer_dir
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import AdmissionError, Request, SamplingParams
from ignition.runtime.samples import PromptCopier, sample_ids, sample_seed
from ignition.serve.app import create_app

PROMPT = [(7 * j) % 290 + 1 for j in range(13)]  # two prompt chunks of 8
CHUNKS = 2
TOL = 2e-5  # a sample's first token comes from a decode lane, an n = 1 request's from its prefill's last row


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """A tiny Qwen3 core (4 slots, prompt chunks of 8, prompt scoring, mixed variants) with the serving tests'
    byte-level tokenizer and chat template."""
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("samples")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 300), root / "ckpt", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=8,
                              max_seq_len=64, prompt_logprobs=True, mixed=True,
                              tokenizer=write_tokenizer_dir(byte_level_tokenizer(), root / "tokenizer")), root / "core")
    return load_core(root / "core")


class DecoderServed(Served):
    """A live server on the tiny Qwen3 core, which samples (the toy cores are greedy bigrams)."""

    def __init__(self, core):
        self.app = create_app(core, model_name="tiny")  # the engine tests' loaded core: they run before these
        self.ctx, self.tokenizer = self.app.state.ctx, None
        self.table = self.ctx.table
        self.server, self.thread, self.url = serve_in_thread(self.app)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.url, timeout=120)


@pytest.fixture(scope="module")
def decoder(core):
    server = DecoderServed(core)
    yield server
    server.close()


def sampled(n: int = 1, seed: int = 5, temperature: float = 1.0, **kwargs) -> Request:
    kwargs.setdefault("max_tokens", 6)
    kwargs.setdefault("logprobs", 2)
    return Request(list(PROMPT), n=n, sampling=SamplingParams(temperature=temperature, seed=seed), **kwargs)


def alone(core, request: Request, **options):
    engine = Engine(core, mixed=False, **options)
    (result,) = engine.generate([request])
    return result, engine.stats


def assert_same_sample(got, expected, exact: bool = False) -> None:
    assert got.error is None and got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
    assert [[i for i, _ in e.top] for e in got.entries] == [[i for i, _ in e.top] for e in expected.entries]
    values = lambda result: torch.tensor([[e.logprob] + [v for _, v in e.top] for e in result.entries])  # noqa: E731
    torch.testing.assert_close(values(got), values(expected), atol=0 if exact else TOL, rtol=0)


# -- the engine ---------------------------------------------------------------------------------------
def test_samples_share_one_prefill_and_each_is_its_seeds_own_run(core):
    engine = Engine(core, mixed=False)
    results = engine.generate([sampled(n=4)])
    assert [r.request_id for r in results] == sample_ids("req-0", 4) == ["0_req-0", "1_req-0", "2_req-0", "3_req-0"]
    assert (engine.stats["prefill_chunks"], engine.stats["prompt_tokens_prefilled"], engine.stats["prompt_copies"]) \
        == (CHUNKS, len(PROMPT), 3)
    for index, result in enumerate(results):  # vLLM v1: sample i of a seeded request has seed + i
        expected, stats = alone(core, sampled(seed=5 + index))
        assert stats["prefill_chunks"] == CHUNKS
        assert_same_sample(result, expected)
    assert len({tuple(r.token_ids) for r in results}) == 4  # temperature 1: four different samples
    again = Engine(core, mixed=False).generate([sampled(n=4)])
    assert [(r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries]) for r in again] == \
        [(r.token_ids, [(e.id, e.logprob, e.top) for e in r.entries]) for r in results]  # bit for bit


def test_greedy_samples_are_identical(core):
    first, second = Engine(core, mixed=False).generate([sampled(n=2, temperature=0.0, seed=None)])
    assert first.token_ids == second.token_ids and first.finish_reason == second.finish_reason == "length"
    assert_same_sample(second, first)
    expected, _ = alone(core, sampled(temperature=0.0, seed=None))
    assert_same_sample(first, expected)


def test_sample_seeds(core):
    assert sample_seed(2**63 - 1, 1) == -2**63 and sample_seed(-3, 2) == -1  # seed + index, wrapped into int64
    assert sample_seed(None, 3) is None  # an unseeded sample draws from its own request id (bindings._seed)
    unseeded = Engine(core, mixed=False).generate([sampled(n=3, seed=None)])
    assert len({tuple(r.token_ids) for r in unseeded}) == 3


def test_prompt_scores_are_computed_once_and_reported_by_every_sample(core):
    engine = Engine(core, mixed=False)
    results = engine.generate([sampled(n=3, max_tokens=2, prompt_logprobs=2)])
    expected, stats = alone(core, sampled(max_tokens=2, prompt_logprobs=2))
    assert engine.stats["prefill_chunks"] == stats["prefill_chunks"] >= 1
    assert engine.stats["prompt_tokens_prefilled"] == len(PROMPT)
    for result in results:
        assert result.prompt_entries == expected.prompt_entries and len(result.prompt_entries) == len(PROMPT)
    invariant = Engine(core, batch_invariant=True, mixed=False).generate([sampled(n=3, prompt_logprobs=2)])[0]
    assert_same_sample(invariant, alone(core, sampled(prompt_logprobs=2), batch_invariant=True)[0], exact=True)
    scored_only = Engine(core, mixed=False).generate([sampled(n=2, max_tokens=0, prompt_logprobs=1)])
    assert [(r.token_ids, r.finish_reason, len(r.prompt_entries)) for r in scored_only] == [([], "length", 13)] * 2


def test_a_group_waits_for_a_slot_per_sample_first_come_first_served(core):
    engine = Engine(core, mixed=False)
    first = engine.submit(Request([3, 4, 5], max_tokens=5, request_id="first"))
    group = engine.submit(sampled(n=4, request_id="group"))
    later = engine.submit(Request([6, 7], max_tokens=2, request_id="later"))
    while engine.state(first).finish_reason is None:
        engine.step()
        held = {s.request_id for s in engine.running}
        assert held <= {first} or held == set(engine.samples(group))  # never part of the group, never overtaken
    while engine.step():  # "later" takes the slot of the first sample to finish, never one the group waits for
        if "later" in {s.request_id for s in engine.running}:
            assert any(engine.state(sample).done for sample in sample_ids(group, 4))
    for index, sample in enumerate(sample_ids(group, 4)):
        assert_same_sample(engine.result(sample), alone(core, sampled(seed=5 + index))[0])
    assert engine.result(later).token_ids == alone(core, Request([6, 7], max_tokens=2))[0].token_ids
    assert engine.stats["prompt_copies"] == 3
    with pytest.raises(AdmissionError, match="n = 5 samples .* this core has 4 slots") as refused:
        engine.submit(sampled(n=5))
    assert refused.value.param == "n"


def test_mixed_rounds_share_the_prompt_too(core):
    engine = Engine(core)  # mixed variants: the leader's chunks ride with a decoding request
    engine.submit(Request([9, 8], max_tokens=12, request_id="decoding"))
    engine.step()
    group = engine.submit(sampled(n=3))
    engine.run()
    assert engine.stats["mixed_rounds"] >= CHUNKS and engine.stats["prompt_copies"] == 2
    for index, sample in enumerate(sample_ids(group, 3)):
        assert_same_sample(engine.result(sample), alone(core, sampled(seed=5 + index))[0])


def test_cancelling_a_group_frees_every_slot(core):
    for steps in (1, 4):  # during the leader's prompt (siblings wait for its state), then while all decode
        engine = Engine(core, mixed=False)
        group = engine.submit(sampled(n=4, max_tokens=20))
        for _ in range(steps):
            engine.step()
        assert len(engine.free_slots) == 0
        engine.cancel(group)
        engine.run()
        assert [engine.result(s).finish_reason for s in sample_ids(group, 4)] == ["abort"] * 4
        assert sorted(engine.free_slots) == [0, 1, 2, 3] and not engine.running and not engine.retiring
        assert not engine.groups


def test_a_leader_cancelled_mid_prompt_hands_the_prompt_over(core):
    engine = Engine(core, mixed=False)
    group = engine.submit(sampled(n=3))
    engine.step()  # the leader's first chunk
    leader, *others = sample_ids(group, 3)
    engine.cancel(leader)
    engine.run()
    assert engine.result(leader).finish_reason == "abort"
    assert engine.stats["prefill_chunks"] == 1 + CHUNKS and engine.stats["prompt_copies"] == 1
    for index, sample in enumerate(others, 1):
        assert_same_sample(engine.result(sample), alone(core, sampled(seed=5 + index))[0])


def test_prompt_copier_copies_the_prompt_rows_of_one_slot():
    class Core:  # the loaded core's state, as load_core allocates it: the pools (GQA's, MLA's) and the counts
        group = None
        state = {"latent_cache": torch.randn(2, 9, 4, 3), "penalty_counts": torch.randint(0, 9, (4, 2, 7)),
                 "k_cache": torch.randn(2, 9, 4, 2, 3)}

    before = {name: tensor.clone() for name, tensor in Core.state.items()}
    assert PromptCopier(Core).shared
    PromptCopier(Core).copy(1, 3, 5)
    counts = Core.state["penalty_counts"]
    assert torch.equal(counts[3, 0], counts[1, 0]) and not counts[3, 1].any()
    for slot in (0, 1, 2):
        assert torch.equal(counts[slot], before["penalty_counts"][slot])
    for name in ("k_cache", "latent_cache"):  # a pool's blocks are shared (BlockManager.fork)
        assert torch.equal(Core.state[name], before[name])
    Core.state = {"conv_state": torch.zeros(1, 4, 8, 3), "penalty_counts": torch.zeros(4, 2, 7)}
    assert not PromptCopier(Core).shared  # a per-slot state: each sample prefills its own prompt
    Core.state = {"unknown_state": torch.zeros(4, 3)}
    assert not PromptCopier(Core).shared  # each sample then prefills its own prompt


# -- the server ---------------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def counters(served) -> dict[str, float]:
    text = served.http.get("/metrics").text
    return {name: float(value) for name, value in
            re.findall(r'^ignition:(\w+_total)\{model_name="\w+"\} (\S+)$', text, re.MULTILINE)}


def close_choices(got: dict, expected: dict) -> None:
    """Equal choices, logprob values within TOL (a sample's first token comes from a decode lane)."""
    np.testing.assert_allclose(got["logprobs"]["token_logprobs"], expected["logprobs"]["token_logprobs"], atol=TOL,
                               rtol=0)

    def strip(choice: dict) -> dict:  # the token names of top_logprobs, without their values
        logprobs = choice["logprobs"]
        return {**choice, "logprobs": {**logprobs, "token_logprobs": None,
                                       "top_logprobs": [list(top) for top in logprobs["top_logprobs"]]}}
    assert strip(got) == strip(expected)


def test_n_choices_seeded_and_prefilled_once(decoder):
    ids = list(range(30, 41))
    body = {"prompt": ids, "max_tokens": 8, "n": 4, "temperature": 1.0, "seed": 11, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True}
    before = counters(decoder)
    response = decoder.post(CMPL, body).json()
    after = counters(decoder)
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert after["prompt_tokens_prefilled_total"] - before["prompt_tokens_prefilled_total"] == len(ids)
    assert after["prefill_chunks_total"] - before["prefill_chunks_total"] == CHUNKS
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 4 * len(ids)  # per sample, as vLLM
    assert response["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 32, "total_tokens": len(ids) + 32}
    assert len({tuple(c["token_ids"]) for c in choices}) == 4  # temperature 1, one seed per sample
    assert decoder.post(CMPL, body).json()["choices"] == choices  # seeded: reproduced exactly
    for index, choice in enumerate(choices):  # sample i is the n = 1 request with seed + i
        single = decoder.post(CMPL, {**body, "n": 1, "seed": 11 + index}).json()["choices"][0]
        close_choices({**single, "index": index}, choice)
    decoder.wait_idle()


def test_greedy_n_gives_identical_choices_and_batches_index_by_prompt(served):
    response = served.post(CMPL, {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 4, "n": 2, "logprobs": 2}).json()
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    assert choices[0]["logprobs"] == choices[1]["logprobs"] and choices[2]["logprobs"] == choices[3]["logprobs"]
    single = served.post(CMPL, {"prompt": [7, 8, 9], "max_tokens": 4, "logprobs": 2}).json()["choices"][0]
    assert {**single, "index": 3} == choices[3]
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}


def test_streamed_samples_reassemble_to_the_full_response(decoder):
    body = {"prompt": "hello", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 1,
            "echo": True, "return_token_ids": True, "ignore_eos": True}
    full = decoder.post(CMPL, body).json()
    chunks = decoder.sse(CMPL, {**body, "stream": True, "stream_options": {"include_usage": True}})
    merged = {0: {"text": "", "tokens": [], "token_logprobs": [], "token_ids": []},
              1: {"text": "", "tokens": [], "token_logprobs": [], "token_ids": []}}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        part = merged[choice["index"]]
        part["text"] += choice["text"]
        part["tokens"] += choice["logprobs"]["tokens"]
        part["token_logprobs"] += choice["logprobs"]["token_logprobs"]
        part["token_ids"] += choice["token_ids"]
    for index, choice in enumerate(full["choices"]):
        assert merged[index]["text"] == choice["text"] and choice["text"].startswith("hello")
        assert merged[index]["tokens"] == choice["logprobs"]["tokens"]
        assert merged[index]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
        assert merged[index]["token_ids"] == choice["token_ids"]
    assert chunks[-1]["usage"] == full["usage"]


def test_chat_n_streams_each_choice_with_its_index(decoder):
    body = {"messages": USER, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 9, "logprobs": True,
            "top_logprobs": 1, "ignore_eos": True}
    full = decoder.post(CHAT, body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    prompt = full["usage"]["prompt_tokens"]
    assert full["usage"] == {"prompt_tokens": prompt, "completion_tokens": 15, "total_tokens": prompt + 15}
    chunks = decoder.sse(CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]  # every role chunk first, as vLLM
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:3])
    content = {0: "", 1: "", 2: ""}
    entries = {0: [], 1: [], 2: []}
    for chunk in chunks[3:-1]:
        (choice,) = chunk["choices"]
        content[choice["index"]] += choice["delta"]["content"]
        entries[choice["index"]] += choice["logprobs"]["content"]
    for index, choice in enumerate(full["choices"]):
        assert content[index] == choice["message"]["content"] and entries[index] == choice["logprobs"]["content"]
    assert chunks[-1]["usage"] == full["usage"]
    assert len({c["message"]["content"] for c in full["choices"]}) == 3
    sdk = decoder.client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, n=3, temperature=1.0,
                                                 seed=9, extra_body={"ignore_eos": True})
    assert [c.message.content for c in sdk.choices] == [c["message"]["content"] for c in full["choices"]]


def test_best_of_returns_the_best_by_cumulative_logprob(decoder):
    body = {"prompt": [40, 41], "max_tokens": 6, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    drawn = decoder.post(CMPL, {**body, "n": 3, "logprobs": 0}).json()["choices"]
    total = [sum(c["logprobs"]["token_logprobs"]) for c in drawn]
    assert len(set(total)) == 3
    ranked = sorted(range(3), key=lambda i: -total[i])
    best = decoder.post(CMPL, {**body, "n": 2, "best_of": 3}).json()
    assert [c["text"] for c in best["choices"]] == [drawn[i]["text"] for i in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 12  # the returned choices' tokens, as vLLM V0 counts them
    chat = decoder.post(CHAT, {"messages": USER, "max_tokens": 4, "temperature": 1.0, "seed": 2, "best_of": 3,
                               "ignore_eos": True, "return_token_ids": True}).json()
    chat_drawn = decoder.post(CHAT, {"messages": USER, "max_tokens": 4, "temperature": 1.0, "seed": 2, "n": 3,
                                     "logprobs": True, "ignore_eos": True, "return_token_ids": True}).json()["choices"]
    sums = [sum(e["logprob"] for e in c["logprobs"]["content"]) for c in chat_drawn]
    assert len(set(sums)) == 3
    assert chat["choices"][0]["token_ids"] == chat_drawn[int(np.argmax(sums))]["token_ids"]
    decoder.wait_idle()


@pytest.mark.parametrize("path,body,param,message", [
    (CMPL, {"prompt": [1], "n": 0}, "n", "n must be at least 1, got 0"),
    (CMPL, {"prompt": [1], "n": 5}, "n", "n = 5 is more than this core's 4 slots"),
    (CHAT, {"messages": USER, "n": 2, "best_of": 9, "temperature": 1}, "best_of",
     "best_of = 9 is more than this core's 4"),
    (CMPL, {"prompt": [1], "n": 2, "best_of": 1}, "best_of", "greater than or equal to n, got n=2 and best_of=1"),
    (CMPL, {"prompt": [1], "best_of": 2, "temperature": 1, "stream": True}, "best_of",
     "must equal n (1) when streaming"),
    (CMPL, {"prompt": [1], "best_of": 2}, "best_of", "must equal n (1) with greedy sampling"),
    ("/v1/responses", {"input": "hi", "n": 2}, "n", "`n` = 2 is not supported by this endpoint"),
])
def test_sample_counts_are_checked(served, path, body, param, message):
    response = served.post(path, body)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param) and message in error["message"], error


def test_best_of_needs_logprob_outputs(served_plain):
    response = served_plain.post(CMPL, {"prompt": [1], "best_of": 2, "temperature": 1})
    assert response.status_code == 400 and "without logprob outputs" in response.json()["error"]["message"]
    assert len(served_plain.post(CMPL, {"prompt": [1], "n": 2}).json()["choices"]) == 2


def test_prompt_logprobs_are_scored_once_and_on_every_choice(decoder):
    before = counters(decoder)
    response = decoder.post(CMPL, {"prompt": [11, 12, 13, 14], "max_tokens": 2, "n": 3, "prompt_logprobs": 1}).json()
    after = counters(decoder)
    assert after["prefill_chunks_total"] - before["prefill_chunks_total"] == 1
    single = decoder.post(CMPL, {"prompt": [11, 12, 13, 14], "max_tokens": 2, "prompt_logprobs": 1}).json()
    scores = single["choices"][0]["prompt_logprobs"]
    assert len(scores) == 4 and [c["prompt_logprobs"] for c in response["choices"]] == [scores] * 3
    chat = decoder.post(CHAT, {"messages": USER, "max_tokens": 2, "n": 2, "prompt_logprobs": 0}).json()
    assert len(chat["choices"]) == 2 and chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_a_disconnected_group_frees_every_slot(served):
    body = {"prompt": [1, 2], "max_tokens": 2000, "n": 4, "temperature": 1.0, "ignore_eos": True, "stream": True}
    with served.http.stream("POST", CMPL, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"][0]["index"] in range(4)
                break
    served.wait_idle(timeout=30)
    assert served.post(CMPL, {"prompt": [1], "max_tokens": 1}).status_code == 200
