"""runtime/grammar.py and runtime/grammar_spec.py: request fields -> compiled grammars -> bitmask rows.

A fake "model" drives each matcher the way the engine will: fill the step's bitmask row, pick a token the row
allows, accept it. Two pickers: ``closing`` takes the allowed token ranked first by a fixed preference (EOS,
then closing quotes and brackets, separators, other punctuation, letters and digits, whitespace last), which
gives the shortest documents; ``explorer`` picks uniformly at random among the allowed tokens for 40 steps,
then closes like ``closing``. A picker that has not ended 50 steps after it started closing picks among the
three best-ranked allowed tokens (a grammar may not accept after every digit, e.g. a bounded decimal). The
produced bytes must be valid UTF-8, parse as JSON and validate against the schema with ``jsonschema`` (an
independent validator), for every schema (``_grammar_cases.SCHEMAS``), with the closing picker and three seeds
of the explorer.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import numpy as np
import pytest

from _grammar_cases import SCHEMAS, byte_level_bpe, preference, token_pieces
from ignition.catalog.contract import bitmask_words
from ignition.runtime import grammar as grammar_module
from ignition.runtime.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSetupError, GrammarViolation
from ignition.runtime.grammar_spec import GrammarSpec, grammar_spec

REGULAR = 2000
VOCAB_PADDED = 2048 + 32  # padded past the tokenizer's 2003 ids, like real checkpoints
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def vocabulary():
    text, eos = byte_level_bpe(REGULAR)
    return text, eos, token_pieces(text)


@pytest.fixture(scope="module")
def compiler(vocabulary):
    text, eos, _ = vocabulary
    compiler = GrammarCompiler(text, VOCAB_PADDED, eos)
    yield compiler
    compiler.close()


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def drive(compiler: GrammarCompiler, spec: GrammarSpec, pieces, eos: int, explore_steps: int = 0,
          seed: int = 0) -> bytes:
    """Run the fake model under ``spec``; the bytes it produced (EOS excluded)."""
    matcher = compiler.matcher(compiler.compile(spec))
    rank, rng = preference(pieces, eos), random.Random(seed)
    row = np.zeros(compiler.words, dtype=np.int32)
    produced = []
    for step in range(MAX_STEPS):
        if matcher.stopped:
            return b"".join(pieces[t] for t in produced)
        matcher.fill(row)
        allowed = allowed_ids(row)
        assert allowed.size and allowed.max() < VOCAB_PADDED, (spec.kind, step)
        if step < explore_steps:
            visible = [t for t in allowed if t != eos and t in pieces and not pieces[t].isspace()]
            token = rng.choice(visible or list(allowed))
        elif step < explore_steps + 50:
            token = min(allowed, key=rank)
        else:
            token = rng.choice(sorted(allowed, key=rank)[:3])
        if token == eos:
            assert matcher.accepting
            matcher.accept(token)
            assert matcher.stopped
            return b"".join(pieces[t] for t in produced)
        matcher.accept(int(token))
        produced.append(int(token))
    pytest.fail(f"{spec.param}: no end after {MAX_STEPS} steps: {b''.join(pieces[t] for t in produced)[:200]!r}")


def schema_spec(schema) -> GrammarSpec:
    return grammar_spec(response_format={"type": "json_schema",
                                         "json_schema": {"name": "out", "schema": schema, "strict": True}})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_generated_json_validates_against_the_schema(compiler, vocabulary, name):
    _, eos, pieces = vocabulary
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    outputs = set()
    for explore, seed in ((0, 0), (40, 1), (40, 2), (40, 3)):
        data = drive(compiler, schema_spec(schema), pieces, eos, explore_steps=explore, seed=seed)
        instance = json.loads(data.decode("utf-8"))  # strict UTF-8, then strict JSON
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, (name, data, errors)
        outputs.add(data)
    assert len(outputs) > 1 or name in ("const", "mixed_enum"), (name, outputs)  # the explorer explores


def test_twenty_schemas_cover_the_issue_constructs():
    assert len(SCHEMAS) >= 20
    text = json.dumps(SCHEMAS)
    for construct in ("anyOf", "enum", "minItems", "maxItems", '"$ref"', "required", "pattern"):
        assert construct in text


def test_json_object_and_free_json(compiler, vocabulary):
    _, eos, pieces = vocabulary
    for explore, seed in ((0, 0), (40, 5)):
        data = drive(compiler, grammar_spec(response_format={"type": "json_object"}), pieces, eos, explore, seed)
        assert isinstance(json.loads(data.decode()), dict)
        data = drive(compiler, grammar_spec(structured_outputs={"json_object": True}), pieces, eos, explore, seed)
        assert isinstance(json.loads(data.decode()), dict)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]+", r"(yes|no|maybe)!?", r"\d+(\.\d{1,2})?"])
def test_regex(compiler, vocabulary, pattern):
    _, eos, pieces = vocabulary
    for explore, seed in ((0, 0), (30, 1), (30, 2)):
        data = drive(compiler, grammar_spec(structured_outputs={"regex": pattern}), pieces, eos, explore, seed)
        assert re.fullmatch(pattern, data.decode()), (pattern, data)


def test_choice(compiler, vocabulary):
    _, eos, pieces = vocabulary
    choices = ["positive", "negative", 'neutral "quoted"', "héllo"]
    seen = {drive(compiler, grammar_spec(structured_outputs={"choice": choices}), pieces, eos, 5, seed).decode()
            for seed in range(12)}
    assert seen <= set(choices) and len(seen) > 1


@pytest.mark.parametrize("grammar,pattern", [
    ('start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]{1,5}/', r"(hi|hello) [A-Z][a-z]{1,5}"),
    ('root ::= "(" digit+ ")"\ndigit ::= [0-9]', r"\([0-9]+\)"),  # GBNF, as vLLM's xgrammar backend takes
])
def test_lark_and_gbnf_grammars(compiler, vocabulary, grammar, pattern):
    _, eos, pieces = vocabulary
    for explore, seed in ((0, 0), (20, 3)):
        data = drive(compiler, grammar_spec(structured_outputs={"grammar": grammar}), pieces, eos, explore, seed)
        assert re.fullmatch(pattern, data.decode()), data


@pytest.mark.parametrize("schema,constructs", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, ("not",)),
    ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, ("else", "if", "then")),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ("uniqueItems",)),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, ("dependentRequired",)),
])
def test_unsupported_schema_construct_is_named(compiler, schema, constructs):
    with pytest.raises(GrammarError) as raised:
        compiler.compile(schema_spec(schema))
    assert raised.value.param == "response_format" and raised.value.constructs == constructs
    assert all(c in str(raised.value) for c in constructs) and "unsupported JSON Schema keyword" in str(raised.value)


@pytest.mark.parametrize("fields,param,message", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(?<=a)b"}}}, "structured_outputs.json",
     "look-around"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 2}}}, "structured_outputs.json",
     "minimum (5) is greater than maximum (2)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}}},
     "response_format", "does not exist"),
    ({"structured_outputs": {"json": {"type": "string", "format": "frobnicate"}}}, "structured_outputs.json",
     "Unknown format"),
])
def test_uncompilable_specs_raise_grammar_error(compiler, fields, param, message):
    with pytest.raises(GrammarError) as raised:
        compiler.compile(grammar_spec(**fields))
    assert raised.value.param == param and message in str(raised.value), str(raised.value)


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": {"type": "x"}}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_malformed_request_fields(fields, param):
    with pytest.raises(GrammarError) as raised:
        grammar_spec(**fields)
    assert raised.value.param == param


def test_spec_parsing():
    assert grammar_spec() is None and grammar_spec(response_format={"type": "text"}) is None
    assert grammar_spec(structured_outputs={"json": None, "regex": None}) is None
    spec = grammar_spec(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"b": {}, "a": {}}}}})
    assert (spec.kind, spec.source) == (  # order kept; closed as vLLM's default backend (xgrammar) closes it
        "json", '{"type":"object","properties":{"b":{},"a":{}},"additionalProperties":false}')
    assert grammar_spec(structured_outputs={"json": '{"type": "integer"}'}).source == '{"type":"integer"}'
    # vLLM's walk (backend_guidance._walk_json_for_additional_properties): objects that list properties are
    # closed wherever they sit; an object without properties, data (const) and an explicit choice stay as written
    schema = {"type": "object", "properties": {
        "o": {"type": "object"}, "type": {"const": {"type": "object", "properties": {}}},
        "l": {"items": {"properties": {}}}, "open": {"properties": {"x": {}}, "additionalProperties": True}},
        "$defs": {"d": {"anyOf": [{"patternProperties": {"^a": {}}}]}}}
    closed = {"type": "object", "additionalProperties": False, "properties": {
        "o": {"type": "object"}, "type": {"const": {"type": "object", "properties": {}}},
        "l": {"items": {"properties": {}, "additionalProperties": False}},
        "open": {"properties": {"x": {}}, "additionalProperties": True}},
        "$defs": {"d": {"anyOf": [{"patternProperties": {"^a": {}}, "additionalProperties": False}]}}}
    for flag in (True, False):
        found = grammar_spec(structured_outputs={"json": schema, "disable_additional_properties": flag})
        assert json.loads(found.source) == closed
    tight = grammar_spec(structured_outputs={"json_object": True, "disable_any_whitespace": True})
    assert (tight.kind, tight.whitespace_flexible) == ("json_object", False)
    assert grammar_spec(structured_outputs={"choice": ["a", "b"]}).source == '["a","b"]'


def test_whitespace_options_apply_to_response_format_with_a_server_default():
    """Issue 50, finding 9: structured_outputs' whitespace options were dropped beside response_format."""
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    for response_format in (schema, {"type": "json_object"}):
        assert grammar_spec(response_format=response_format).whitespace_flexible
        spec = grammar_spec(response_format=response_format,
                            structured_outputs={"disable_any_whitespace": True, "whitespace_pattern": " ?"})
        assert (spec.param, spec.whitespace_flexible, spec.whitespace_pattern) == ("response_format", False, " ?")
        assert not grammar_spec(response_format=response_format, disable_any_whitespace=True).whitespace_flexible
        assert grammar_spec(response_format=response_format, structured_outputs={"disable_any_whitespace": False},
                            disable_any_whitespace=True).whitespace_flexible  # the request's own setting wins
    assert not grammar_spec(structured_outputs={"json": {}}, disable_any_whitespace=True).whitespace_flexible
    with pytest.raises(GrammarError) as raised:
        grammar_spec(response_format=schema, structured_outputs={"disable_any_whitespace": "yes"})
    assert raised.value.param == "structured_outputs.disable_any_whitespace"


def test_disable_any_whitespace_allows_no_whitespace(compiler, vocabulary):
    _, eos, pieces = vocabulary
    spec = grammar_spec(structured_outputs={"json": SCHEMAS["flat_required"], "disable_any_whitespace": True})
    matcher = compiler.matcher(compiler.compile(spec))
    row = np.zeros(compiler.words, dtype=np.int32)
    for token in (pieces_id(pieces, b'{"'),):
        matcher.fill(row)
        assert not any(b" " in pieces.get(t, b"") for t in allowed_ids(row))
        matcher.accept(token)
        matcher.fill(row)
        assert not any(pieces.get(t, b"").isspace() for t in allowed_ids(row))


def pieces_id(pieces, piece: bytes) -> int:
    return next(i for i, p in pieces.items() if p == piece)


def test_matcher_rejects_a_disallowed_token_and_rolls_back(compiler, vocabulary):
    _, eos, pieces = vocabulary
    matcher = compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"choice": ["yes", "no"]})))
    row = np.zeros(compiler.words, dtype=np.int32)
    matcher.fill(row)
    first = set(allowed_ids(row))
    assert pieces_id(pieces, b"y") in first and pieces_id(pieces, b"x") not in first and eos not in first
    matcher.accept(pieces_id(pieces, b"y"))
    matcher.rollback(1)
    matcher.fill(row)
    assert set(allowed_ids(row)) == first
    with pytest.raises(GrammarViolation, match="not allowed by the choice constraint"):
        matcher.accept(pieces_id(pieces, b"x"))
    with pytest.raises(ValueError, match="contiguous int32"):
        compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"regex": "a"}))).fill(
            np.zeros(compiler.words, dtype=np.int64))


def test_fill_many_equals_one_by_one(compiler, vocabulary):
    _, eos, pieces = vocabulary
    specs = [schema_spec(SCHEMAS[name]) for name in ("flat_required", "int_array_bounds", "string_pattern")]
    specs.append(grammar_spec(structured_outputs={"regex": "[a-c]+x"}))
    matchers = [compiler.matcher(compiler.compile(spec)) for spec in specs]
    for matcher, prefix in zip(matchers, (b'{"', b"[1", b'"AB', b"ab")):
        for byte in prefix:
            matcher.accept(pieces_id(pieces, bytes([byte])))
    batch = np.zeros((6, compiler.words), dtype=np.int32)
    GrammarMatcher.fill_many([(m, i + 1) for i, m in enumerate(matchers)], batch)
    assert not batch[0].any() and not batch[5].any()
    for index, matcher in enumerate(matchers, 1):
        single = np.zeros(compiler.words, dtype=np.int32)
        matcher.fill(single)
        np.testing.assert_array_equal(batch[index], single)


@pytest.mark.parametrize("name", ["nested_objects", "string_pattern", "int_array_bounds"])
def test_prefetched_rows_equal_synchronous_fills(compiler, vocabulary, name):
    """Two matchers walk one document: one prefetches after every accepted token (the engine's overlap), the other
    fills synchronously; every row is equal, through ``fill`` and ``fill_many``, and a prefetch in flight is
    waited for by ``accept``, ``fork``, ``stopped`` and ``rollback`` (a second prefetch is a no-op)."""
    _, eos, pieces = vocabulary
    compiled = compiler.compile(schema_spec(SCHEMAS[name]))
    ahead, plain = compiler.matcher(compiled), compiler.matcher(compiled)
    rank = preference(pieces, eos)
    row, expected = np.zeros(compiler.words, dtype=np.int32), np.zeros(compiler.words, dtype=np.int32)
    batch = np.zeros((3, compiler.words), dtype=np.int32)
    ahead.prefetch()
    for step in range(200):
        if plain.stopped:
            break
        plain.fill(expected)
        if step % 2:
            GrammarMatcher.fill_many([(ahead, 2)], batch)
            row[:] = batch[2]
        else:
            ahead.prefetch()  # already in flight or done: nothing new
            ahead.fill(row)
        np.testing.assert_array_equal(row, expected)
        token = int(min(allowed_ids(expected), key=rank))
        if step == 3:  # a prefetch in flight, then a fork and a rollback wait for it
            ahead.prefetch()
            fork = ahead.fork()
            ahead.accept(token)
            ahead.prefetch()
            ahead.rollback(1)
            fork.fill(row)
            np.testing.assert_array_equal(row, expected)
        plain.accept(token)
        ahead.accept(token)
        assert ahead.stopped == plain.stopped
        ahead.prefetch()
    else:
        pytest.fail("the document did not end")
    assert ahead.stopped


def test_a_matcher_dropped_with_a_prefetch_in_flight(compiler, vocabulary):
    """A request finished or cancelled while its next row fills: the worker keeps the row alive until it ends
    (freeing it under llguidance's write corrupted the heap in an early version)."""
    compiled = compiler.compile(schema_spec(SCHEMAS["nested_objects"]))
    pattern = 0x5A5A5A5A
    for _ in range(100):
        matcher = compiler.matcher(compiled)
        matcher.prefetch()
        del matcher
        probe = np.full(compiler.words, pattern, dtype=np.int32)  # the allocator hands out a freed row's block first
        grammar_module._prefetcher().submit(lambda: None).result()
        time.sleep(0.001)  # both workers idle: any fill of a dropped matcher has ended
        assert (probe == pattern).all(), "a prefetch wrote into memory it no longer owned"
    row = np.zeros(compiler.words, dtype=np.int32)
    compiler.matcher(compiled).fill(row)
    assert row.any()


def test_compile_runs_on_worker_threads_and_is_cached(compiler, monkeypatch):
    calls, threads = [], []
    compile_one = GrammarCompiler._compile

    def counting(self, spec):
        calls.append(spec.key)
        threads.append(threading.current_thread().name)
        return compile_one(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", counting)
    spec = schema_spec({"type": "object", "required": ["cache"], "properties": {"cache": {"type": "integer"}}})
    results = []
    workers = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(calls) == 1 and threads[0].startswith("grammar") and threads[0] != threading.main_thread().name
    assert all(r is results[0] for r in results) and compiler.submit(spec).result() is results[0]
    bad = schema_spec({"not": {}})
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(bad)
    assert calls.count(bad.key) == 1  # a failure is cached too
    matchers = [compiler.matcher(results[0]) for _ in range(2)]
    matchers[0].accept(next(iter(allowed_after(compiler, matchers[0]))))
    assert allowed_after(compiler, matchers[1]) != allowed_after(compiler, matchers[0])  # independent copies


def allowed_after(compiler, matcher) -> set[int]:
    row = np.zeros(compiler.words, dtype=np.int32)
    matcher.fill(row)
    return set(allowed_ids(row).tolist())


def test_cache_is_bounded(vocabulary):
    text, eos, _ = vocabulary
    compiler = GrammarCompiler(text, VOCAB_PADDED, eos, cache_size=2)
    try:
        first = compiler.submit(grammar_spec(structured_outputs={"regex": "a"}))
        for pattern in ("b", "c"):
            compiler.compile(grammar_spec(structured_outputs={"regex": pattern}))
        assert compiler.submit(grammar_spec(structured_outputs={"regex": "a"})) is not first
    finally:
        compiler.close()


def test_setup_errors(vocabulary):
    text, _, _ = vocabulary
    with pytest.raises(GrammarSetupError, match="end-of-sequence"):
        GrammarCompiler(text, VOCAB_PADDED, None)
    with pytest.raises(GrammarSetupError, match="tokenizer cannot drive"):
        GrammarCompiler("{not a tokenizer", VOCAB_PADDED, 0)


def test_row_width_is_the_core_bitmask(compiler):
    assert compiler.words == bitmask_words(VOCAB_PADDED) == VOCAB_PADDED // 32
    assert grammar_module.__all__  # the public names import cleanly
