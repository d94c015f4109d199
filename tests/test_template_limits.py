"""Request-template bounds are checked before the work (issue 24, finding 9), and chat_template_kwargs cannot
replace the variables the server sets (finding 11): each payload is refused fast, without allocating its result."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from ignition.serve.config import TemplateLimits
from ignition.serve.templates import TemplateLimitError, render_bounded

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

EXPENSIVE = {  # each ran seconds or allocated gigabytes before the 400 (or never stopped) without a pre-check
    "power": "{{ (10**4096)**2048 }}",
    "product": "{% set x = 10**4000 %}{{ x * x * x * x * x * x }}",
    "format-width": '{{ "{:>2000000000}".format(1) }}',
    "format-precision": '{{ "{:.2000000000f}".format(1.0) }}',
    "format-nested-spec": '{{ "{:{w}}".format(1, w=2000000000) }}',
    "format-map": '{{ "{a:>2000000000}".format_map({"a": 1}) }}',
    "percent-star": '{{ "%*s" % (2000000000, "x") }}',
    "percent-mapping": '{{ "%(a)2000000000s" % {"a": 1} }}',
    "format-filter-star": "{{ '%*s'|format(2000000000, 'x') }}",
    "join-separator": '{{ range(100000)|join("y" * 4000000) }}',
    "join-items": '{% set s = "x" * 4000000 %}{{ [s, s, s]|join }}',
    "tojson-indent": "{{ {'a': [1, 2, 3]}|tojson(indent=2000000000) }}",
    "tojson-indent-string": "{{ {'a': [1, 2, 3]}|tojson(indent='x' * 1000000) }}",
    "repeat": '{{ ("x" * 4000000) * 2 }}',
    "repeat-list": "{{ [0] * 3000000000 }}",
    "concatenation": '{{ "x" * 4000000 + "y" * 4000000 }}',
    "indent": '{{ ("x\n" * 1000000)|indent(4000) }}',
    # issue 50, finding 7: 2*10^9 characters built before the output check (3.4 s against a 1 s limit)
    "str-replace": '{% set s = "x" * 40000 %}{{ s.replace("x", "y" * 50000) }}',
    "str-join": '{{ ("y" * 4000000).join(["a", "b", "c"]) }}',
    "str-join-iterator": '{{ ("y" * 4000000).join(range(2000)|map("string")) }}',
    "str-expandtabs": '{{ ("\t" * 1000000).expandtabs(4000) }}',
}


@pytest.mark.parametrize("source", EXPENSIVE.values(), ids=EXPENSIVE.keys())
def test_expensive_operations_are_refused_before_they_run(source):
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(TemplateLimitError) as caught:
            render_bounded(source, TemplateLimits(), {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 0.5, caught.value
    assert peak < 64 * 1024 * 1024, f"{peak} bytes allocated before the refusal: {caught.value}"
    assert "bound" in str(caught.value) or "allowed" in str(caught.value) or "may not" in str(caught.value)


def test_ordinary_templates_still_render():
    assert render_bounded("{{ 'a-b-c'.replace('-', ', ', 1) }}|{{ '+'.join(['x', 'y']) }}|{{ ', '.join(['p', 'q']|map('upper')) "
                          "}}|{{ 'a\tb'.expandtabs(3) }}", TemplateLimits(), {}) == "a, b-c|x+y|P, Q|a  b"
    source = ("{{ 3 ** 40 }}|{{ '%5s|%-3d'|format('a', 7) }}|{{ '{:>6}'.format('b') }}|{{ [1, 2]|join(', ') }}|"
              "{{ {'k': [1]}|tojson(indent=2) }}|{{ 'ab' * 3 }}|{{ 'x\ny'|indent(2) }}|{{ '%s!' % 'hey' }}")
    assert render_bounded(source, TemplateLimits(), {}) == (
        f"{3 ** 40}|    a|7  |     b|1, 2|" + '{\n  "k": [\n    1\n  ]\n}' + "|ababab|x\n  y|hey!")


def test_indented_json_stops_at_the_output_bound():
    limits = TemplateLimits(max_output_bytes=10_000)
    with pytest.raises(TemplateLimitError, match="tojson"):
        render_bounded("{{ ([[1]] * 1000)|tojson(indent=16) }}", limits, {})
    assert render_bounded("{{ ([[1]] * 10)|tojson(indent=1) }}", limits, {}).count("\n") == 31


def test_the_integer_bound_is_the_limit_not_a_constant():
    with pytest.raises(TemplateLimitError, match="at most 64 bits"):
        render_bounded("{{ 2 ** 70 }}", TemplateLimits(max_int_bits=64), {})
    assert render_bounded("{{ 2 ** 60 }}", TemplateLimits(max_int_bits=64), {}) == str(2 ** 60)


def test_a_power_over_http_is_a_fast_400(served):
    started = time.perf_counter()
    response = served.post(CHAT, {"messages": USER, "chat_template": "{{ (10**4096)**2048 }}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"
    assert "bits" in response.json()["error"]["message"]
    assert time.perf_counter() - started < 2
    assert served.http.get("/health").status_code == 200


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "eos_token"])
def test_chat_template_kwargs_cannot_replace_the_servers_variables(served, key):
    response = served.post(CHAT, {"messages": USER, "chat_template_kwargs": {key: "x"}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{key}"
    assert repr(key) in error["message"] and "reserved" in error["message"]


def test_other_chat_template_kwargs_reach_the_template(served):
    body = {"messages": USER, "chat_template": "{{ greeting }}", "chat_template_kwargs": {"greeting": "hello"},
            "max_tokens": 1}
    response = served.post("/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == served.ctx.encode("hello", False, "prompt") or response.json()["count"] > 0


LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def test_the_cores_chat_template_is_bounded_too(served, monkeypatch):
    """Issue 50, finding 6: a core template looping 10^10 times pinned a preprocessing thread per request."""
    monkeypatch.setattr(served.ctx, "chat_template", LOOPING)
    for _ in range(3):  # each request used to take a thread for good: two would stop every other request
        started = time.perf_counter()
        response = served.post(CHAT, {"messages": USER, "max_tokens": 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "the chat template" in error["message"], error
        assert "steps" in error["message"] or "rendered for more than" in error["message"], error
        assert time.perf_counter() - started < 3
    assert served.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    monkeypatch.setattr(served.ctx, "chat_template", "{{ messages[0]['content'].replace('', 'L' * 10000000) }}")
    error = served.post(CHAT, {"messages": USER, "max_tokens": 1}).json()["error"]
    assert "str.replace" in error["message"] and "bound" in error["message"], error
