"""Serving that real clients use unmodified (issue 16): the openai SDK's strict models, lm-eval's requests
(batched ``[[ids]]`` prompts with echo, /tokenize and /tokenizer_info), --api-key, /metrics, and a server
that one request cannot stall (off-loop tokenizing, body and prompt bounds, bounded request templates,
the error envelope for every failure). The live servers are conftest's; no core is exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import httpx
import openai
import ignition
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from _serving_tokenizers import CHAT_TEMPLATE, CORPUS, byte_level_tokenizer
from ignition.runtime.requests import AdmissionError, Request
from ignition.serve.app import ServeSetupError, create_app
from ignition.serve.config import ChatTemplateError, ServeConfig, api_keys_from, read_chat_template
from ignition.serve.tokenize import load_tokenizer_files

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "héllo"}]


def _sdk_typed(choice: dict) -> dict:
    """The two nulls OpenAI itself sends but the SDK types as non-null, checked here and filled in for the SDK:
    a stream choice's finish_reason before the last chunk, and position 0 of an echoed prompt's logprobs."""
    assert choice["finish_reason"] in (None, "stop", "length")
    choice = {**choice, "finish_reason": choice["finish_reason"] or "length"}
    logprobs = choice.get("logprobs")
    if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
        assert logprobs["top_logprobs"][0] is None and logprobs["text_offset"][0] == 0
        choice["logprobs"] = {**logprobs, "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]],
                              "top_logprobs": [{}, *logprobs["top_logprobs"][1:]]}
    return choice


def strict_completion(body: dict) -> None:
    """Completion.model_validate(strict=True), for a response and for every stream chunk."""
    assert body["object"] == "text_completion"
    Completion.model_validate({**body, "choices": [_sdk_typed(c) for c in body["choices"]]}, strict=True)


def assert_envelope(response: httpx.Response, status: int, err_type: str, param=None, message: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (err_type, status, param)
    assert message in error["message"]
    return error


# -- the openai SDK's strict models, streamed and not -------------------------------------------------
def test_every_chunk_validates_strictly_and_carries_token_ids(served):
    prompt = [11, 42, 99]
    expected = served.generate(prompt, max_tokens=6, logprobs=2)
    body = {"prompt": prompt, "max_tokens": 6, "logprobs": 2, "return_token_ids": True}
    chunks = served.sse(CMPL, dict(body, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        strict_completion(chunk)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for c in choices for t in c["token_ids"]] == expected.token_ids  # vLLM's per-chunk token_ids
    assert choices[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in choices[1:])
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    Completion.model_validate(served.post(CMPL, body).json(), strict=True)

    chat_ids = byte_level_tokenizer().encode("<|user|>héllo<|assistant|>", add_special_tokens=False).ids
    chat_expected = served.generate(chat_ids, max_tokens=5, logprobs=2)
    chat = {"messages": USER, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    events = served.sse(CHAT, dict(chat, stream=True, stream_options={"include_usage": True}))
    for event in events:
        assert event["object"] == "chat.completion.chunk"
        ChatCompletionChunk.model_validate(event, strict=True)
    assert events[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])] \
        == chat_expected.token_ids
    ChatCompletion.model_validate(served.post(CHAT, chat).json(), strict=True)
    sdk_chunks = list(served.client.chat.completions.create(model="toy", messages=USER, max_tokens=3, stream=True))
    assert {c.object for c in sdk_chunks} == {"chat.completion.chunk"}


# -- batched prompts: lm-eval's loglikelihood request, strings, streaming ------------------------------
def test_batched_prompts_spread_over_lanes_in_order(served, monkeypatch):
    prompts = [[11, 42, 99, 7], [5, 6], [3, 1, 4, 1, 5], [200, 201, 202], [9, 8]]  # five prompts, four lanes
    engine, admitted = served.ctx.engine.engine, []
    monkeypatch.setattr(engine, "submit", lambda r, submit=engine.submit, **checked: admitted.append(r.request_id)
                        or submit(r, **checked))
    # lm-eval's local-completions loglikelihood request: echo, max_tokens=1, logprobs=1, the prompts as [[ids]]
    body = {"model": "toy", "prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0,
            "seed": 1234}
    response = served.post(CMPL, body).json()
    strict_completion(response)
    assert len(admitted) == 5 and admitted == [f"{response['id']}-{i}" for i in range(5)]
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3, 4]
    for prompt, choice in zip(prompts, response["choices"]):
        expected = served.generate(prompt, max_tokens=1, logprobs=1, prompt_logprobs=1)
        assert choice["logprobs"]["token_logprobs"] == [None] + [e["logprob"] for e in expected.prompt_entries[1:]] \
            + [expected.entries[0].logprob]
        assert choice["text"] == served.text(prompt + expected.token_ids)
    assert response["usage"] == {"prompt_tokens": 16, "completion_tokens": 5, "total_tokens": 21}

    texts = ["the cat", "héllo wörld", "zürich"]
    batch = served.client.completions.create(model="toy", prompt=texts, max_tokens=4)
    singles = [served.client.completions.create(model="toy", prompt=t, max_tokens=4).choices[0].text for t in texts]
    assert [c.text for c in batch.choices] == singles and [c.index for c in batch.choices] == [0, 1, 2]

    chunks = served.sse(CMPL, {"prompt": prompts, "max_tokens": 6, "logprobs": 1, "stream": True,
                               "stream_options": {"include_usage": True}})
    merged: dict[int, list] = {}
    for chunk in chunks:
        strict_completion(chunk)
        assert chunk["id"] == chunks[0]["id"]
        for choice in chunk["choices"]:
            merged.setdefault(choice["index"], []).append(choice)
    assert sorted(merged) == [0, 1, 2, 3, 4]
    for index, prompt in enumerate(prompts):
        expected = served.generate(prompt, max_tokens=6, logprobs=1)
        assert "".join(c["text"] for c in merged[index]) == served.text(expected.token_ids)
        assert [v for c in merged[index] for v in c["logprobs"]["token_logprobs"]] == [
            e.logprob for e in expected.entries]
        assert merged[index][-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 16, "completion_tokens": 30, "total_tokens": 46}
    served.wait_idle()


# -- /tokenize, /detokenize, /tokenizer_info (lm-eval's remote tokenizer) ---------------------------------
def test_tokenize_round_trip_and_tokenizer_info(served, served_plain):
    tokenizer, text = byte_level_tokenizer(), "héllo wörld, naïve café 😀 <|end|>"
    got = served.post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert got == {"count": len(ids), "max_model_len": served.ctx.max_context, "tokens": ids,
                   "token_strs": [tokenizer.id_to_token(i) for i in ids]}
    assert served.post("/detokenize", {"tokens": ids}).json() == {"prompt": text}  # special tokens kept, as HF
    chat = served.post("/tokenize", {"messages": USER}).json()
    generated = served.post(CHAT, {"messages": USER, "max_tokens": 1, "return_token_ids": True}).json()
    assert chat["tokens"] == generated["prompt_token_ids"] and chat["count"] == len(chat["tokens"])
    info = served.http.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["chat_template"]) == ("<|end|>", None, CHAT_TEMPLATE)
    assert info["tokenizer_class"] and not [k for k in info if k.endswith("_file")]
    eos = served.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.token_to_id("<|end|>")]  # how lm-eval finds the EOS id
    assert_envelope(served.post("/detokenize", {"tokens": [1, 250]}), 400, "BadRequestError", "tokens", "250")
    assert_envelope(served.post("/tokenize", {"prompt": "a\udc80"}), 400, "BadRequestError", "prompt", "surrogate")
    assert_envelope(served.post("/tokenize", {"model": "other", "prompt": "a"}), 404, "NotFoundError", "model")
    assert_envelope(served_plain.post("/tokenize", {"prompt": "a"}), 400, "BadRequestError", "prompt", "no tokenizer")


# -- --api-key -------------------------------------------------------------------------------------
def test_api_key_guards_v1_and_invocations_only(served, monkeypatch):
    """As vLLM's AuthenticationMiddleware: /v1/* needs the key; the tokenizer endpoints, probes and metrics do not
    (lm-eval detects a remote tokenizer through /tokenizer_info without a key). /invocations runs generation: keyed."""
    monkeypatch.setattr(served.ctx.config, "api_keys", ("sekret",))
    guarded = [("GET", "/v1/models", None), ("GET", "/v1/models/toy", None),
               ("POST", CMPL, {"prompt": [1], "max_tokens": 1}), ("POST", CHAT, {"messages": USER, "max_tokens": 1}),
               ("POST", "/invocations", {"prompt": [1], "max_tokens": 1})]
    for method, path, body in guarded:
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
            response = served.http.request(method, path, json=body, headers=header)
            assert_envelope(response, 401, "UnauthorizedError", None, "Authorization: Bearer")
            assert response.headers["www-authenticate"] == "Bearer"
        assert served.http.request(method, path, json=body,
                                   headers={"Authorization": "Bearer sekret"}).status_code == 200
    for method, path, body in [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None),
                               ("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/tokenizer_info", None),
                               ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]})]:
        assert served.http.request(method, path, json=body).status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        served.client.models.list()
    keyed = openai.OpenAI(base_url=served.url + "/v1", api_key="sekret", max_retries=0)
    assert keyed.completions.create(model="toy", prompt=[1], max_tokens=2).usage.completion_tokens == 2
    for name in ("IGNITION_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert api_keys_from(None) == ()
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert api_keys_from(None) == ("v",)
    monkeypatch.setenv("IGNITION_API_KEY", "i")
    assert (api_keys_from(None), api_keys_from("flag")) == (("i",), ("flag",))


# -- /metrics and request log lines ------------------------------------------------------------------
def scrape(served) -> dict[tuple[str, tuple], float]:
    text = served.http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_count_requests(served, caplog):
    caplog.set_level(logging.INFO, logger="ignition.serve")
    model = (("model_name", "toy"),)
    before = scrape(served)
    served.client.completions.create(model="toy", prompt=[4, 5, 6], max_tokens=5)
    list(served.client.completions.create(model="toy", prompt=[7, 8], max_tokens=3, stream=True))
    served.wait_idle()
    after = scrape(served)

    def delta(name, labels=model):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("ignition:request_success_total", (("finished_reason", "length"),) + model) == 2
    assert (delta("ignition:prompt_tokens_total"), delta("ignition:generation_tokens_total")) == (5, 8)
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prompt_tokens"):
        assert delta(f"ignition:{histogram}_count") == 2
    assert delta("ignition:request_generation_tokens_sum") == 8
    assert after[("ignition:num_requests_running", model)] == after[("ignition:num_requests_waiting", model)] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "ignition.serve" and "finished (length)" in r.message]
    assert any("3 prompt tokens, 5 generated tokens" in line for line in lines)
    assert any("2 prompt tokens, 3 generated tokens" in line for line in lines)


# -- one request cannot stall the server --------------------------------------------------------------
def test_a_large_prompt_does_not_stall_health(served, monkeypatch):
    """A ~1 MB prompt takes about a second or more to tokenize (with the GIL held, were it tokenized with
    ``encode``); /health answers within a second, and within half the tokenizing time, all along. The prompt is then refused for the context bound, never generated."""
    text = " ".join(CORPUS) * 400
    context = len(text) // served.ctx.max_prompt_chars(1) + 1  # the text fits the character bound, not the tokens
    monkeypatch.setattr(served.ctx.engine.engine, "max_context", context)
    tokenizing = threading.Event()
    encode_batch = served.ctx.tokenizer.encode_batch
    monkeypatch.setattr(served.ctx, "tokenizer", type("Observed", (), {
        "encode_batch": lambda self, *a, **k: tokenizing.set() or encode_batch(*a, **k)})())
    result = {}
    thread = threading.Thread(target=lambda: result.update(response=served.post(CMPL, {"prompt": text})))
    began = time.monotonic()
    thread.start()
    assert tokenizing.wait(30)
    latencies = []
    while thread.is_alive():
        probe = time.monotonic()
        assert served.http.get("/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - probe)
        time.sleep(0.05)
    thread.join()
    assert_envelope(result["response"], 400, "BadRequestError", "prompt", f"more than the context of {context} tokens")
    elapsed = time.monotonic() - began
    assert len(latencies) >= 3, (elapsed, latencies)  # the probes overlapped the work
    # a tokenizer holding the GIL would stall one probe for about the whole tokenization
    assert max(latencies) < min(1.0, elapsed / 2), (elapsed, latencies)


def test_body_and_prompt_bounds(served, monkeypatch):
    monkeypatch.setattr(served.ctx.config, "max_body_bytes", 1000)
    big = {"prompt": "x" * 2000, "max_tokens": 1}
    assert_envelope(served.post(CMPL, big), 413, "RequestTooLargeError", None, "--max-body-bytes")

    def chunked():
        for _ in range(30):
            yield b" " * 100
        yield b'{"prompt": [1]}'
    response = httpx.post(served.url + CMPL, content=chunked(), headers={"content-type": "application/json"})
    assert_envelope(response, 413, "RequestTooLargeError", None, "more than 1000")
    monkeypatch.setattr(served.ctx.config, "max_prompt_bytes", 10)
    assert_envelope(served.post(CMPL, {"prompt": "é" * 6, "max_tokens": 1}), 400, "BadRequestError", "prompt",
                    "prompt has 12 bytes of text; this server accepts at most 10")
    assert_envelope(served.post(CHAT, {"messages": [{"role": "user", "content": "y" * 11}]}), 400,
                    "BadRequestError", "messages[0].content", "at most 10")
    assert served.post(CMPL, {"prompt": "é" * 5, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("template, message", [
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "was stopped"),
    ("{% if true %}" * 20 + "x" + "{% endif %}" * 20, "nests 20 blocks deep; at most 16"),
    ("{{ 'x' * 100000000 }}", "a repetition would exceed"),
    ("{{ 'x'.ljust(100000000) }}", "an argument of 100000000 would exceed"),
    ("{{ '%099999999d' % 1 }}", "an argument of 99999999 would exceed"),
    ("{{ 'x'|center(100000000) }}", "an argument of 100000000"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "at most 4194304"),
    ("{# " + "x" * 70000 + " #}", "at most 65536 are allowed"),
])
def test_request_templates_are_bounded(served, template, message):
    began = time.monotonic()
    response = served.post(CHAT, {"messages": USER, "max_tokens": 1, "chat_template": template})
    error = response.json()["error"]
    assert response.status_code == 400 and message in error["message"], error
    assert time.monotonic() - began < 5


def test_template_errors_and_disabled_request_templates(served, monkeypatch):
    monkeypatch.setattr(served.ctx, "chat_template", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    assert_envelope(served.post(CHAT, {"messages": USER}), 400, "BadRequestError", "messages", "RecursionError")
    monkeypatch.setattr(served.ctx.config, "allow_request_chat_template", False)
    assert_envelope(served.post(CHAT, {"messages": USER, "chat_template": "{{ 1 }}"}), 400, "BadRequestError",
                    "chat_template", "--allow-request-chat-template")
    assert_envelope(served.post("/tokenize", {"messages": USER, "chat_template": "{{ 1 }}"}), 400,
                    "BadRequestError", "chat_template", "--allow-request-chat-template")


def test_internal_errors_are_500_with_a_request_id_and_no_traceback(served, monkeypatch, caplog):
    import ignition.serve.completions as completions

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")
    monkeypatch.setattr(completions, "build_request", broken)
    caplog.set_level(logging.ERROR, logger="ignition.serve")
    response = served.post(CMPL, {"prompt": [1]})
    error = assert_envelope(response, 500, "InternalServerError", None, "request id req-")
    assert "secret" not in response.text and "Traceback" not in response.text
    request_id = response.headers["x-request-id"]
    assert f"request id {request_id};" in error["message"]
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.exc_info[0] is RuntimeError  # the traceback goes to the log, under the same id
    mine = served.post(CMPL, {"prompt": [1]}, headers={"X-Request-Id": "client-7"})
    assert mine.headers["x-request-id"] == "client-7" and "request id client-7;" in mine.json()["error"]["message"]


def test_docs_are_off_by_default(served):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_envelope(served.http.get(path), 404, "NotFoundError", None, "Not Found")
    assert served.http.get("/version").json() == {"version": ignition.__version__}


# -- configuration: templates, tokenizer, context --------------------------------------------------------
def test_chat_template_sources(tmp_path, served, monkeypatch):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "D"}]}')
    files = load_tokenizer_files(directory, None, 250)
    assert (files.chat_template, files.chat_template_source) == ("D", str(directory / "tokenizer_config.json"))
    (directory / "chat_template.jinja").write_text("J{{ messages }}")  # where Hugging Face saves it now
    files = load_tokenizer_files(directory, None, 250)
    assert (files.chat_template, files.chat_template_source) == ("J{{ messages }}",
                                                                 str(directory / "chat_template.jinja"))
    assert read_chat_template(str(directory / "chat_template.jinja")) == "J{{ messages }}"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ServeSetupError, match="no tokenizer.json there"):
        create_app(served.ctx.core, config=ServeConfig(tokenizer=directory))
    app = create_app(served.ctx.core, config=ServeConfig(max_model_len=8))  # the toy core declares no context
    assert app.state.ctx.max_context == 8
    with pytest.raises(AdmissionError, match=r"prompt \(5 tokens\) plus max_tokens \(4\) exceeds .* 8 tokens"):
        app.state.ctx.engine.engine.submit(Request([1, 2, 3, 4, 5], max_tokens=4))
    app.state.ctx.executor.shutdown()
    core = served.ctx.core
    spec = core.spec
    monkeypatch.setattr(core, "_spec", dataclasses.replace(spec, model=dataclasses.replace(spec.model, max_seq_len=64)))
    with pytest.raises(ServeSetupError, match="--max-model-len 65 exceeds the core's context of 64 tokens"):
        create_app(core, config=ServeConfig(max_model_len=65))
