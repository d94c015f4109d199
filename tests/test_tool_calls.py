"""Tool calling (issue 26, item 2): the hermes and llama3_json parsers on text, and Chat and Responses on a live server.

The parsers are driven with text, cut at every character boundary: the streamed events must add up to the
whole reading, and every verbatim event must repeat the output characters of its source range. The server
runs the toy core with a hand-made byte-level tokenizer whose greedy chain spells a hermes tool call after
some content (TOOL_CHAIN), so the official openai client and LangChain's ``bind_tools`` read real calls.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response as SdkResponse
from safetensors.torch import load_file
from typer.testing import CliRunner

from _served import Served
from test_responses import EVENT_MODELS, strict
from ignition.catalog.hashing import dump_json, sha256_file
from ignition.recipes.toy import batch_invariant_logits
from ignition.serve.config import ServeConfig
from ignition.serve.detokenize import Span, byte_level_alphabet
from ignition.serve.parsers import CONTENT, OutputParser, ThinkParser, TokenAttribution
from ignition.serve.tool_parsers import (TOOL_CALL, HermesToolParser, Llama3JsonToolParser, ToolCallingParser,
                                         call_head)
from ignition.serve.tools import ToolCallReader, tool_use

VOCAB = 250
TOOL_CHAIN = ["Let", "Ġme", "Ġcheck.", "ĊĊ<tool_call>Ċ", '{"name":', 'Ġ"get_weather",', 'Ġ"arguments":',
              'Ġ{"city":', 'Ġ"Paris"}}', "Ċ</tool_call>"]
CONTENT_TEXT, CALL = "Let me check.", ("get_weather", '{"city": "Paris"}')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


# -- parsers on text ------------------------------------------------------------------------------
def read(parser_class, pieces, output=OutputParser):
    """(content, [(name, arguments)], events) of the pieces read in order."""
    parser = ToolCallingParser(output(), parser_class())
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    calls = []
    for event in events:
        if event.kind == TOOL_CALL:
            if event.name is not None:
                assert event.index == len(calls) and event.text == "" and event.source is None
                calls.append([event.name, ""])
            else:
                calls[event.index][1] += event.text
    return "".join(e.text for e in events if e.kind == CONTENT), [tuple(c) for c in calls], events


HERMES = [
    ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [CALL]),
    ('<tool_call>\n{"name": "a", "arguments": {"s": "}</tool_call>\\"{"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>', "", [("a", '{"s": "}</tool_call>\\"{"}'), ("b", "{}")]),
    ('<tool_call>{"arguments": {"x": [1, 2]}, "name": "late"}</tool_call> then text', "then text",
     [("late", '{"x": [1, 2]}')]),  # arguments before the name: held whole, re-serialized
    ("<tool_call>not json</tool_call> x", "<tool_call>not json</tool_call> x", []),  # not a call: content
    ('a < b <tool_ca', "a < b <tool_ca", []),
    ('<tool_call>{"name": "cut", "arguments": {"q": [1, ', "", [("cut", '{"q": [1, ')]),  # cut by max_tokens
    ('<tool_call>{"name": "n", "arguments": 7}</tool_call>', "", [("n", "7")]),
    ("no calls at all \n", "no calls at all \n", []),
]
LLAMA = [
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z;"}}', "",
     [("a", '{"x": 1}'), ("b", '{"y": "z;"}')]),
    (' {"name": "get_weather", "parameters": {"city": "Paris"}} ', "", [("get_weather", '{"city": "Paris"}')]),
    ('{"parameters": {"q": 1}, "name": "n"}', "", [("n", '{"q": 1}')]),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),  # calls start the output
    ('{"oops": 1} tail', '{"oops": 1} tail', []),
]


@pytest.mark.parametrize("parser_class, text, content, calls",
                         [(HermesToolParser, *case) for case in HERMES] + [(Llama3JsonToolParser, *c) for c in LLAMA])
def test_parsers_read_the_same_calls_however_the_text_is_cut(parser_class, text, content, calls):
    whole = read(parser_class, [text])
    assert whole[:2] == (content, calls)
    for event in whole[2]:
        if event.source is not None:  # verbatim text repeats its source
            assert text[event.source[0]:event.source[1]] == event.text
    for cut in range(len(text) + 1):
        assert read(parser_class, [text[:cut], text[cut:]])[:2] == whole[:2], cut
    assert read(parser_class, list(text))[:2] == whole[:2]


def test_call_head_and_the_think_parser_underneath():
    assert call_head('<tool_call>{"name": "f", "arguments": {', 11, ("arguments",)) == ("f", 38)
    assert call_head('<tool_call>{"name": "f", "argu', 11, ("arguments",)) is None
    assert call_head('<tool_call>{"nam": "f"', 11, ("arguments",)) is False
    assert call_head('{"name": "", "parameters": {}', 0, ("parameters",)) is False  # a call needs a name
    text = '<think>\nplan\n</think>\n\nok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls, events = read(HermesToolParser, list(text), ThinkParser)
    assert (content, calls) == ("ok", [("f", '{"a": 1}')])
    assert [e.text for e in events if e.kind == "reasoning"] and "".join(
        e.text for e in events if e.kind == "reasoning") == "plan"


def test_tool_call_tokens_get_no_output_text_entries():
    """Responses' attribution: a token's entry goes with the content its first byte lies in; call tokens get none."""
    pieces = [p.replace("Ġ", " ").replace("Ċ", "\n") for p in TOOL_CHAIN] + ["Done"]
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    for cuts in ([], [4], [3, 7, 9], list(range(1, len(pieces)))):
        attribution = TokenAttribution(ToolCallingParser(OutputParser(), HermesToolParser()), lambda t: True)
        events = []
        for a, b in zip([0, *cuts], [*cuts, len(pieces)]):
            events += attribution.feed("".join(pieces[a:b]), [Span(i, None, offsets[i]) for i in range(a, b)])
        events += attribution.finish()
        selected = [s.token_id for event, spans in events for s in spans]
        assert selected == [0, 1, 2, 10], cuts  # "\n\n<tool_call>\n" starts in stripped whitespace: none
        assert "".join(e.text for e, _ in events if e.kind == CONTENT) == CONTENT_TEXT + "Done"


def test_reader_streams_what_the_full_reading_reports():
    use = tool_use(ServeConfig(tool_call_parser="hermes", enable_auto_tool_choice=True), [WEATHER], None, False)
    text = "".join(p.replace("Ġ", " ").replace("Ċ", "\n") for p in TOOL_CHAIN) * 2  # two calls
    whole = ToolCallReader(use, OutputParser())
    whole.step(text, [], final=True)
    streamed = ToolCallReader(use, OutputParser())
    deltas = [d for ch in text for d in streamed.step(ch, [], final=False)[1]] + streamed.step("", [], True)[1]
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls()] == [CALL, CALL]
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls()] == [CALL, CALL]
    first = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name) for d in first] == [(0, "function", "get_weather"),
                                                                   (1, "function", "get_weather")]
    assert all(d.id.startswith("chatcmpl-tool-") for d in first)
    assert all(d.id is None and d.type is None and d.function.name is None for d in deltas if d not in first)
    pieces = [p.replace("Ġ", " ").replace("Ċ", "\n") for p in TOOL_CHAIN] * 2  # token by token, as served
    for size in (1, 2, 3, len(pieces)):
        reader, arguments = ToolCallReader(use, OutputParser()), {}
        for start in range(0, len(pieces), size):
            step = reader.step("".join(pieces[start:start + size]), [], final=start + size >= len(pieces))[1]
            assert len({d.index for d in step}) == len(step), (size, step)  # one entry per index per chunk
            for d in step:
                arguments[d.index] = arguments.get(d.index, "") + d.function.arguments
        assert [json.loads(a) for a in arguments.values()] == [{"city": "Paris"}] * 2, size
    single = tool_use(ServeConfig(tool_call_parser="hermes", enable_auto_tool_choice=True), [WEATHER], "auto", True,
                      parallel=False)
    reader = ToolCallReader(single, OutputParser())
    assert {d.index for d in reader.step(text, [], final=True)[1]} == {0}  # parallel_tool_calls: false


# -- the server --------------------------------------------------------------------------------------
def _tokenizer(start: int, chain: list[int]):
    from tokenizers import Tokenizer
    singles = [c for c in byte_level_alphabet() if c not in ("q", *TOOL_CHAIN)]
    pieces, fillers = {start: "q", **dict(zip(chain, TOOL_CHAIN))}, iter(singles)
    vocab = {pieces[i] if i in pieces else next(fillers): i for i in range(VOCAB)}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}}))


@pytest.fixture(scope="module")
def core(toy_core, tmp_path_factory):
    """The toy core with a tokenizer whose greedy chain from "q" spells TOOL_CHAIN; returns (dir, the id after it)."""
    dest = tmp_path_factory.mktemp("tools") / "core"
    shutil.copytree(toy_core, dest)
    weights = load_file(str(dest / "weights.safetensors"))
    successor = batch_invariant_logits(weights["embedding.weight"], weights["lm_head.weight"])[:, :VOCAB].argmax(1)

    def chain(token, n):
        out = []
        for _ in range(n):
            out.append(token := int(successor[token]))
        return out
    n = len(TOOL_CHAIN) + 1
    start = next(t for t in range(VOCAB) if len({t, *chain(t, n)}) == n + 1)
    ids = chain(start, n)
    (dest / "tokenizer").mkdir()
    _tokenizer(start, ids[:-1]).save(str(dest / "tokenizer" / "tokenizer.json"))
    (dest / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages[-1]['content'] }}", "eos_token": None, "bos_token": None}))
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["tokenizer"] = "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        manifest["files"][f"tokenizer/{name}"] = sha256_file(dest / "tokenizer" / name)
    (dest / "manifest.json").write_bytes(dump_json(manifest))
    return dest, ids[-1]


@pytest.fixture(scope="module")
def served(core):
    config = ServeConfig(allow_request_chat_template=True, tool_call_parser="hermes", enable_auto_tool_choice=True)
    server = Served(core[0], config=config)
    yield server, core[1]
    server.close()


def _chat(stop_id: int, **fields) -> dict:
    """A request whose greedy output is exactly TOOL_CHAIN, ended by the id after it (finish_reason "stop")."""
    return {"model": "toy", "messages": [{"role": "user", "content": "q"}], "tools": [WEATHER],
            "stop_token_ids": [stop_id], **fields}


def test_chat_reports_tool_calls_to_the_official_client(served):
    server, stop_id = served
    body = _chat(stop_id, logprobs=True)
    response = server.client.chat.completions.create(**{k: body[k] for k in ("model", "messages", "tools")},
                                                     logprobs=True, extra_body={"stop_token_ids": [stop_id]})
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT_TEXT
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", *CALL)
    assert call.id.startswith("chatcmpl-tool-") and json.loads(call.function.arguments) == {"city": "Paris"}
    # Chat keeps every token's entry, the call's too, as vLLM's chat serving does
    assert "".join(e.token for e in choice.logprobs.content) == "".join(TOOL_CHAIN).replace("Ġ", " ").replace(
        "Ċ", "\n")
    raw = server.post("/v1/chat/completions", body).json()
    assert ChatCompletion.model_validate(raw).choices[0].message.tool_calls[0].function.name == CALL[0]
    none = server.post("/v1/chat/completions", _chat(stop_id, tool_choice="none")).json()["choices"][0]
    assert none["finish_reason"] == "stop" and none["message"]["tool_calls"] == []
    assert none["message"]["content"] == "".join(TOOL_CHAIN).replace("Ġ", " ").replace("Ċ", "\n")
    cut = server.post("/v1/chat/completions", _chat(stop_id, max_tokens=8)).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == "{\"city\":"


def test_chat_stream_deltas_add_up_to_the_full_response(served):
    server, stop_id = served
    full = server.post("/v1/chat/completions", _chat(stop_id, logprobs=True)).json()["choices"][0]
    chunks = server.sse("/v1/chat/completions", _chat(stop_id, logprobs=True, stream=True))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert content == CONTENT_TEXT and deltas[-1]["finish_reason"] == "tool_calls"
    first = calls[0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["name"] == "get_weather"
    # issue 50, finding 8: at most one entry per index per chunk (vLLM, OpenAI), so a client reading
    # delta.tool_calls[0] (instructor's partial parsing) sees every argument character
    for d in deltas:
        indexes = [t["index"] for t in d["delta"].get("tool_calls", [])]
        assert len(indexes) == len(set(indexes)), d
    assert "".join(d["delta"]["tool_calls"][0]["function"]["arguments"] for d in deltas
                   if d["delta"].get("tool_calls")) == full["message"]["tool_calls"][0]["function"]["arguments"]
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == full["message"]["tool_calls"][0]["function"][
        "arguments"]
    entries = [e for d in deltas for e in (d["logprobs"] or {}).get("content", [])]
    assert entries == full["logprobs"]["content"]
    for d in deltas:  # a chunk's entries are those of the tokens it releases: content tokens come with their text
        tokens = "".join(e["token"] for e in (d["logprobs"] or {}).get("content", []))
        if d["delta"].get("content"):
            assert tokens.startswith(d["delta"]["content"])


def test_tools_reach_the_template_and_tool_messages_render(served):
    server, stop_id = served
    template = ("{% for t in tools %}{{ t.function.name }}{% endfor %}|{% for m in messages %}{% for c in "
                "m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": "none", "chat_template": template,
            "max_tokens": 1, "return_token_ids": True}
    ids = server.post("/v1/chat/completions", body).json()["prompt_token_ids"]
    assert server.text(ids) == "get_weather|aXsunny"  # arguments reach the template parsed (vLLM, HF templates)
    bad = dict(body, messages=[dict(messages[1], tool_calls=[{"type": "function", "function": {
        "name": "f", "arguments": "{"}}])])
    response = server.post("/v1/chat/completions", bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == \
        "messages[0].tool_calls[0].function.arguments"


REFUSALS = [
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`: 'sometimes'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name", "Field required"),
]


@pytest.mark.parametrize("fields, param, message", REFUSALS, ids=[r[1] + str(i) for i, r in enumerate(REFUSALS)])
def test_tool_fields_are_refused_by_name(served, fields, param, message):
    server, _ = served
    response = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_required_and_named_choices_need_a_core_the_grammar_can_end(served):
    """``required`` and a named function are enforced by the grammar engine (tests/test_structured_serving.py), which
    needs an end-of-sequence token: on this toy core, which declares none, they are a 400 naming ``tool_choice`` and
    the missing EOS, never an unconstrained generation. Their grammar is valid llguidance Lark for both parsers."""
    llguidance = pytest.importorskip("llguidance")
    server, stop_id = served
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = server.post("/v1/chat/completions", _chat(stop_id, tool_choice=choice))
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
        assert "end-of-sequence" in response.json()["error"]["message"]
    second = {"type": "function", "function": {"name": "other"}}
    for parser in ("hermes", "llama3_json"):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            use = tool_use(ServeConfig(tool_call_parser=parser), [WEATHER, second], choice, True)
            grammar = use.grammar()
            assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
            assert ('"const": "other"' in grammar) == (choice == "required")
            assert ('<tool_call>' in grammar) == (parser == "hermes")


def test_auto_needs_the_parser_and_the_option(served):
    """vLLM's rule and message: auto (the default with tools) needs --enable-auto-tool-choice and a parser."""
    server, stop_id = served
    config = server.ctx.config
    for enable, parser in ((False, "hermes"), (False, None)):
        config.enable_auto_tool_choice, config.tool_call_parser = enable, parser
        try:
            response = server.post("/v1/chat/completions", _chat(stop_id))
            responses = server.post("/v1/responses", {"input": "q", "tools": [{"type": "function", "name": "f"}]})
        finally:
            config.enable_auto_tool_choice, config.tool_call_parser = True, "hermes"
        for answer in (response, responses):
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
            assert answer.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                         "--tool-call-parser to be set")
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServeConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser 'xml'"):
        ServeConfig(tool_call_parser="xml")
    from ignition.cli import app
    for args, message in ((["--tool-call-parser", "xml"], "--tool-call-parser must be one of hermes, llama3_json"),
                          (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser")):
        result = CliRunner().invoke(app, ["serve", str(server.core_dir), *args])
        assert result.exit_code == 2 and message in result.output, result.output


# -- Responses --------------------------------------------------------------------------------------
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


def _responses_stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/responses", json=dict(body, stream=True), timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    for number, event in enumerate(events):
        assert event["sequence_number"] == number
        strict(EVENT_MODELS[event["type"]], event)
    return events


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_items(served, stream):
    server, stop_id = served
    body = {"model": "toy", "input": "q", "tools": [RESPONSES_TOOL], "stop_token_ids": [stop_id],
            "include": ["message.output_text.logprobs"]}
    if stream:
        events = _responses_stream(server.url, body)
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        call_index = next(i for i, item in enumerate(final["output"]) if item["type"] == "function_call")
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert "".join(deltas) == done["arguments"] == final["output"][call_index]["arguments"]
        added = next(e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == call_index)
        assert added["item"]["arguments"] == "" and added["item"]["name"] == "get_weather"
    else:
        final = server.post("/v1/responses", body).json()
    response = strict(SdkResponse, final)
    message, call = response.output
    assert (message.type, message.content[0].text) == ("message", CONTENT_TEXT)
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", *CALL, "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    # output-text entries only for the content's tokens: the call's tokens have none
    assert [e.token for e in message.content[0].logprobs] == ["Let", " me", " check."]


def test_responses_take_earlier_calls_and_their_outputs(served):
    server, stop_id = served
    template = "{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}{{ c.function.name }}" \
               "{% endfor %}{{ m.content }};{% endfor %}"
    server.ctx.config.allow_request_chat_template = True
    config_template, server.ctx.chat_template = server.ctx.chat_template, template
    try:
        body = {"input": [{"role": "user", "content": "a"},
                          {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
                "tools": [RESPONSES_TOOL], "tool_choice": "none", "max_output_tokens": 1}
        response = server.post("/v1/responses", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["input_tokens"] == len("user:a;assistant:get_weather;tool:sunny;")
    finally:
        server.ctx.chat_template = config_template


def test_langchain_bind_tools(served):
    """LangChain's bind_tools through the openai client parses the server's calls (issue 26's done-when)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    server, stop_id = served

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"
    model = langchain_openai.ChatOpenAI(model="toy", base_url=server.url + "/v1", api_key="none", max_retries=0,
                                        extra_body={"stop_token_ids": [stop_id]})
    message = model.bind_tools([get_weather]).invoke("q")
    assert message.content == CONTENT_TEXT
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(model.bind_tools([get_weather]).stream("q"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]
