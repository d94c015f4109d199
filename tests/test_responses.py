"""POST /v1/responses against a live server, checked with the openai SDK's own models.

The core is the session's toy core with a hand-made byte-level tokenizer: the toy is a greedy
bigram, so the pieces of the ids on one greedy chain spell a reasoning output on purpose
("<think>\\nHmm ok \\n</think>\\n\\nThe answer is 42. <think>"), with a token that starts in
stripped whitespace but carries content ("\\n\\nThe"), and a literal "<think>" inside content.
"""

from __future__ import annotations

import json
import random
import shutil
import typing

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from safetensors.torch import load_file
from typer.testing import CliRunner

from _served import Served
from ignition.catalog.hashing import dump_json, sha256_file
from ignition.recipes.toy import batch_invariant_logits
from ignition.serve.config import ServeConfig
from ignition.serve.detokenize import Span, byte_level_alphabet
from ignition.serve.parsers import CONTENT, REASONING, OutputParser, ParsedText, ThinkParser, TokenAttribution

VOCAB = 250
# the greedy chain's pieces, in byte-level notation (Ġ is a space, Ċ a newline)
THINK_CHAIN = ["<think>", "Ċ", "Hmm", "Ġok", "ĠĊ", "</think>", "ĊĊThe", "Ġanswer", "Ġis", "Ġ42", ".", "Ġ<think>"]
REASONING_TEXT, CONTENT_TEXT = "Hmm ok", "The answer is 42. <think>"
CONTENT_TOKENS = 5  # "Ġanswer" .. "Ġ<think>": "ĊĊThe" starts in stripped whitespace and gets no entry
INCLUDE = ["message.output_text.logprobs"]
EVENT_MODELS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def strict(model, data: dict):
    """The SDK model of ``data``, refusing fields the SDK does not know anywhere inside it."""
    parsed = model.model_validate(data)

    def walk(value, where):
        if isinstance(value, pydantic.BaseModel):
            assert not value.model_extra, f"{where}: fields unknown to the SDK: {sorted(value.model_extra)}"
            for name in type(value).model_fields:
                walk(getattr(value, name), f"{where}.{name}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
    walk(parsed, model.__name__)
    return parsed


def _tokenizer(start: int, chain: list[int]):
    """A byte-level BPE without merges: ``q`` is the chain's start, the chain's ids spell THINK_CHAIN."""
    from tokenizers import Tokenizer
    singles = [c for c in byte_level_alphabet() if c not in ("q", *THINK_CHAIN)]
    pieces = {start: "q", **dict(zip(chain, THINK_CHAIN))}
    fillers = iter(singles)
    vocab = {pieces[i] if i in pieces else next(fillers): i for i in range(VOCAB)}
    config = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
              "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True},
              "post_processor": None,
              "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
              "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                        "ignore_merges": False, "vocab": vocab, "merges": []}}
    return Tokenizer.from_str(json.dumps(config))


@pytest.fixture(scope="module")
def core(toy_core, tmp_path_factory):
    """The session's toy core, copied, with the tokenizer and a template that renders the last message alone."""
    dest = tmp_path_factory.mktemp("responses") / "core"
    shutil.copytree(toy_core, dest)
    weights = load_file(str(dest / "weights.safetensors"))
    successor = batch_invariant_logits(weights["embedding.weight"], weights["lm_head.weight"])[:, :VOCAB].argmax(1)

    def chain(token, n):
        out = []
        for _ in range(n):
            out.append(token := int(successor[token]))
        return out
    start = next(t for t in range(VOCAB) if len({t, *chain(t, len(THINK_CHAIN))}) == len(THINK_CHAIN) + 1)
    (dest / "tokenizer").mkdir()
    _tokenizer(start, chain(start, len(THINK_CHAIN))).save(str(dest / "tokenizer" / "tokenizer.json"))
    (dest / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages[-1]['content'] }}", "eos_token": None, "bos_token": None}))
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["tokenizer"] = "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        manifest["files"][f"tokenizer/{name}"] = sha256_file(dest / "tokenizer" / name)
    (dest / "manifest.json").write_bytes(dump_json(manifest))
    return dest, start


@pytest.fixture(scope="module")
def server(core):
    """A live server on the THINK_CHAIN core (its tokenizer is this module's own, so not a session server)."""
    served = Served(core[0])
    yield served.url, served.client, served.app
    served.close()


@pytest.fixture
def think(server):
    """The same server with the <think> parser (``ignition serve --reasoning-parser think``)."""
    config = server[2].state.ctx.config
    assert config.reasoning_parser == "plain"
    config.reasoning_parser = "think"
    yield server
    config.reasoning_parser = "plain"


def sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/responses", json=dict(body, stream=True), timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    for number, event in enumerate(events):
        assert event["sequence_number"] == number
        strict(EVENT_MODELS[event["type"]], event)
    return events


def _without_bytes(logprobs: list[dict]) -> list[dict]:
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs]


def check_stream(events: list[dict]) -> dict:
    """Event order, and deltas that add up to the final response; returns the final response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed"  # also when incomplete, as vLLM streams it (the SDK waits for it)
    expected = []
    for item in final["output"]:
        text_kind = "output_text" if item["type"] == "message" else "reasoning_text"
        expected += ["response.output_item.added", "response.content_part.added",
                     f"response.{text_kind}.delta", f"response.{text_kind}.done",
                     "response.content_part.done", "response.output_item.done"]
    collapsed = [k for i, k in enumerate(kinds[2:-1]) if not (k.endswith(".delta") and kinds[2:-1][i - 1] == k)]
    assert collapsed == expected
    for index, item in enumerate(final["output"]):
        deltas = [e for e in events if e.get("output_index") == index and e["type"].endswith(".delta")]
        text = item["content"][0]["text"]
        assert "".join(e["delta"] for e in deltas) == text
        done = next(e for e in events if e.get("output_index") == index and e["type"].endswith("text.done"))
        assert done["text"] == text and done["item_id"] == item["id"]
        assert next(e for e in events if e["type"] == "response.output_item.done"
                    and e["output_index"] == index)["item"] == item
        if item["type"] == "message" and item["content"][0]["logprobs"] is not None:
            logprobs = _without_bytes(item["content"][0]["logprobs"])
            assert [lp for e in deltas for lp in e["logprobs"]] == logprobs == done["logprobs"]
    strict(SdkResponse, final)
    return final


# -- parsers, driven directly ---------------------------------------------------------------------
def test_think_parser_ranges_and_attribution():
    """Every chunking of a reasoning output gives the same items, verbatim sources and selected tokens."""
    pieces = ["<think>", "\n", "Hmm", " ok", " \n", "</think>", "\n\nThe", " answer", "", " is", " 42.", " <think>"]
    text = "".join(pieces)
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    spans = [Span(i, None, o) for i, o in enumerate(offsets)]  # token i has the bytes of pieces[i]
    rng = random.Random(0)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(pieces)), rng.randint(0, len(pieces) - 1)))
        attribution = TokenAttribution(ThinkParser(), lambda t: bool(pieces[t]))
        events = []
        for a, b in zip([0, *cuts], [*cuts, len(pieces)]):  # releases at token boundaries, as TextStream's
            events += attribution.feed("".join(pieces[a:b]), spans[a:b])
            assert all(s.offset >= attribution.parser.consumed for s in attribution.waiting)  # no decided token waits
        events += attribution.finish()
        for kind, expected in ((REASONING, "Hmm ok"), (CONTENT, "The answer is 42. <think>")):
            assert "".join(e.text for e, _ in events if e.kind == kind) == expected
        for event, _ in events:
            assert text[event.source[0]:event.source[1]] == event.text
        assert [s.token_id for _, selected in events for s in selected] == [7, 9, 10, 11]  # 8 has no bytes
        assert attribution.reasoning_tokens == 6
    opened = TokenAttribution(ThinkParser("<|assistant|><think>\n"), lambda t: True)
    events = opened.feed("plan\n</think> done", [Span(0, None, 0), Span(1, None, 4), Span(2, None, 14)])
    events += opened.finish()
    assert [(e.kind, e.text, [s.token_id for s in sel]) for e, sel in events] == [
        ("reasoning", "plan", []), ("content", "done", [2])]
    plain = TokenAttribution(OutputParser(), lambda t: True)
    events = plain.feed(" <think>a", [Span(0, None, 0), Span(1, None, 1)]) + plain.finish()
    assert [(e.kind, e.text, len(sel)) for e, sel in events] == [("content", " <think>a", 2)]
    class Synthetic(OutputParser):  # a parser that writes text of its own: no source, so no token
        def feed(self, text):
            self.consumed += len(text)
            return [ParsedText(CONTENT, "[" + text + "]", None)]
    synthetic = TokenAttribution(Synthetic(), lambda t: True)
    assert [(e.text, sel) for e, sel in synthetic.feed("ab", [Span(0, None, 0)]) + synthetic.finish()] == [
        ("[ab]", [])]
    assert not synthetic.waiting
    unclosed = TokenAttribution(ThinkParser(), lambda t: True)
    events = unclosed.feed("<think> still </thi", [Span(0, None, 0), Span(1, None, 7)]) + unclosed.finish()
    assert [(e.kind, e.text) for e, _ in events] == [("reasoning", "still"), ("reasoning", " </thi")]
    assert unclosed.reasoning_tokens == 2 and unclosed.parser.reasoning_range == (0, 19)


# -- plain output: logprobs equal Completions' ---------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_output_text_logprobs_equal_completions(server, core, stream):
    url, client, _ = server
    reference = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": [core[1]], "max_tokens": 8, "logprobs": 3, "return_tokens_as_token_ids": True}).json()
    reference = reference["choices"][0]["logprobs"]
    body = {"model": "toy", "input": "q", "max_output_tokens": 8, "include": INCLUDE, "top_logprobs": 3,
            "return_tokens_as_token_ids": True}
    final = check_stream(sse_events(url, body)) if stream else \
        strict(SdkResponse, httpx.post(url + "/v1/responses", json=body, timeout=60).json()).model_dump()
    (message,) = final["output"]
    assert (final["status"], final["incomplete_details"]["reason"]) == ("incomplete", "max_output_tokens")
    assert final["usage"]["input_tokens"] == 1 and final["usage"]["output_tokens"] == 8
    logprobs = message["content"][0]["logprobs"]
    assert [e["token"] for e in logprobs] == reference["tokens"]  # token_id:N on both sides
    assert [e["logprob"] for e in logprobs] == reference["token_logprobs"]
    for entry, top in zip(logprobs, reference["top_logprobs"]):
        assert len(entry["top_logprobs"]) == 3
        assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == list(top.items())  # greedy: chosen first

    response = client.responses.create(model="toy", input=[{"role": "user", "content": "q"}], max_output_tokens=8,
                                       include=INCLUDE, top_logprobs=0)  # the official client, names as text
    names = [e.token for e in response.output[0].content[0].logprobs]
    assert response.output_text == "".join(THINK_CHAIN[:8]).replace("Ġ", " ").replace("Ċ", "\n")
    assert all(not e.top_logprobs for e in response.output[0].content[0].logprobs)
    assert "".join(names) == response.output_text
    stopped = check_stream(sse_events(url, {"input": "q", "stop": ["Hmm"], "max_output_tokens": 8, "include": INCLUDE}))
    assert (stopped["status"], stopped["output"][0]["content"][0]["text"]) == ("completed", "<think>\n")
    assert [e["token"] for e in stopped["output"][0]["content"][0]["logprobs"]] == ["<think>", "\n"]
    plain = client.responses.create(model="toy", input="q", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs is None and plain.usage.output_tokens == 3


# -- the <think> parser on the live server -----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_item_and_content_only_logprobs(think, stream):
    url, client, _ = think
    body = {"model": "toy", "input": "q", "max_output_tokens": len(THINK_CHAIN), "include": INCLUDE,
            "top_logprobs": 2}
    if stream:
        final = check_stream(sse_events(url, body))
    else:
        final = strict(SdkResponse, httpx.post(url + "/v1/responses", json=body, timeout=60).json()).model_dump()
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                         "text": REASONING_TEXT}]
    assert (reasoning["status"], message["status"]) == ("completed", "incomplete")
    (part,) = message["content"]
    assert part["text"] == CONTENT_TEXT
    assert [bytes(e["bytes"]).decode() for e in part["logprobs"]] == [" answer", " is", " 42", ".", " <think>"]
    assert len(part["logprobs"]) == CONTENT_TOKENS and all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    sdk = client.responses.create(model="toy", input="q", max_output_tokens=len(THINK_CHAIN), include=INCLUDE)
    assert sdk.output_text == CONTENT_TEXT and sdk.output[0].content[0].text == REASONING_TEXT
    streamed = list(client.responses.create(model="toy", input="q", max_output_tokens=4, stream=True))
    assert (streamed[-1].type, streamed[-1].response.status) == ("response.completed", "incomplete")
    assert streamed[-1].response.output[0].type == "reasoning" and len(streamed[-1].response.output) == 1
    with client.responses.stream(model="toy", input="q", max_output_tokens=len(THINK_CHAIN), include=INCLUDE) as s:
        accumulated = [event for event in s][-1].response  # the SDK's own accumulator over the events
        final_response = s.get_final_response()  # raised before: the stream ended without response.completed
    assert accumulated.output_text == CONTENT_TEXT and accumulated.status == "incomplete"
    assert (final_response.status, final_response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert final_response.output_text == CONTENT_TEXT


# -- errors ----------------------------------------------------------------------------------------
REJECTIONS = [  # (body changes, status, param, message part)
    ({"top_logprobs": 2}, 400, "top_logprobs", "needs include"),
    ({"include": INCLUDE, "top_logprobs": 21}, 400, "top_logprobs", "between 0 and 20, got 21"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include", "not supported"),
    ({"tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice", "requires --enable-auto-tool-choice"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "only function tools"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "not stored"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "text.format", "not supported"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id", "needs a string call_id"),
    ({"input": [{"type": "file_search_call"}]}, 400, "input[0]", "expected a message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content[0]", "only text"),
    ({"input": []}, 400, "input", "at least one item"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens", "max_output_tokens must be >= 0"),
    ({"model": "other"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("change, status, param, message", REJECTIONS, ids=[r[2] + str(i) for i, r in
                                                                              enumerate(REJECTIONS)])
def test_rejections_use_the_error_envelope(server, change, status, param, message):
    response = httpx.post(server[0] + "/v1/responses", json={"input": "q", **change}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and message in error["message"], error


def test_official_client_sees_the_envelope_and_the_cli_checks_the_parser(server, tmp_path):
    with pytest.raises(openai.BadRequestError) as caught:
        server[1].responses.create(model="toy", input="q", top_logprobs=3)
    assert caught.value.body["param"] == "top_logprobs"
    from ignition.cli import app
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--reasoning-parser", "xml"])
    assert result.exit_code == 2 and "--reasoning-parser must be one of plain, think, got 'xml'" in result.output


def test_a_failure_after_admission(server):
    """A loader failure: a 500 in the envelope, or, once streaming, an error event and response.failed."""
    import asyncio

    from ignition.serve.errors import ApiError, GenerationError
    from ignition.serve.responses import ResponsesRequest, _ResponsesView

    class Failing:
        async def next(self):
            raise GenerationError("the loader failed this request")

    def view():
        return _ResponsesView(server[2].state.ctx, ResponsesRequest(input="q", include=INCLUDE), "resp_1", [0],
                              OutputParser(), True)

    async def stream():
        return [event async for event in view().stream(Failing())]
    events = [json.loads(text.split("data: ", 1)[1]) for text in asyncio.run(stream())]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    for event in events:
        strict(EVENT_MODELS[event["type"]], event)
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the loader failed this request"}
    with pytest.raises(ApiError) as caught:
        asyncio.run(view().full(Failing()))
    assert caught.value.status == 500 and caught.value.err_type == "InternalServerError"


def test_the_server_guards_and_counts_responses_like_chat(served, monkeypatch):
    """On the session's server: a finished response is counted in /metrics; prompt bounds name the Responses
    field; --api-key and --max-body-bytes apply to /v1/responses."""
    from prometheus_client.parser import text_string_to_metric_families

    def successes() -> float:
        return sum(s.value for family in text_string_to_metric_families(served.http.get("/metrics").text)
                   for s in family.samples if s.name == "ignition:request_success_total")
    before = successes()
    assert served.post("/v1/responses", {"input": "hi", "max_output_tokens": 2}).json()["status"] == "incomplete"
    assert successes() == before + 1
    monkeypatch.setattr(served.ctx.config, "api_keys", ("sekret",))
    assert served.post("/v1/responses", {"input": "hi"}).status_code == 401
    ok = served.post("/v1/responses", {"input": "hi", "max_output_tokens": 1},
                     headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["object"] == "response"
    monkeypatch.setattr(served.ctx.config, "api_keys", ())
    monkeypatch.setattr(served.ctx.config, "max_prompt_bytes", 10)
    for body, param in (({"input": "y" * 11}, "input"), ({"input": "y", "instructions": "z" * 11}, "instructions")):
        error = served.post("/v1/responses", body).json()["error"]
        assert error["param"] == param and "at most 10" in error["message"], error
    monkeypatch.setattr(served.ctx.config, "max_body_bytes", 100)
    assert served.post("/v1/responses", {"input": "x" * 200}).status_code == 413
    with pytest.raises(ValueError, match="unknown reasoning parser 'xml'"):
        ServeConfig(reasoning_parser="xml")
