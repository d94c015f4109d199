"""Structured output and the sampling controls end to end (issue 26, items 1 and 4): HTTP API -> grammar -> scheduler.

A tiny random Qwen3 core (vocabulary 320) with ``_grammar_cases``' byte-level BPE (all 256 bytes, JSON pieces,
EOS 300) is served; the openai client sends ``response_format``, ``structured_outputs`` (and vLLM's deprecated
``guided_*`` aliases), ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_tokens``. A random model under
a grammar emits only what the grammar allows, so every output that ends ``stop`` parses and validates with
``jsonschema``; the 20+ schema test adds a logit bias against whitespace and towards closing punctuation (itself a
sampling control under test) so a random model also *ends* its documents within ``max_tokens``. Reported logprobs
are compared with the unconstrained model's: the same position's explicit-id logprob of an unconstrained run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from _grammar_cases import SCHEMAS, byte_level_bpe, token_pieces
from _served import serve_in_thread
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.constraints import LaneConstraints
from ignition.runtime.core import load_core
from ignition.runtime.drafters import Proposer
from ignition.runtime.engine import Engine
from ignition.runtime.grammar import GrammarCompiler
from ignition.runtime.grammar_spec import grammar_spec
from ignition.runtime.requests import Request, SamplingParams
from ignition.serve.app import create_app

REGULAR, VOCAB = 300, 320  # tokenizer ids 0..302 (EOS 300), model vocabulary 320
EOS = REGULAR
TOL = 2e-5  # test_n_samples': a decode lane's logprob against another run's prefill row of the same position
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "answer in JSON"}]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("structured")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, VOCAB, max_position_embeddings=256), root / "ckpt",
                    reload=False)
    config = json.loads((root / "ckpt" / "config.json").read_text())
    (root / "ckpt" / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    text, eos = byte_level_bpe(REGULAR)
    assert eos == EOS
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(text)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None,
                                                                 "chat_template": TEMPLATE}))
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 4), chunk_limit=16,
                              max_seq_len=256, mixed=True, tokenizer=tokenizer), root / "core")
    return root / "core"


class Server:
    def __init__(self, core_dir):
        self.app = create_app(core_dir, model_name="tiny")
        self.ctx = self.app.state.ctx
        self.server, self.thread, self.url = serve_in_thread(self.app)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.pieces = token_pieces(self.ctx.tokenizer.to_str())

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.post(path, json=body)

    def close(self):
        self.client.close()
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(core):
    served = Server(core)
    yield served
    served.close()


def ids_of(pieces: dict[int, bytes], predicate) -> list[int]:
    return sorted(t for t, piece in pieces.items() if piece and predicate(piece))


def ending_bias(pieces: dict[int, bytes]) -> dict[str, float]:
    """Whitespace tokens -100, tokens of closing punctuation (quotes, brackets, commas) +6, EOS +6: a random model
    then ends its documents; the grammar alone decides what is valid."""
    bias = {str(t): -100.0 for t in ids_of(pieces, lambda p: any(c in b" \t\r\n" for c in p))}
    bias |= {str(t): 6.0 for t in ids_of(pieces, lambda p: all(c in b'"}],' for c in p))}
    return bias | {str(EOS): 6.0}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def assert_error(response: httpx.Response, param: str, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


# -- response_format: every schema's output parses and validates -----------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(server, name):
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    bias = ending_bias(server.pieces)
    for seed in (1, 2):
        response = server.client.chat.completions.create(
            model="tiny", messages=USER, response_format=schema_format(schema), max_tokens=200, temperature=1.0,
            seed=seed, logit_bias=bias, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        instance = json.loads(choice.message.content)
        assert not [e.message for e in validator.iter_errors(instance)], (name, choice.message.content)
        token_ids = choice.model_extra["token_ids"]
        # the EOS the complete grammar forces is counted and listed, as vLLM samples and counts it
        assert token_ids[-1] == EOS and EOS not in token_ids[:-1]
        assert response.usage.completion_tokens == len(token_ids)
        assert b"".join(server.pieces[t] for t in token_ids[:-1]).decode() == choice.message.content


def test_unbiased_random_model_emits_only_valid_json(server):
    """No bias: whatever ends with ``stop`` validates; a document cut by max_tokens is a prefix the grammar allowed."""
    stopped = 0
    for name in ("flat_required", "integer_range", "string_pattern", "const", "mixed_enum", "recursive_tree"):
        schema = SCHEMAS[name]
        for temperature in (0.0, 1.0):
            response = server.client.completions.create(
                model="tiny", prompt="json:", max_tokens=120, temperature=temperature, seed=7,
                extra_body={"response_format": schema_format(schema)})
            choice = response.choices[0]
            if choice.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(choice.text), schema)
    assert stopped >= 6


def test_logprobs_are_the_unconstrained_models(server, core):
    """Each emitted token's reported logprob is the raw model's at that position: the explicit-id logprob of the
    same token in an unconstrained run over the same context (the grammar shapes sampling only)."""
    schema = SCHEMAS["nested_objects"]
    body = {"prompt": "data:", "max_tokens": 60, "logprobs": 0, "return_token_ids": True,
            "response_format": schema_format(schema), "logit_bias": ending_bias(server.pieces)}
    got = server.post(CMPL, body).json()
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)
    prompt, generated = choice["prompt_token_ids"], choice["token_ids"][:-1]
    reported = choice["logprobs"]["token_logprobs"]
    assert len(reported) == len(generated) > 10
    engine = Engine(load_core(core))
    requests = [Request(prompt + generated[:i], max_tokens=1, logprobs=0, logprob_token_ids=[token])
                for i, token in enumerate(generated)]
    free_argmax_differs = 0
    for i, result in enumerate(engine.generate(requests)):
        (entry,) = result.entries
        (selected_id, raw), = [pair for pair in entry.top if pair[0] == generated[i]]
        assert abs(reported[i] - raw) <= TOL, (i, reported[i], raw)
        free_argmax_differs += entry.id != generated[i]
    assert free_argmax_differs > 0  # the grammar did move sampling away from the unconstrained choice


# -- structured_outputs: choice, regex, grammar; the deprecated aliases ---------------------------------
def test_choice_regex_and_grammar(server):
    choices = ["yes", "no", "maybe not"]
    for seed in range(4):
        out = server.post(CMPL, {"prompt": "q", "max_tokens": 20, "temperature": 1.0, "seed": seed,
                                 "structured_outputs": {"choice": choices}}).json()["choices"][0]
        assert out["text"] in choices and out["finish_reason"] == "stop"
    pattern = r"[A-Z]{2}-[0-9]{3}"
    out = server.post(CMPL, {"prompt": "code", "max_tokens": 20, "structured_outputs": {"regex": pattern}}).json()
    assert re.fullmatch(pattern, out["choices"][0]["text"]) and out["choices"][0]["finish_reason"] == "stop"
    lark = 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]/'
    out = server.post(CHAT, {"messages": USER, "max_tokens": 20, "structured_outputs": {"grammar": lark}}).json()
    assert re.fullmatch(r"\([0-9](,[0-9])?\)", out["choices"][0]["message"]["content"])


def test_guided_aliases_are_read_with_one_deprecation_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="ignition.serve"):
        for _ in range(2):
            out = server.post(CMPL, {"prompt": "q", "max_tokens": 10, "guided_choice": ["up", "down"]}).json()
            assert out["choices"][0]["text"] in ("up", "down")
    warned = [r.getMessage() for r in caplog.records if "guided_choice" in r.getMessage()]
    assert len(warned) <= 1 and all("deprecated" in w for w in warned)
    out = server.post(CHAT, {"messages": USER, "max_tokens": 10, "guided_regex": "[0-9]{4}"}).json()
    assert re.fullmatch("[0-9]{4}", out["choices"][0]["message"]["content"])
    assert_error(server.post(CMPL, {"prompt": "q", "guided_json": {"not": {"type": "string"}}}), "guided_json", "not")
    assert_error(server.post(CMPL, {"prompt": "q", "guided_regex": "a", "structured_outputs": {"regex": "b"}}),
                 "guided_regex", "deprecated alias")


def test_text_and_json_object_formats(server):
    free = server.post(CHAT, {"messages": USER, "max_tokens": 8, "return_token_ids": True}).json()
    text = server.post(CHAT, {"messages": USER, "max_tokens": 8, "return_token_ids": True,
                              "response_format": {"type": "text"}}).json()
    assert text["choices"][0]["token_ids"] == free["choices"][0]["token_ids"]  # text: no constraint at all
    out = server.post(CHAT, {"messages": USER, "max_tokens": 120, "temperature": 1.0, "seed": 3,
                             "logit_bias": ending_bias(server.pieces),
                             "response_format": {"type": "json_object"}}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["message"]["content"]), dict)


def test_streaming_with_response_format(server):
    schema = SCHEMAS["object_array_bounds"]
    stream = server.client.chat.completions.create(
        model="tiny", messages=USER, response_format=schema_format(schema), max_tokens=150, temperature=1.0, seed=4,
        logit_bias=ending_bias(server.pieces), stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)
    full = server.client.chat.completions.create(
        model="tiny", messages=USER, response_format=schema_format(schema), max_tokens=150, temperature=1.0, seed=4,
        logit_bias=ending_bias(server.pieces))
    assert full.choices[0].message.content == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_samples_and_responses_text_format(server):
    schema = SCHEMAS["integer_range"]
    out = server.post(CHAT, {"messages": USER, "n": 3, "max_tokens": 80, "temperature": 1.0, "seed": 9,
                             "logit_bias": ending_bias(server.pieces), "response_format": schema_format(schema)}).json()
    assert len(out["choices"]) == 3
    for choice in out["choices"]:  # each sample its own grammar position
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    response = server.client.responses.create(
        model="tiny", input="json", max_output_tokens=80, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        extra_body={"seed": 2, "logit_bias": ending_bias(server.pieces)})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert_error(server.post("/v1/responses", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "o", "schema": {"not": {"type": "string"}}}}}), "text.format", "not")
    assert_error(server.post("/v1/responses", {"input": "x", "text": {"format": {"type": "yaml"}}}), "text.format")


# -- the sampling controls ---------------------------------------------------------------------------------
def greedy_ids(server, **extra) -> list[int]:
    out = server.post(CMPL, {"prompt": "hello", "max_tokens": 8, "return_token_ids": True, **extra}).json()
    assert "choices" in out, out
    return out["choices"][0]["token_ids"]


def test_logit_bias_changes_greedy_output(server):
    free = greedy_ids(server)
    target = next(t for t in range(40, 90) if t != free[0])
    assert greedy_ids(server, logit_bias={str(target): 100})[0] == target
    assert greedy_ids(server, logit_bias={str(free[0]): -100})[0] != free[0]
    assert greedy_ids(server, logit_bias={str(target): 1e-6}) == free  # a negligible bias keeps the argmax


def test_allowed_token_ids_restrict(server):
    free = greedy_ids(server, max_tokens=12)
    allowed = [t for t in range(97, 123) if t not in free[:3]]  # the single letters the free run did not start with
    ids = greedy_ids(server, max_tokens=12, allowed_token_ids=allowed)
    assert len(ids) == 12 and set(ids) <= set(allowed)


def test_min_tokens_delays_eos(server):
    eager = {"logit_bias": {str(EOS): 100}}  # EOS is the greedy choice at once
    assert greedy_ids(server, **eager) == [EOS]
    ids = greedy_ids(server, min_tokens=5, **eager)
    assert len(ids) == 6 and ids[-1] == EOS and EOS not in ids[:5]
    chat = server.post(CHAT, {"messages": USER, "max_tokens": 9, "min_tokens": 3, **eager}).json()
    assert chat["usage"]["completion_tokens"] == 4 and chat["choices"][0]["finish_reason"] == "stop"


def test_bad_words_never_appear(server):
    free = greedy_ids(server, max_tokens=16)
    encode = server.ctx.tokenizer.encode
    word = next(server.pieces[t].decode() for t in free
                if server.pieces[t].strip() and encode(server.pieces[t].decode(), add_special_tokens=False).ids == [t])
    banned = encode(word, add_special_tokens=False).ids[0]
    ids = greedy_ids(server, max_tokens=16, bad_words=[word])
    assert banned not in ids and ids != free


# -- 400s --------------------------------------------------------------------------------------------------
def _nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("extra,param,fragments", [
    # issue 50, finding 7: llguidance's recursion error was a 500
    ({"response_format": schema_format(_nested(200))}, "response_format", ["recursion limit", "128 levels"]),
    ({"structured_outputs": {"json": _nested(200)}}, "structured_outputs.json", ["128 levels"]),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format", ["uniqueItems"]),
    ({"response_format": schema_format({"not": {"type": "string"}})}, "response_format", ["not"]),
    ({"response_format": {"type": "yaml"}}, "response_format", ["json_object"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["schema"]),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", []),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["one kind"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty"]),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", []),
    ({"structural_tag": "{}"}, "structural_tag", ["structural tags"]),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", ["outside the vocabulary"]),
    ({"logit_bias": {"x": 1}}, "logit_bias", ["not a token id"]),
    ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias", ["301 entries", "300"]),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", ["outside the vocabulary"]),
    ({"allowed_token_ids": []}, "allowed_token_ids", ["at least one"]),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", ["must not exceed max_tokens"]),
    ({"min_tokens": -1}, "min_tokens", ["non-negative"]),
    ({"bad_words": ["ok", ""]}, "bad_words", ["no tokens"]),
    ({"allowed_token_ids": [EOS], "min_tokens": 2}, "allowed_token_ids", ["min_tokens"]),
])
def test_bad_requests_name_the_field(server, extra, param, fragments):
    path = CHAT if "structural_tag" in extra else CMPL
    base = {"messages": USER} if path == CHAT else {"prompt": "q"}
    assert_error(server.post(path, {**base, "max_tokens": 4, **extra}), param, *fragments)
    server.ctx.engine.load()  # nothing was admitted
    assert server.ctx.engine.load()["tracked"] == 0


def test_a_core_without_the_feature_refuses_with_the_export_command(tmp_path):
    export_core(ExportOptions(recipe="toy", capacities=(1,), structured_output=False), tmp_path / "old")
    app = create_app(tmp_path / "old", model_name="old")
    served, thread, url = serve_in_thread(app)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post(CMPL, json={"prompt": [1], "max_tokens": 2}).status_code == 200
            for extra, param in (({"logit_bias": {"3": 1}}, "logit_bias"), ({"min_tokens": 1}, "min_tokens"),
                                 ({"response_format": schema_format({"type": "object"})}, "response_format")):
                assert_error(http.post(CMPL, json={"prompt": [1], "max_tokens": 2, **extra}), param,
                             "features.structured_output", "ignition export-core")
            assert http.get("/v1/models").json()["data"][0]["features"]["structured_output"] is False
    finally:
        served.should_exit = True
        thread.join(timeout=10)


# -- the engine: a failing lane fails only its request; no verify round for a constrained one ---------------
def test_a_conflict_fails_only_its_request(core):
    engine = Engine(load_core(core))
    text = engine.core.path / "tokenizer" / "tokenizer.json"
    compiler = GrammarCompiler(text.read_text(), engine.core.manifest["vocab_padded"], EOS)
    matcher = compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"choice": ["ab"]})))
    pieces = token_pieces(text.read_text())
    letter_b = next(t for t, p in pieces.items() if p == b"b")
    conflicting = LaneConstraints.build(VOCAB, allowed_token_ids=[letter_b], grammar=matcher)  # "ab" needs "a" first
    plain = Request([5, 6, 7], max_tokens=4)
    bad = Request([5, 6, 7], max_tokens=4, constraints=conflicting)
    ok_first, failed, ok_after = engine.generate([plain, bad, Request([8, 9], max_tokens=4)])
    assert failed.finish_reason == "error" and "no token is allowed" in failed.error
    assert ok_first.error is None and len(ok_first.token_ids) == 4 and len(ok_after.token_ids) == 4


def test_constrained_requests_never_ride_verify_rounds(core):
    engine = Engine(load_core(core))  # a stand-in drafter that records what it is asked (this core has no verify)

    class Drafter:
        def __init__(self):
            self.asks = []

        def propose(self, asks):
            self.asks.append(asks)
            return [[] for _ in asks]  # no proposals: every round stays an ordinary decode round

        def release(self, request_id):
            pass

    drafter = Drafter()
    engine.scheduler.proposer = Proposer(drafter, 2, [])
    compiler = GrammarCompiler((engine.core.path / "tokenizer" / "tokenizer.json").read_text(),
                               engine.core.manifest["vocab_padded"], EOS)
    matcher = compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"regex": "[a-c]{6}"})))
    constrained = Request([1, 2, 3], max_tokens=8, constraints=LaneConstraints.build(VOCAB, grammar=matcher),
                          request_id="masked", sampling=SamplingParams())
    free = Request([1, 2, 3], max_tokens=8, request_id="free")
    masked, unmasked = engine.generate([constrained, free])
    limits: dict[str, list[int]] = {}
    for round_asks in drafter.asks:
        for request_id, _, limit in round_asks:
            limits.setdefault(request_id, []).append(limit)
    assert set(limits["masked"]) == {0} and max(limits["free"]) == 2  # no proposal is ever asked for "masked"
    text = b"".join(token_pieces((engine.core.path / "tokenizer" / "tokenizer.json").read_text())[t]
                    for t in masked.token_ids)
    assert re.fullmatch(rb"[a-c]{6}", text) and masked.finish_reason == "stop" and unmasked.error is None


def test_langchain_with_structured_output_json_schema(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=6)
        value: int = Field(ge=0, le=99)
        ok: bool

    model = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="none", max_tokens=80, temperature=1.0,
                       seed=5, max_retries=0, logit_bias={int(k): v for k, v in ending_bias(server.pieces).items()})
    reading = model.with_structured_output(Reading, method="json_schema").invoke("read the sensor")
    assert isinstance(reading, Reading) and 0 <= reading.value <= 99 and len(reading.sensor) <= 6


def test_a_grammar_the_tokenizer_cannot_follow_is_a_400(served):
    """conftest's toy server: its trained tokenizer has no token for byte 0xC2, which U+0092 needs. llguidance's
    mask still lets a later byte through and its matcher then refuses it: the request fails as a client error
    naming the field (a 400, or an error event when streaming), never a 500."""
    body = {"prompt": [1, 2, 3], "max_tokens": 6, "structured_outputs": {"regex": "\u00c4\u0092x"}}
    assert_error(served.post(CMPL, body), "structured_outputs.regex", "not allowed by the regex constraint")
    events = served.sse(CMPL, {**body, "stream": True})
    assert events[-1]["error"]["param"] == "structured_outputs.regex" and events[-1]["error"]["code"] == 400
    served.wait_idle()


@contextlib.contextmanager
def hermes_server(core_dir, **config):
    """A second server over the same core that reads hermes tool calls; yields its URL."""
    from ignition.serve.config import ServeConfig

    uvicorn_server, thread, url = serve_in_thread(create_app(core_dir, model_name="tiny",
                                                             config=ServeConfig(tool_call_parser="hermes", **config)))
    try:
        yield url
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=10)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_and_named_are_enforced(core, server, choice):
    """The grammar of the hermes parser around the tool's JSON Schema constrains a random model: its output is a
    parsed call of the tool whose arguments validate (the same model answers in prose without it)."""
    with hermes_server(core) as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL],
                "tool_choice": choice, "max_tokens": 120, "temperature": 0, "logit_bias": ending_bias(server.pieces)}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out = response.json()["choices"][0]
        assert out["finish_reason"] == ("tool_calls" if choice == "required" else "stop"), out
        calls = out["message"]["tool_calls"]
        assert calls and all(call["function"]["name"] == "get_weather" for call in calls), out
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_langchain_with_structured_output_function_calling(core, server):
    """LangChain's function-calling mode binds the schema as a tool with a named tool_choice: the grammar enforces
    the call and the hermes parser returns it, so the object LangChain parses is schema-valid."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=6)
        value: int = Field(ge=0, le=99)
        ok: bool

    with hermes_server(core) as url:
        model = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="none", max_tokens=80, temperature=1.0,
                           seed=5, max_retries=0, logit_bias={int(k): v for k, v in ending_bias(server.pieces).items()})
        reading = model.with_structured_output(Reading, method="function_calling").invoke("read the sensor")
        assert isinstance(reading, Reading) and 0 <= reading.value <= 99 and len(reading.sensor) <= 6


# -- whitespace settings (issue 50, finding 9) ------------------------------------------------------------
def whitespace_bias(pieces: dict[int, bytes]) -> dict[str, float]:
    """Whitespace tokens +8 (a small model padding its JSON), closing punctuation and EOS +6."""
    bias = {str(t): 8.0 for t in ids_of(pieces, lambda p: any(c in b" \t\r\n" for c in p))}
    return bias | {str(t): 6.0 for t in ids_of(pieces, lambda p: all(c in b'"}],' for c in p))} | {str(EOS): 6.0}


NUMBERS = {"type": "object", "required": ["n", "m"], "properties": {"n": {"type": "integer"}, "m": {"type": "integer"}}}


def test_whitespace_settings_reach_response_format(server, monkeypatch):
    """structured_outputs.disable_any_whitespace was dropped beside response_format, and there was no server
    default: a model that likes whitespace padded its JSON until max_tokens."""
    body = {"messages": USER, "max_tokens": 40, "temperature": 0.0, "logit_bias": whitespace_bias(server.pieces),
            "response_format": schema_format(NUMBERS)}
    padded = server.post(CHAT, body).json()["choices"][0]["message"]["content"]
    assert any(c.isspace() for c in padded), padded  # the bias works: whitespace wherever the grammar allows it
    tight = server.post(CHAT, {**body, "structured_outputs": {"disable_any_whitespace": True}}).json()
    assert not any(c.isspace() for c in tight["choices"][0]["message"]["content"]), tight
    pattern = server.post(CHAT, {**body, "structured_outputs": {"whitespace_pattern": "[ ]?"}}).json()
    assert not any(c.isspace() and c != " " for c in pattern["choices"][0]["message"]["content"]), pattern
    monkeypatch.setitem(server.ctx.config.structured_outputs_config, "disable_any_whitespace", True)
    default = server.post(CHAT, body).json()["choices"][0]
    assert not any(c.isspace() for c in default["message"]["content"]) and default["finish_reason"] == "stop"
    assert json.loads(default["message"]["content"]).keys() == {"n", "m"}  # closed: no property beyond n, m
    opened = server.post(CHAT, {**body, "structured_outputs": {"disable_any_whitespace": False}}).json()
    assert opened["choices"][0]["message"]["content"] == padded  # a request's own setting wins


def test_whitespace_settings_reach_tool_grammars(core, server):
    tool = {"type": "function", "function": {"name": "count", "parameters": NUMBERS}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "count"}}, "max_tokens": 60, "temperature": 0,
            "logit_bias": whitespace_bias(server.pieces)}
    with hermes_server(core, structured_outputs_config={"disable_any_whitespace": True}) as url:
        tight = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        padded = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            **body, "structured_outputs": {"disable_any_whitespace": False}}).json()["choices"][0]
    (call,) = tight["message"]["tool_calls"]
    assert not any(c.isspace() for c in call["function"]["arguments"]), call
    assert json.loads(call["function"]["arguments"]).keys() == {"n", "m"}
    # the request's own setting wins: whitespace padding until max_tokens, the call never finished
    assert padded["finish_reason"] == "length" and '{ "name": ' in padded["message"]["content"], padded
