"""The HTTP front end against a real uvicorn server: the official openai client, plain HTTP for vLLM fields.

Every value is compared with the loader (a separate Engine on the same core): token ids,
logprobs, alternatives, prompt scores. Text, bytes and offsets are compared with the UTF-8
oracles of _serving_tokenizers. Cores: A byte-level BPE with prompt scoring and a chat
template, B byte fallback with an EOS and no template, C without logprobs or tokenizer (all in conftest).
"""

from __future__ import annotations

import dataclasses
import asyncio
import json
import logging
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from _served import VOCAB, Served
from _serving_tokenizers import (CHAT_TEMPLATE, byte_fallback_tokenizer, byte_level_tokenizer, offsets_oracle,
                                 splits_a_character)
from ignition.runtime.engine import Engine
from ignition.catalog.abi import TokenEntry
from ignition.runtime.requests import Request


def completion_expectation(served: Served, entries: list[TokenEntry], base: int = 0, text_before: str = ""):
    """Completions logprobs the loader's entries must produce (the chosen token first in top_logprobs)."""
    names, offsets = served.table.names, offsets_oracle(served.pieces([e.id for e in entries]))
    top = []
    for e in entries:
        row = {names[e.id]: e.logprob}
        for token_id, value in e.top:
            row.setdefault(names[token_id], value)
        top.append(row)
    return {"tokens": [names[e.id] for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [base + o for o in offsets]}


def merge_completion_chunks(chunks: list[dict]) -> dict:
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    finish = None
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        text += choice["text"]
        for key in logprobs:
            logprobs[key] += (choice.get("logprobs") or {}).get(key, [])
        finish = choice.get("finish_reason") or finish
    return {"text": text, "logprobs": logprobs, "finish_reason": finish}


# -- request defaults (serve/defaults.py) ---------------------------------------------------------
def test_request_defaults_are_one_table_that_docs_serving_md_shows():
    from types import SimpleNamespace as Body

    from ignition.serve import defaults
    assert defaults.main(["--check"]) == 0, "docs/serving.md is stale: run python -m ignition.serve.defaults"
    assert defaults.COMPLETIONS.resolve(Body(max_tokens=None), 5, 64) == 16
    assert defaults.COMPLETIONS.resolve(Body(max_tokens=3), 5, 64) == 3
    assert defaults.CHAT.resolve(Body(max_completion_tokens=None, max_tokens=None), 5, 64) == 59
    assert defaults.CHAT.resolve(Body(max_completion_tokens=None, max_tokens=None), 5, None) == 256
    assert defaults.CHAT.resolve(Body(max_completion_tokens=7, max_tokens=9), 5, 64) == 7
    assert defaults.CHAT.resolve(Body(max_completion_tokens=None, max_tokens=9), 5, 64) == 9
    assert defaults.RESPONSES.resolve(Body(max_output_tokens=None), 10, 64) == 54


def test_completions_without_max_tokens_generate_the_table_default(served):
    from ignition.serve.defaults import COMPLETIONS
    body = {"model": "toy", "prompt": [1, 2], "ignore_eos": True}
    usage = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["completion_tokens"] == COMPLETIONS.fixed == 16


# -- models and health ----------------------------------------------------------------------------
def test_models_advertise_the_core_features(served, served_eos, served_plain):
    (card,) = served.client.models.list().data
    assert card.id == "toy"
    assert card.features == {"allow_logprobs": True, "max_logprobs": 20, "explicit_ids": True,
                             "max_logprob_token_ids": 128, "prompt_logprobs": True, "chat_template": True,
                             "structured_output": True}
    assert card.permission[0]["allow_logprobs"] is True
    plain = httpx.get(served_plain.url + "/v1/models").json()
    assert plain["data"][0]["features"]["allow_logprobs"] is False
    assert plain["data"][0]["features"]["max_logprobs"] == 0
    assert plain["data"][0]["permission"][0]["allow_logprobs"] is False
    features = httpx.get(served_eos.url + "/v1/models").json()["data"][0]["features"]
    assert (features["prompt_logprobs"], features["chat_template"]) == (False, False)
    assert httpx.get(served.url + "/health").status_code == 200


# -- Completions --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_the_loader(served, stream):
    prompt = [11, 42, 99]
    expected = served.generate(prompt, max_tokens=8, logprobs=5)
    if stream:
        chunks = list(served.client.completions.create(model="toy", prompt=prompt, max_tokens=8, logprobs=5,
                                                       stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
        got = merge_completion_chunks([c.model_dump() for c in chunks])
    else:
        response = served.client.completions.create(model="toy", prompt=prompt, max_tokens=8, logprobs=5)
        assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 8
        got = response.choices[0].model_dump()
    assert got["text"] == served.text(expected.token_ids)
    assert got["finish_reason"] == "length"
    assert {k: got["logprobs"][k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")} \
        == completion_expectation(served, expected.entries)


def test_completion_without_logprobs_and_with_zero(served):
    prompt = "the cat"
    response = served.client.completions.create(model="toy", prompt=prompt, max_tokens=6)
    ids = byte_level_tokenizer().encode(prompt).ids
    expected = served.generate(ids, max_tokens=6, logprobs=0)
    assert response.choices[0].logprobs is None
    assert response.choices[0].text == served.text(expected.token_ids)
    zero = served.client.completions.create(model="toy", prompt=prompt, max_tokens=6, logprobs=0).choices[0].logprobs
    assert zero.top_logprobs == [{served.table.names[e.id]: e.logprob} for e in expected.entries]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_with_prompt_logprobs(served, stream):
    prompt = "héllo € 中 😀"
    ids = byte_level_tokenizer().encode(prompt).ids
    expected = served.generate(ids, max_tokens=5, logprobs=3, prompt_logprobs=3)
    body = {"model": "toy", "prompt": prompt, "max_tokens": 5, "logprobs": 3, "echo": True}
    if stream:
        chunks = served.sse("/v1/completions", dict(body, stream=True))
        assert chunks[0]["choices"][0]["text"].startswith(prompt)  # the echo leads the first chunk
        got = merge_completion_chunks(chunks)
    else:
        got = served.post("/v1/completions", body).json()["choices"][0]
        scores = got["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(ids)
        for position, (row, entry) in enumerate(zip(scores[1:], expected.prompt_entries[1:]), start=1):
            keys = list(row)
            assert keys[0] == str(ids[position])
            assert row[keys[0]] == {"logprob": entry["logprob"], "rank": entry["rank"],
                                    "decoded_token": served.table.names[ids[position]]}
            alternatives = [a for a in entry["top_logprobs"] if a["id"] != ids[position]]
            assert [(int(k), v["logprob"], v["rank"]) for k, v in list(row.items())[1:]] == [
                (a["id"], a["logprob"], entry["top_logprobs"].index(a) + 1) for a in alternatives]
    assert got["text"] == prompt + served.text(expected.token_ids)
    lp = got["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_part = completion_expectation(served, [TokenEntry(e["id"], e["logprob"], [
        (a["id"], a["logprob"]) for a in e["top_logprobs"]]) for e in expected.prompt_entries[1:]])
    assert lp["tokens"][:len(ids)] == [served.table.names[i] for i in ids]
    assert lp["token_logprobs"][1:len(ids)] == prompt_part["token_logprobs"]
    assert lp["top_logprobs"][1:len(ids)] == prompt_part["top_logprobs"]
    assert lp["text_offset"][:len(ids)] == offsets_oracle(served.pieces(ids))
    generated = completion_expectation(served, expected.entries, base=len(prompt))
    assert {k: lp[k][len(ids):] for k in generated} == generated


def test_explicit_logprob_token_ids(served):
    prompt, selected = [5, 6], [200, 3, 17]
    expected = served.generate(prompt, max_tokens=4, logprob_token_ids=selected)
    assert [[t for t, _ in e.top] for e in expected.entries] == [selected] * 4
    response = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "logprobs": 0,
                                                "logprob_token_ids": selected}).json()
    assert response["choices"][0]["logprobs"]["top_logprobs"] == completion_expectation(
        served, expected.entries)["top_logprobs"]
    chat = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                                "logprobs": True, "logprob_token_ids": selected}).json()
    for item in chat["choices"][0]["logprobs"]["content"]:
        assert [t["token"] for t in item["top_logprobs"]] == [served.table.names[i] for i in selected]


def test_prompt_logprobs_without_echo(served):
    ids = [3, 1, 4, 1, 5]
    expected = served.generate(ids, max_tokens=2, prompt_logprobs=0)
    got = served.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 0}).json()
    scores = got["choices"][0]["prompt_logprobs"]
    assert scores[0] is None
    assert [{int(k): v["logprob"] for k, v in row.items()} for row in scores[1:]] == [
        {e["id"]: e["logprob"]} for e in expected.prompt_entries[1:]]
    assert got["choices"][0]["logprobs"] is None
    only_prompt = served.post("/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert only_prompt["choices"][0]["text"] == served.text(ids)
    assert len(only_prompt["choices"][0]["logprobs"]["tokens"]) == len(ids)



# -- Chat ------------------------------------------------------------------------------------------
def chat_expectation(served: Served, entries: list[TokenEntry]) -> list[dict]:
    names, raw = served.table.names, served.table.bytes
    return [{"token": names[e.id], "logprob": e.logprob, "bytes": list(raw[e.id]),
             "top_logprobs": [{"token": names[t], "logprob": v, "bytes": list(raw[t])} for t, v in e.top]}
            for e in entries]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_the_loader(served, stream):
    messages = [{"role": "user", "content": "héllo"}]
    prompt_ids = byte_level_tokenizer().encode("<|user|>héllo<|assistant|>", add_special_tokens=False).ids
    expected = served.generate(prompt_ids, max_tokens=6, logprobs=3)
    if stream:
        chunks = list(served.client.chat.completions.create(model="toy", messages=messages, max_tokens=6,
                                                            logprobs=True, top_logprobs=3, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [item.model_dump() for c in chunks if c.choices[0].logprobs for item in c.choices[0].logprobs.content]
        finish = chunks[-1].choices[0].finish_reason
    else:
        response = served.client.chat.completions.create(model="toy", messages=messages, max_tokens=6, logprobs=True,
                                                         top_logprobs=3, extra_body={"return_token_ids": True})
        assert response.model_extra["prompt_token_ids"] == prompt_ids  # the checkpoint's template rendered it
        choice = response.choices[0]
        text, finish = choice.message.content, choice.finish_reason
        content = [item.model_dump() for item in choice.logprobs.content]
    assert text == served.text(expected.token_ids) and finish == "length"
    assert content == chat_expectation(served, expected.entries)
    for item, entry in zip(content, expected.entries):  # natural alternatives only: the sampled token displaces none
        assert len(item["top_logprobs"]) == 3


def test_chat_without_logprobs_and_echo(served):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "the "}]
    response = served.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3, "echo": True,
                                                    "add_generation_prompt": False}).json()
    choice = response["choices"][0]
    assert choice["logprobs"] is None and choice["message"]["role"] == "assistant"
    prompt_ids = byte_level_tokenizer().encode("<|user|>x<|assistant|>the ", add_special_tokens=False).ids
    assert choice["message"]["content"] == "the " + served.text(served.generate(prompt_ids, max_tokens=3).token_ids)


# -- token presentation: split characters, both tokenizers ----------------------------------------------
@pytest.mark.parametrize("which", ["byte_level", "byte_fallback"])
def test_split_characters_bytes_and_offsets(served, served_eos, which):
    server = served if which == "byte_level" else served_eos
    eos = server.ctx.core.manifest["eos_token_id"]
    start = next(t for t in range(VOCAB) if eos not in server.chain(t, 10)
                 and splits_a_character(server.pieces(server.chain(t, 10))))
    chain = server.chain(start, 10)
    body = {"prompt": [start], "max_tokens": 10, "logprobs": 1, "return_token_ids": True}
    full = server.post("/v1/completions", body).json()["choices"][0]
    assert full["token_ids"] == chain
    assert full["text"] == server.text(chain)
    assert full["logprobs"]["text_offset"] == offsets_oracle(server.pieces(chain))
    assert full["logprobs"]["tokens"] == [server.table.names[i] for i in chain]
    chunks = server.sse("/v1/completions", dict(body, stream=True))
    released = b""
    for chunk in chunks:  # each chunk ends on a character boundary: a split character travels in one chunk
        choice = chunk["choices"][0]
        released += b"".join(server.pieces(choice["token_ids"]))
        assert released.decode("utf-8", "replace") == server.text(chain)[:len(released.decode("utf-8", "replace"))]
        assert choice["text"] == "" or released.decode("utf-8", "replace").endswith(choice["text"])
    assert merge_completion_chunks(chunks)["logprobs"]["text_offset"] == full["logprobs"]["text_offset"]
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
                                                "logprobs": True, "chat_template": "{{ messages[0]['content'] }}"})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    chat_ids = server.chain(server.tokenizer.encode("x", add_special_tokens=False).ids[-1], 10)
    chat_ids = chat_ids[:chat_ids.index(eos)] if eos in chat_ids else chat_ids
    assert [bytes(item["bytes"]) for item in content] == server.pieces(chat_ids)  # raw bytes, before replacement


# -- stops ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_keeps_contributing_tokens_only(served, stream):
    def stop_inside_a_token(start):  # a stop that begins at the second character of a later token
        chain = served.chain(start, 12)
        text, offsets, pieces = served.text(chain), offsets_oracle(served.pieces(chain)), served.pieces(chain)
        for i in range(2, 11):
            valid = pieces[i].decode("utf-8", "replace") == pieces[i].decode("utf-8", "ignore")
            if valid and len(pieces[i].decode()) > 1:
                stop_at = offsets[i] + 1
                if text.find(text[stop_at:stop_at + 2]) == stop_at:
                    return chain, text, offsets, stop_at
        return None

    start = next(t for t in range(VOCAB) if stop_inside_a_token(t))
    chain, text, offsets, stop_at = stop_inside_a_token(start)
    stop = text[stop_at:stop_at + 2]
    body = {"prompt": [start], "max_tokens": 12, "logprobs": 0, "stop": [stop, "never-there"]}
    got = merge_completion_chunks(served.sse("/v1/completions", dict(body, stream=True))) if stream else \
        served.post("/v1/completions", body).json()["choices"][0]
    assert got["text"] == text[:stop_at] and got["finish_reason"] == "stop"
    kept = [t for t, o in zip(chain, offsets) if o < stop_at]
    assert got["logprobs"]["tokens"] == [served.table.names[t] for t in kept]  # the partial token keeps all its bytes
    if not stream:
        assert got["stop_reason"] == stop
    served.wait_idle()  # the stop cancelled the rest: the slot is free


def test_eos_and_stop_token_ids(served_eos):
    server = served_eos
    chain = server.chain(7, 5)
    eos = server.ctx.core.manifest["eos_token_id"]
    assert chain[2] == eos
    stopped = server.post("/v1/completions", {"prompt": [7], "max_tokens": 5, "logprobs": 0,
                                              "return_token_ids": True}).json()
    assert stopped["usage"]["completion_tokens"] == 3  # the terminating EOS counts and is listed, as in vLLM
    stopped = stopped["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"], stopped["token_ids"]) == ("stop", None, chain[:3])
    assert len(stopped["logprobs"]["tokens"]) == 2  # ... but has no logprob entry (the contract)
    ignored = server.post("/v1/completions", {"prompt": [7], "max_tokens": 5, "logprobs": 0, "ignore_eos": True,
                                              "return_token_ids": True}).json()["choices"][0]
    assert (ignored["finish_reason"], ignored["token_ids"]) == ("length", chain)  # an ignored EOS keeps its place
    assert ignored["logprobs"]["tokens"] == [server.table.names[t] for t in chain]
    by_id = server.post("/v1/completions", {"prompt": [7], "max_tokens": 5, "logprobs": 0, "ignore_eos": True,
                                            "stop_token_ids": [chain[3]], "return_token_ids": True}).json()
    assert (by_id["choices"][0]["finish_reason"], by_id["choices"][0]["token_ids"]) == ("stop", chain[:4])
    assert (by_id["choices"][0]["stop_reason"], len(by_id["choices"][0]["logprobs"]["tokens"])) == (chain[3], 3)


# -- errors: every rejection is a 400 before admission ----------------------------------------------
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "x"}]
REJECTIONS = [  # (server, path, body, param, message part)
    ("served", CMPL, {"prompt": [1], "logprobs": 21}, "logprobs", "logprobs must be between 0 and 20, got 21"),
    ("served", CMPL, {"prompt": [1], "logprobs": -1}, "logprobs", "logprobs=-1 asks for the logprobs of the whole "
     "vocabulary (250 tokens, as in vLLM); this core reports at most 20 alternatives per position"),
    ("served", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "whole vocabulary"),
    ("served", CMPL, {"prompt": [1], "prompt_logprobs": -1}, "prompt_logprobs", "whole vocabulary"),
    ("served", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ("served", CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs", "`logprobs` must be set to true"),
    ("served", CMPL, {"prompt": [1], "logprob_token_ids": [1]}, "logprob_token_ids", "`logprobs` must be set"),
    ("served", CHAT, {"messages": USER, "logprob_token_ids": [1]}, "logprob_token_ids", "must be set to true"),
    ("served", CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": [3, 3]}, "logprob_token_ids",
     "duplicate id 3"),
    ("served", CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": [250]}, "logprob_token_ids", "outside"),
    ("served", CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": list(range(129))}, "logprob_token_ids",
     "1 to 128 ids, got 129"),
    ("served", CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": []}, "logprob_token_ids", "got 0"),
    ("served", CMPL, {"prompt": [1], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream=True"),
    ("served", CHAT, {"messages": USER, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream=True"),
    ("served", CMPL, {"prompt": [1], "prompt_logprobs": 21}, "prompt_logprobs", "between 0 and 20, got 21"),
    ("served", CMPL, {"prompt": [1, 250]}, "prompt", "prompt token id 250 is outside the vocabulary"),
    ("served", CMPL, {"prompt": []}, "prompt", "at least one token"),
    ("served", CMPL, {"max_tokens": 3}, "prompt", "prompt is required"),
    ("served", CMPL, {"prompt": [[1], [2, 250]]}, "prompt", "prompt 1 of 2: prompt token id 250 is outside"),
    ("served", CMPL, {"prompt": ["a", "\ud800b"]}, "prompt", "prompt 1 of 2: prompt contains a lone surrogate "
     "(U+D800) at character 0"),
    ("served", CHAT, {"messages": [{"role": "user", "content": "x\udfffy"}]}, "messages[0].content",
     "lone surrogate (U+DFFF) at character 1"),
    ("served", CMPL, {"prompt": [1], "n": 5}, "n", "n = 5 is more than this core's 4 slots"),
    ("served", CMPL, {"prompt": [1], "n": 3, "best_of": 2}, "best_of", "greater than or equal to n"),
    ("served", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("served", CMPL, {"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options", "stream=True"),
    ("served", CMPL, {"prompt": [1], "max_tokens": "a"}, "max_tokens", "valid integer"),
    ("served", CMPL, {"prompt": [1], "max_tokens": -1}, "max_tokens", "max_tokens must be >= 0"),
    ("served", CMPL, {"prompt": [1], "top_p": 0}, "top_p", "sampling parameters out of range: top_p must be > 0.0"),
    ("served", CMPL, {"prompt": [1], "top_k": 2**40}, "top_k", "top_k must be <="),
    ("served", CMPL, {"prompt": [1], "seed": 2**70}, "seed", "int64"),
    ("served", CMPL, {"prompt": [1], "stop_token_ids": [999]}, "stop_token_ids", "outside the vocabulary"),
    ("served", CHAT, {"messages": USER, "continue_final_message": True}, "continue_final_message", "Cannot set both"),
    ("served", CHAT, {"messages": []}, "messages", "at least one message"),
    ("served", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "only text"),
    ("served", CHAT, {"messages": USER, "chat_template": "{{ raise_exception('no system role') }}"}, "messages",
     "no system role"),
    ("served_eos", CMPL, {"prompt": [1], "prompt_logprobs": 0}, "prompt_logprobs", "without prompt scoring"),
    ("served_eos", CMPL, {"prompt": [1], "echo": True, "logprobs": 1}, "echo", "without prompt scoring"),
    ("served_eos", CHAT, {"messages": USER}, "messages", "no chat template (neither chat_template.jinja nor"),
    ("served_plain", CMPL, {"prompt": [1], "logprobs": 0}, "logprobs", "allow_logprobs: false"),
    ("served_plain", CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": [2]}, "logprobs", "allow_logprobs"),
    ("served_plain", CMPL, {"prompt": [1], "prompt_logprobs": 0}, "prompt_logprobs", "without prompt scoring"),
    ("served_plain", CMPL, {"prompt": "text"}, "prompt", "has no tokenizer"),
    ("served_plain", CHAT, {"messages": USER, "chat_template": "x"}, "messages", "has no tokenizer"),
    ("served_plain", CMPL, {"prompt": [1], "stop": "x"}, "stop", "need a tokenizer"),
]


@pytest.mark.parametrize("server, path, body, param, message", REJECTIONS,
                         ids=[f"{r[0]}-{r[3]}-{i}" for i, r in enumerate(REJECTIONS)])
def test_rejections_are_400_before_admission(request, monkeypatch, server, path, body, param, message):
    served = request.getfixturevalue(server)
    admitted = []
    engine = served.ctx.engine.engine
    monkeypatch.setattr(engine, "submit", lambda r, submit=engine.submit: admitted.append(r) or submit(r))
    response = served.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
    assert message in error["message"]
    assert admitted == []


def test_other_errors_use_the_envelope(served, monkeypatch):
    json_type = {"content-type": "application/json"}
    response = httpx.post(served.url + CMPL, content=b'{"prompt": [1], "temperature": NaN}', headers=json_type)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    response = httpx.post(served.url + CMPL, content=b"{not json", headers=json_type)
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    missing = served.post(CMPL, {"model": "other", "prompt": [1]})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"  # as vLLM answers
    spec = served.ctx.core.spec
    monkeypatch.setattr(served.ctx.core, "_spec",
                        dataclasses.replace(spec, features=dataclasses.replace(spec.features, explicit_ids=False)))
    response = served.post(CMPL, {"prompt": [1], "logprobs": 0, "logprob_token_ids": [2]})
    assert response.status_code == 400 and "does not support logprob_token_ids" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # the official client sees the same envelope
        served.client.completions.create(model="toy", prompt=[1], logprobs=30)
    assert caught.value.body["param"] == "logprobs"


# -- a core whose graph fails while it runs ------------------------------------------------------------
def test_a_core_run_error_fails_its_requests_with_a_500_and_the_server_goes_on(served, monkeypatch, caplog):
    from ignition.runtime.verified import CoreRunError

    def failing(name):
        def run(buffers):
            raise CoreRunError(f"variant {name}: the core's graph failed: IndexError: index 300 is out of bounds")
        return run

    for name, variant in served.ctx.core.variants.items():
        monkeypatch.setattr(variant, "run", failing(name))
    body = {"model": "toy", "prompt": [5, 6], "max_tokens": 3}
    with caplog.at_level(logging.ERROR, logger="ignition.serve"):
        response = served.post("/v1/completions", body)
        events = served.sse("/v1/completions", {**body, "stream": True})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert error["message"].startswith("core error: variant ") and "index 300 is out of bounds" in error["message"]
    assert error["message"].split()[3].rstrip(":") in served.ctx.core.variants  # names the variant that failed
    assert events[-1]["error"]["message"].startswith("core error: variant ")  # a stream ends with the error event
    core_errors = [r for r in caplog.records if r.name == "ignition.serve" and "core error" in r.getMessage()]
    assert len(core_errors) == 2 and all(r.exc_info is None for r in core_errors)  # once per failed step, no traceback
    monkeypatch.undo()  # the core runs again: the same server serves the next request
    assert served.ctx.engine.dead is None
    served.wait_idle()  # the failed requests' slots were freed
    choice = served.client.completions.create(model="toy", prompt=[5, 6], max_tokens=3).choices[0]
    assert choice.text == served.text(served.chain(6, 3)) and choice.finish_reason == "length"


# -- lifecycle: disconnects, concurrency, bounded queues ---------------------------------------------
@pytest.fixture
def slow_engine(served, monkeypatch):
    """Steps take 10 ms and cancels are recorded, so a long request is still running when its client leaves."""
    engine, cancelled = served.ctx.engine.engine, []
    monkeypatch.setattr(engine, "step", lambda step=engine.step: time.sleep(0.01) or step())
    monkeypatch.setattr(engine, "cancel", lambda rid, cancel=engine.cancel: cancelled.append(rid) or cancel(rid))
    return cancelled


def test_disconnect_mid_stream_frees_the_slot(served, slow_engine):
    body = {"prompt": [1], "max_tokens": 5000, "logprobs": 2, "stream": True}
    with httpx.stream("POST", served.url + CMPL, json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert served.ctx.engine.load()["running"] == 1
    load = served.wait_idle()
    assert load["free_slots"] == 4 and len(slow_engine) == 1 and slow_engine[0].startswith("cmpl-")


def test_disconnect_while_waiting_for_a_full_response(served, slow_engine):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + CHAT, json={"messages": USER, "max_tokens": 5000}, timeout=0.5)
    served.wait_idle()
    assert len(slow_engine) == 1 and slow_engine[0].startswith("chatcmpl-")


def test_concurrent_requests_all_complete_correctly(served):
    starts = list(range(40, 72))
    expected = served.reference.generate([Request([t], max_tokens=8, logprobs=2) for t in starts])
    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)

    async def one(index: int, start: int):
        if index % 2:
            chunks = [c async for c in await client.completions.create(
                model="toy", prompt=[start], max_tokens=8, logprobs=2, stream=True)]
            return merge_completion_chunks([c.model_dump() for c in chunks])
        return (await client.completions.create(model="toy", prompt=[start], max_tokens=8, logprobs=2)
                ).choices[0].model_dump()

    async def everything():
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(i, t) for i, t in enumerate(starts))), timeout=60)

    results = asyncio.run(everything())
    for got, want in zip(results, expected):
        assert got["text"] == served.text(want.token_ids)
        assert got["logprobs"]["token_logprobs"] == [e.logprob for e in want.entries]
        assert got["logprobs"]["top_logprobs"] == completion_expectation(served, want.entries)["top_logprobs"]
    served.wait_idle()


def test_output_queue_is_bounded_and_coalesces(served):
    from ignition.serve.engine import AsyncEngine

    expected = served.generate([9], max_tokens=40, logprobs=1)

    async def run():
        engine = AsyncEngine(Engine(served.reference.core), queue_capacity=2)
        engine.start()
        try:
            stream = await engine.submit(Request([9], max_tokens=40, logprobs=1, request_id="slow-reader"))
            state = engine._tracked["slow-reader"].state
            while state.finish_reason is None:
                await asyncio.sleep(0.01)  # the whole request runs while nobody reads
            await asyncio.sleep(0.05)
            assert stream.queue.qsize() == 2  # bounded: the rest waits in the engine, coalesced
            entries, finish = [], None
            while finish is None:
                delta = await stream.get()
                entries += delta.entries
                finish = delta.finish_reason
            assert (finish, [e.id for e in entries]) == ("length", expected.token_ids)
            assert [e.logprob for e in entries] == [e.logprob for e in expected.entries]
            assert engine.load()["tracked"] == 0 and "slow-reader" not in engine.engine.finished
        finally:
            engine.stop()

    asyncio.run(run())


# -- presentation rules the toy cannot produce: -inf, forced tokens -------------------------------------
def test_minus_infinity_is_clamped_and_forced_tokens_have_no_entry(served):
    from ignition.serve.detokenize import Span
    from ignition.serve.protocol import CompletionLogProbs
    from ignition.serve.logprobs import Presenter, add_completion_logprobs, chat_logprobs, prompt_logprobs

    presenter, inf = Presenter(served.table), float("-inf")
    spans = [Span(10, TokenEntry(10, inf, [(11, inf)]), 0), Span(12, TokenEntry(12, None), 1), Span(13, None, 2)]
    out = CompletionLogProbs()
    add_completion_logprobs(out, spans, presenter, 5)
    names = served.table.names
    assert out.tokens == [names[10], names[13]] and out.text_offset == [5, 7]
    assert out.token_logprobs == [-9999.0, None]
    assert out.top_logprobs == [{names[10]: -9999.0, names[11]: -9999.0}, None]
    assert [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in chat_logprobs(spans, presenter)] == [
        (names[10], -9999.0, [-9999.0])]
    rows = prompt_logprobs([None, {"id": 3, "logprob": inf, "rank": 250, "top_logprobs": [{"id": 4, "logprob": inf}]}],
                           presenter)
    assert rows[0] is None and (rows[1][3].logprob, rows[1][3].rank, rows[1][4].rank) == (-9999.0, 250, 1)


def test_ignition_serve_command(serving_cores, tmp_path):
    """The CLI's server options end to end, in one process start: a tokenizer directory whose template is only
    in chat_template.jinja (as Hugging Face saves it), --api-key, --max-model-len, --enable-docs, request logs."""
    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(serving_cores[1] / "tokenizer", tokenizer_dir)
    (tokenizer_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", "from ignition.cli import main; main()", "serve",
                                    str(serving_cores[1]), "--port", str(port), "--served-model-name", "b",
                                    "--api-key", "sekret", "--tokenizer", str(tokenizer_dir), "--max-model-len", "64",
                                    "--enable-docs"], stdout=subprocess.DEVNULL, stderr=stderr)
    url, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekret"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:  # open without the key
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "ignition serve did not come up"
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        (card,) = httpx.get(url + "/v1/models", headers=key).json()["data"]
        assert (card["id"], card["max_model_len"], card["features"]["chat_template"]) == ("b", 64, True)
        chat = httpx.post(url + CHAT, headers=key, json={"model": "b", "messages": USER, "max_tokens": 2,
                                                         "return_token_ids": True}, timeout=30).json()
        assert chat["prompt_token_ids"] == byte_fallback_tokenizer().encode(
            "<|user|>x<|assistant|>", add_special_tokens=False).ids
        too_long = httpx.post(url + CMPL, headers=key, json={"prompt": [1, 2], "max_tokens": 63}, timeout=30)
        assert too_long.status_code == 400 and "64 tokens" in too_long.json()["error"]["message"]
        assert httpx.get(url + "/openapi.json").status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert f"{chat['id']} finished (length): {len(chat['prompt_token_ids'])} prompt tokens, 2 generated tokens" \
        in log.read_text()
