"""Server-side trust findings of issue 50: tokenizing bounded by the context before it starts (finding 4), a
tokenizer's panic answered as a 400 (finding 7), and --structured-outputs-config checked at start (finding 9).

The live servers are conftest's; no core is exported here.
"""

from __future__ import annotations

import resource
import time

import pytest

from _serving_tokenizers import CORPUS

CMPL, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
HUGE = 15_700_000  # characters: under --max-prompt-bytes (16 MiB) and the body bound (32 MiB)


@pytest.fixture
def context(served, monkeypatch) -> int:
    """The served toy declares no context: 512 tokens, as --max-model-len 512 sets it."""
    monkeypatch.setattr(served.ctx.engine.engine, "max_context", 512)
    return 512


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("path,body", [(TOKENIZE, {"prompt": "x"}), (CMPL, {"prompt": "x", "max_tokens": 1}),
                                       (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                                       (TOKENIZE, {"messages": [{"role": "user", "content": "x"}]})])
def test_a_huge_prompt_is_refused_before_it_is_tokenized(served, context, path, body):
    """A 15.7 MB prompt on a 64-token core was tokenized whole first: 14 s of CPU and gigabytes kept."""
    text = ("the cat sat on the mat. " * (HUGE // 24 + 1))[:HUGE]
    body = {**body, **({"prompt": text} if "prompt" in body else
                       {"messages": [{"role": "user", "content": text}]})}
    before = _rss_bytes()
    started = time.perf_counter()
    response = served.post(path, body)
    elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    longest = served.ctx.longest_token
    assert error["param"] == ("prompt" if "prompt" in body else "messages"), error
    assert f"more than the context of {context} tokens" in error["message"]
    assert f"at most {context * longest} characters" in error["message"]
    assert elapsed < 2.0, elapsed  # the body's JSON dominates; tokenizing it took 14 s
    assert _rss_bytes() - before < 256 * 1024 * 1024
    assert served.http.get("/health").status_code == 200


def test_the_bound_is_the_longest_token_times_the_context(served, context):
    """A text at the bound is tokenized (and refused for its tokens); one character more is refused unread."""
    ctx = served.ctx
    vocab = served.tokenizer.get_vocab(with_added_tokens=True)
    assert ctx.max_prompt_chars(1) == max(len(token) for token in vocab) == ctx.longest_token
    bound = ctx.max_prompt_chars(ctx.max_context)
    at_bound = ("ab " * bound)[:bound]
    assert "tokens, more than the context" in served.post(TOKENIZE, {"prompt": at_bound}).json()["error"]["message"]
    over = served.post(TOKENIZE, {"prompt": at_bound + "a"}).json()["error"]["message"]
    assert f"has {bound + 1} characters" in over
    fits = " ".join(CORPUS)[:ctx.max_context]  # at most a token per character
    assert served.post(TOKENIZE, {"prompt": fits}).json()["tokens"] == served.tokenizer.encode(fits).ids


def test_truncation_tokenizes_only_the_end_of_a_huge_prompt(served, context):
    text = " ".join(CORPUS)
    keep = 5
    expected = served.tokenizer.encode(text).ids[-keep:]
    body = {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": keep, "return_token_ids": True}
    assert served.post(CMPL, body).json()["choices"][0]["prompt_token_ids"] == expected
    huge = "x" * (HUGE - len(text)) + text
    started = time.perf_counter()
    response = served.post(CMPL, {**body, "prompt": huge})
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["prompt_token_ids"] == expected
    assert time.perf_counter() - started < 2.0


def test_a_tokenizer_panic_is_a_400(served, monkeypatch):
    """A normalizer regex that backtracks past Oniguruma's retry limit panics in the tokenizers library; pyo3
    raises that as PanicException, a BaseException that passed every ``except Exception`` (a 500)."""
    from tokenizers import Regex, Tokenizer, normalizers

    panicking = Tokenizer.from_str(served.ctx.tokenizer.to_str())
    panicking.normalizer = normalizers.Replace(Regex("(a|a)+b"), "x")
    monkeypatch.setattr(served.ctx, "tokenizer", panicking)
    text = "a" * 40 + "c"
    for path, body, param in ((TOKENIZE, {"prompt": text}, "prompt"),
                              (CMPL, {"prompt": text, "max_tokens": 1}, "prompt"),
                              (CHAT, {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, "messages")):
        response = served.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "the tokenizer cannot tokenize this text" in error["message"], error
        assert "retry-limit" in error["message"], error
    assert served.post(TOKENIZE, {"prompt": "hello"}).status_code == 200


@pytest.mark.parametrize("value,message", [
    ('{"disable_any_whitespace": 1}', "disable_any_whitespace must be a bool, got 1"),
    ('{"backend": "xgrammar"}', "unknown key 'backend' (this server reads disable_any_whitespace"),
    ("[true]", "must be a JSON object"),
    ("{", "--structured-outputs-config is not JSON"),
])
def test_structured_outputs_config_is_checked_at_start(toy_core, value, message):
    from typer.testing import CliRunner

    from ignition.cli import app

    result = CliRunner().invoke(app, ["serve", str(toy_core), "--structured-outputs-config", value])
    assert result.exit_code == 2 and message in result.output, result.output
