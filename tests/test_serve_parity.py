"""vLLM parity of the server (issue 26, item 5): ignored and refused fields, truncate_prompt_tokens, the
terminating token in usage, Responses' final event, /v1/models/{id}, /ping, /invocations, CORS, and the
request-field table of docs/serving.md kept in step with the request models. The live servers are conftest's.
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from _served import serve_in_thread
from ignition.cli import app as cli
from ignition.serve.app import create_app
from ignition.serve.config import ServeConfig
from ignition.serve.protocol import STRUCTURED_OUTPUT, UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from test_serve_compat import assert_envelope

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


# -- fields: ignored with one warning, refused by name, truncate_prompt_tokens ---------------------------
def test_unknown_fields_warn_once_per_name(served, caplog):
    name = f"x_{uuid.uuid4().hex[:8]}"  # a name no earlier request of this process sent
    with caplog.at_level(logging.WARNING, logger="ignition.serve"):
        for path, body in ((CMPL, {"prompt": [1], "max_tokens": 1}), (CHAT, {"messages": USER, "max_tokens": 1})):
            assert served.post(path, {**body, name: 1, "priority": 0}).status_code == 200
    warned = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert warned == [f"the request field '{name}' is not supported and was ignored (logged once per field name)"]


@pytest.mark.parametrize("path,body", [(CMPL, {"prompt": [1]}), (CHAT, {"messages": USER})])
@pytest.mark.parametrize("field", sorted(STRUCTURED_OUTPUT))
def test_structured_output_fields_are_refused(served, path, body, field):
    assert_envelope(served.post(path, {**body, field: {"type": "object"}}), 400, "BadRequestError", field,
                    "structural tags are not supported")


def test_truncate_prompt_tokens_keeps_the_last_tokens(served, monkeypatch):
    ids = list(range(20, 40))
    full = served.post(CMPL, {"prompt": ids, "max_tokens": 2, "return_token_ids": True}).json()
    cut = served.post(CMPL, {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 5,
                             "return_token_ids": True}).json()
    assert cut["choices"][0]["prompt_token_ids"] == ids[-5:] and cut["usage"]["prompt_tokens"] == 5
    assert full["choices"][0]["prompt_token_ids"] == ids
    text_ids = served.tokenizer.encode("hello world, hello there").ids
    text = served.post(CMPL, {"prompt": "hello world, hello there", "max_tokens": 1, "truncate_prompt_tokens": 3,
                              "return_token_ids": True}).json()
    assert text["choices"][0]["prompt_token_ids"] == text_ids[-3:]
    chat = served.post(CHAT, {"messages": USER, "max_tokens": 1, "return_token_ids": True}).json()
    cut_chat = served.post(CHAT, {"messages": USER, "max_tokens": 1, "truncate_prompt_tokens": 2,
                                  "return_token_ids": True}).json()
    assert cut_chat["prompt_token_ids"] == chat["prompt_token_ids"][-2:]
    context = 32
    monkeypatch.setattr(served.ctx.engine.engine, "max_context", context)  # as --max-model-len 32 sets it
    long = served.post(CMPL, {"prompt": [5] * (context + 10), "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert long.status_code == 400 and "plus max_tokens" in long.json()["error"]["message"]  # kept the context
    for value, message in ((0, "at least 1"), (context + 1, "greater than max_model_len")):
        assert_envelope(served.post(CMPL, {"prompt": ids, "truncate_prompt_tokens": value}), 400, "BadRequestError",
                        "truncate_prompt_tokens", message)


@pytest.mark.parametrize("path,body,param", [(CMPL, {"prompt": [1], "max_tokens": 0}, "max_tokens"),
                                             (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_tokens"),
                                             ("/v1/responses", {"input": "hi", "max_output_tokens": 0},
                                              "max_output_tokens")])
def test_zero_max_tokens_is_refused(served, path, body, param):
    assert_envelope(served.post(path, body), 400, "BadRequestError", param, "at least 1, got 0")
    if path == CMPL:  # vLLM's echo_without_generation: the prompt alone
        echoed = served.post(path, {**body, "echo": True}).json()
        assert (echoed["choices"][0]["text"], echoed["usage"]["completion_tokens"]) == (served.text([1]), 0)


def test_malformed_json_names_the_body(served):
    response = served.http.post(CMPL, content=b'{"prompt": [1], ', headers={"content-type": "application/json"})
    assert_envelope(response, 400, "BadRequestError", "body", "not valid JSON")


# -- usage: the terminating token counts, without a logprob entry ---------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_terminating_tokens_are_counted_and_listed(served_eos, stream):
    """vLLM appends the sampled token before check_stop (vllm/v1/core/sched/utils.py), so an ending EOS or stop id
    is in completion_tokens and token_ids; the logprob contract gives it no entry."""
    server, chain = served_eos, served_eos.chain(7, 5)
    cases = [({}, chain[:3], None, 2),  # chain[2] is the EOS
             ({"ignore_eos": True, "stop_token_ids": [chain[3]]}, chain[:4], chain[3], 3),
             ({"stop_token_ids": [chain[0]]}, chain[:1], chain[0], 0)]  # a stop id on the first token
    for extra, token_ids, stop_reason, entries in cases:
        body = {"prompt": [7], "max_tokens": 5, "logprobs": 0, "return_token_ids": True, **extra}
        if stream:
            chunks = server.sse(CMPL, {**body, "stream": True, "stream_options": {"include_usage": True}})
            choices = [c["choices"][0] for c in chunks if c["choices"]]
            got = {"token_ids": [t for c in choices for t in c["token_ids"]], "stop_reason": choices[-1]["stop_reason"],
                   "entries": sum(len(c["logprobs"]["tokens"]) for c in choices), "usage": chunks[-1]["usage"]}
        else:
            response = server.post(CMPL, body).json()
            choice = response["choices"][0]
            got = {"token_ids": choice["token_ids"], "stop_reason": choice["stop_reason"],
                   "entries": len(choice["logprobs"]["tokens"]), "usage": response["usage"]}
        assert got["token_ids"] == token_ids and got["stop_reason"] == stop_reason and got["entries"] == entries
        assert got["usage"]["completion_tokens"] == len(token_ids)


def test_chat_counts_a_stop_id_and_streams_continuous_usage(served):
    generated = served.post(CHAT, {"messages": USER, "max_tokens": 3, "ignore_eos": True,
                                   "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert generated[1] not in generated[:1]
    stopped = served.post(CHAT, {"messages": USER, "max_tokens": 3, "ignore_eos": True, "logprobs": True,
                                 "stop_token_ids": [generated[1]], "return_token_ids": True}).json()
    choice = stopped["choices"][0]
    assert (choice["token_ids"], choice["stop_reason"], stopped["usage"]["completion_tokens"]) == \
        (generated[:2], generated[1], 2)
    assert len(choice["logprobs"]["content"]) == 1
    chunks = served.sse(CHAT, {"messages": USER, "max_tokens": 3, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 3 and all("usage" in c for c in chunks)


# -- Responses: the stream ends with response.completed -------------------------------------------------
def test_responses_stream_final_response_with_max_output_tokens(served):
    with served.client.responses.stream(model="toy", input="hi", max_output_tokens=2) as stream:
        final = stream.get_final_response()
    assert (final.status, final.incomplete_details.reason, final.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 2)


# -- endpoints: /v1/models/{id}, /ping, /invocations ----------------------------------------------------
def test_model_by_id_ping_and_invocations(served):
    assert served.client.models.retrieve("toy").id == "toy"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("other")
    assert_envelope(served.http.get("/v1/models/a/b"), 404, "NotFoundError", "model", "`a/b` does not exist")
    assert served.http.get("/ping").status_code == served.http.post("/ping").status_code == 200
    completion = served.post("/invocations", {"prompt": [1], "max_tokens": 2}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 2
    chat = served.post("/invocations", {"messages": USER, "max_tokens": 1}).json()
    assert chat["object"] == "chat.completion"
    assert_envelope(served.post("/invocations", {"input": "x"}), 400, "BadRequestError", "body", "`messages`")
    assert_envelope(served.post("/invocations", {"prompt": [1], "max_tokens": "x"}), 400, "BadRequestError",
                    "max_tokens")
    assert_envelope(served.http.post("/invocations", content=b"[1"), 400, "BadRequestError", "body", "not valid JSON")


def test_cors_and_the_batch_cap(serving_cores):
    app = create_app(serving_cores[0], model_name="toy", config=ServeConfig(api_keys=("k",)),
                     allowed_origins=("https://app.example",), max_batch_prompts=3)
    server, thread, url = serve_in_thread(app)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            preflight = http.options(CMPL, headers={"Origin": "https://app.example",
                                                    "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization"})
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "https://app.example"
            refused = http.post(CMPL, json={"prompt": [1]}, headers={"Origin": "https://app.example"})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
            assert "access-control-allow-origin" not in http.get("/health", headers={"Origin": "https://evil"}).headers
            key = {"Authorization": "Bearer k"}
            assert http.post(CMPL, json={"prompt": [[1]] * 3, "max_tokens": 1}, headers=key).status_code == 200
            assert_envelope(http.post(CMPL, json={"prompt": ["a"] * 4}, headers=key), 400, "BadRequestError", "prompt",
                            "batch of 4 prompts; this server accepts at most 3 per request (--max-batch-prompts)")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_serve_refuses_an_empty_api_key_and_bad_origins(serving_cores):
    for args, message in ((["--api-key", ""], "--api-key is empty"), (["--api-key", "  "], "--api-key is empty"),
                          (["--allowed-origins", "*"], "is not JSON"),
                          (["--allowed-origins", '"*"'], "expected a JSON list"),
                          (["--max-batch-prompts", "0"], "at least 1")):
        result = CliRunner().invoke(cli, ["serve", str(serving_cores[1]), *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


# -- docs/serving.md's request-field table --------------------------------------------------------------
def field_table() -> dict[str, tuple[str, str]]:
    """``field -> (Completions status, Chat status)`` from the table under "## Request fields"."""
    section = DOCS.read_text().split("## Request fields", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (\S+) \| (\S+) \|", section, re.MULTILINE)
    assert len(rows) == len({name for name, *_ in rows}) > 50
    return {name: (completions, chat) for name, completions, chat in rows}


@pytest.mark.parametrize("column,model", [(0, CompletionRequest), (1, ChatCompletionRequest)])
def test_the_field_table_matches_the_request_models(column, model, caplog):
    table, refused = field_table(), UNSUPPORTED.keys() | STRUCTURED_OUTPUT
    statuses = {name: row[column] for name, row in table.items() if row[column] != "—"}
    assert set(statuses.values()) <= {"supported", "ignored", "refused"}
    fields = set(model.model_fields)
    assert fields <= statuses.keys(), f"model fields missing from the table: {fields - statuses.keys()}"
    for name, status in statuses.items():
        assert (status == "refused") == (name in refused), name
        assert (status == "supported") == (name in fields and name not in refused), name
    assert refused <= table.keys()
    base = {"prompt": [1]} if model is CompletionRequest else {"messages": USER}
    ignored = sorted(name for name, status in statuses.items() if status == "ignored")
    with caplog.at_level(logging.WARNING, logger="ignition.serve"):
        parsed = model.model_validate({**base, **{name: 0 for name in ignored}})
    assert sorted(parsed.model_extra) == ignored  # accepted, and (once per process) warned about
