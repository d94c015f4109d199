"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis), plus the
non-finite sampling values a JSON body can carry (NaN, Infinity), which the schema cannot express.

Every generated request, schema-valid or not, must get a documented status (never a 5xx) with a
body and content type that conform to /openapi.json. Small example counts keep this under a
minute; set IGNITION_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import collections
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

from _served import serve_in_thread  # noqa: E402
from _serving_tokenizers import byte_level_tokenizer, write_tokenizer_dir  # noqa: E402
from ignition.exporter.export import export_core  # noqa: E402
from ignition.recipes.base import ExportOptions  # noqa: E402
from ignition.serve.app import create_app  # noqa: E402
from ignition.serve.config import ServeConfig  # noqa: E402

EXAMPLES = int(os.environ.get("IGNITION_FUZZ_EXAMPLES", "30"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_TOKENS = 4  # generation length is not what is fuzzed; a toy core has no context bound to stop 2**31 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    core = root / "core"
    export_core(ExportOptions(recipe="toy", capacities=(1, 2), prompt_logprobs=True, chunk_limit=128,
                              tokenizer=write_tokenizer_dir(byte_level_tokenizer(), root / "tok")), core)
    uvicorn_server, thread, url = serve_in_thread(create_app(core, model_name="toy",
                                                             config=ServeConfig(enable_docs=True)))
    yield url
    uvicorn_server.should_exit = True
    thread.join(timeout=10)


VALID_INPUT = {"/v1/completions": ("prompt", [1, 2, 3]),
               "/v1/chat/completions": ("messages", [{"role": "user", "content": "hi"}]),
               "/tokenize": ("prompt", "hi"), "/detokenize": ("tokens", [1, 2, 3]),
               "/v1/responses": ("input", "hi"), "/invocations": ("prompt", [1, 2, 3])}


def prepared(case, path: str, repair: bool) -> None:
    """Bound generation length; with ``repair``, a valid model and prompt so the other fields reach the engine
    (random prompts and model names alone are rejected before anything else is looked at)."""
    if not isinstance(case.body, dict):
        return
    lengths = ("max_output_tokens",) if path == "/v1/responses" else ("max_tokens", "max_completion_tokens")
    for key in lengths:
        if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool):
            case.body[key] = min(case.body[key], MAX_TOKENS)
    if not any(key in case.body for key in lengths):
        case.body[lengths[0]] = MAX_TOKENS  # Chat's and Responses' default without a context bound is 256 tokens
    if repair and path in VALID_INPUT:
        case.body.pop("model", None)
        key, value = VALID_INPUT[path]
        if path == "/invocations" and "messages" in case.body:  # a Chat body: /invocations routes on `messages`
            key, value = VALID_INPUT["/v1/chat/completions"]
        case.body[key] = value


OPERATIONS = [("/health", "GET"), ("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
              ("/v1/responses", "POST"), ("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET"),
              ("/version", "GET"), ("/ping", "GET"), ("/ping", "POST"), ("/v1/models/{model_id}", "GET"),
              ("/invocations", "POST")]
BODILESS = {"/ping"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path, method", OPERATIONS)
def test_openapi_fuzz(server, path, method, mode):
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    operations = {(op.path, op.method.upper()) for op in (r.ok() for r in schema.get_all_operations())}
    assert set(OPERATIONS) == operations, "a new endpoint: add it to OPERATIONS"
    if mode is GenerationMode.NEGATIVE and (method == "GET" or path in BODILESS):
        pytest.skip("GET endpoints take no input to break")
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    examples = EXAMPLES if path.startswith("/v1/") else max(EXAMPLES // 2, 1)  # tokenizer endpoints: less to vary
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy, repair=st.sampled_from([True, True, True, False]))  # mostly repaired: some must reach the engine
    def fuzz(case, repair):
        prepared(case, path, repair)
        response = case.call_and_validate(base_url=server, checks=CHECKS, timeout=30)
        statuses[response.status_code] += 1

    statuses = collections.Counter()
    fuzz()
    if mode is GenerationMode.POSITIVE and method == "POST":
        assert statuses[200] > 0, f"no generated request reached the engine: {dict(statuses)}"


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_values_are_400(server, field, value):
    body = '{"prompt": [1, 2], "max_tokens": 2, "%s": %s}' % (field, value)  # JSON5-style literals Python accepts
    response = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, field)
    assert "finite" in error["message"]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("top_k", -2),
                                          ("min_p", 1.5), ("temperature", -0.1)])
def test_out_of_range_sampling_values_are_400(server, field, value):
    response = httpx.post(server + "/v1/completions", json={"prompt": [1], "max_tokens": 1, field: value}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
