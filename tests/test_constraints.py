"""runtime/constraints.py and bindings.fill_constraints: the host builds each lane's bitmask and bias rows.

The rows are checked against a set-based oracle written from vLLM's definitions: ``allowed_token_ids`` keeps only
those ids; a one-token bad word is always banned, a longer one's last token only when the generated tokens end
with the rest of it; EOS and the stop ids are banned while fewer than ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _grammar_cases import byte_level_bpe, token_pieces
from ignition.catalog.contract import MAX_LOGIT_BIAS, bitmask_words
from ignition.catalog.enums import ValueSource as S
from ignition.catalog.manifest import Features
from ignition.runtime.bindings import Lane, fill_constraints
from ignition.runtime.constraints import (ConstraintConflict, ConstraintError, LaneConstraints, bad_word_sequences,
                                          fill_mask_rows, vocabulary_row)
from ignition.runtime.grammar import GrammarCompiler
from ignition.runtime.grammar_spec import grammar_spec
from ignition.runtime.requests import AdmissionError, Request, check_options


def ids_of(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def oracle(vocab: int, generated: list[int], allowed=None, bad_words=(), min_tokens=0, stop_ids=()) -> set[int] | None:
    """The allowed set by definition; None when nothing constrains the step (an all-zero row)."""
    banned = {seq[-1] for seq in bad_words
              if len(seq) - 1 <= len(generated) and tuple(generated[len(generated) - len(seq) + 1:]) == seq[:-1]}
    if len(generated) < min_tokens:
        banned |= set(stop_ids)
    if allowed is None and not banned:
        return None
    return (set(range(vocab)) if allowed is None else set(allowed)) - banned


@pytest.mark.parametrize("vocab,padded", [(250, 256), (70, 96), (64, 64)])
def test_rows_match_the_definitions(vocab, padded):
    rng = random.Random(vocab)
    for case in range(60):
        allowed = rng.sample(range(vocab), rng.randint(2, 12)) if case % 3 else None
        bad = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 4)))
        min_tokens, stops = rng.randint(0, 3), rng.sample(range(vocab), 2)
        constraints = LaneConstraints.build(vocab, allowed_token_ids=allowed, bad_words=bad, min_tokens=min_tokens,
                                            stop_ids=stops)
        for length in range(5):
            generated = [rng.randrange(vocab) for _ in range(length)]
            if bad and length and rng.random() < 0.5:  # make a multi-token bad word's prefix match
                seq = rng.choice(bad)
                generated = (generated + list(seq[:-1]))[-max(length, len(seq) - 1):]
            want = oracle(vocab, generated, allowed, bad, min_tokens, stops)
            row = np.full(bitmask_words(padded), 12345, dtype=np.int32)
            try:
                masked = constraints.fill_mask(row, generated)
            except ConstraintConflict:
                assert want == set()
                continue
            assert masked == (want is not None)
            assert ids_of(row) == (want or set()), (allowed, bad, min_tokens, generated)


def test_vocabulary_row_never_allows_padding():
    assert ids_of(vocabulary_row(3, 70)) == set(range(70))
    assert ids_of(vocabulary_row(2, 64)) == set(range(64))
    constraints = LaneConstraints.build(70, bad_words=[(5,)])
    row = np.zeros(3, dtype=np.int32)
    assert constraints.fill_mask(row, []) and ids_of(row) == set(range(70)) - {5}


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(allowed_token_ids=[1, 250]), "allowed_token_ids", "outside the vocabulary [0, 250)"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "at least one"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids", "outside the vocabulary"),
    (dict(bad_words=[(1, -2)]), "bad_words", "outside the vocabulary"),
    (dict(bad_words=[()]), "bad_words", "empty"),
    (dict(min_tokens=-1), "min_tokens", "non-negative"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens", "must not exceed max_tokens (4)"),
    (dict(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias", "at most 300"),
    (dict(logit_bias={"abc": 1}), "logit_bias", "not a token id"),
    (dict(logit_bias={"7": float("nan")}), "logit_bias", "finite number"),
    (dict(logit_bias={"7": "high"}), "logit_bias", "finite number"),
    (dict(logit_bias={"7": 1, 7: 2}), "logit_bias", "twice"),
    (dict(logit_bias={"999": 1}), "logit_bias", "outside the vocabulary"),
    (dict(allowed_token_ids=[9], min_tokens=1, stop_ids=[9]), "allowed_token_ids", "only EOS/stop ids"),
])
def test_invalid_constraints_name_the_field(kwargs, param, message):
    with pytest.raises(ConstraintError) as raised:
        LaneConstraints.build(250, **kwargs)
    assert raised.value.param == param and message in str(raised.value)


def test_logit_bias_rows_and_clamping():
    constraints = LaneConstraints.build(250, logit_bias={"7": 250.0, 3: -0.5, "9": -1000})
    ids, values = np.zeros(MAX_LOGIT_BIAS, dtype=np.int64), np.zeros(MAX_LOGIT_BIAS, dtype=np.float32)
    assert constraints.fill_bias(ids, values)
    assert dict(zip(ids[:3].tolist(), values[:3].tolist())) == {7: 100.0, 3: -0.5, 9: -100.0}  # vLLM's clamp
    assert (ids[3:] == -1).all() and (values[3:] == 0).all()
    assert not LaneConstraints.build(250).fill_bias(ids, values) and (ids == -1).all()
    row = np.ones(8, dtype=np.int32)
    assert not constraints.fill_mask(row, []) and not row.any()  # a bias alone uploads no mask


def test_bad_word_sequences_follow_vllm():
    vocab = {"foo": [10], " foo": [11], "bar baz": [20, 21], " bar baz": [22, 21], "qux": [30, 31],
             " qux": [32], "same": [40], " same": [40]}
    sequences = bad_word_sequences(["foo", " bar baz", "qux", "same"], lambda text: vocab[text])
    # " qux" splits differently (length 1 != 2) and " same" starts with the same token: both are skipped
    assert sequences == ((10,), (11,), (20, 21), (22, 21), (30, 31), (40,))
    with pytest.raises(ConstraintError, match="no tokens"):
        bad_word_sequences(["  "], lambda text: [])


@pytest.fixture(scope="module")
def grammar_compiler():
    text, eos = byte_level_bpe(600)
    compiler = GrammarCompiler(text, 640, eos)
    yield compiler, eos, {piece: i for i, piece in token_pieces(text).items()}
    compiler.close()


def test_grammar_rows_intersect_the_other_constraints(grammar_compiler):
    compiler, eos, by_piece = grammar_compiler
    matcher = compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"choice": ["ab", "cd", "ef"]})))
    a, c, e, x = (by_piece[p] for p in (b"a", b"c", b"e", b"x"))
    constraints = LaneConstraints.build(640, allowed_token_ids=[a, c, x, eos], bad_words=[(c,)], grammar=matcher,
                                        min_tokens=3, stop_ids=[eos])
    assert constraints.fields == ("structured_outputs.choice", "allowed_token_ids", "bad_words", "min_tokens")
    row = np.zeros(compiler.words, dtype=np.int32)
    assert constraints.fill_mask(row, []) and ids_of(row) == {a}
    matcher.accept(a)
    matcher.accept(by_piece[b"b"])
    with pytest.raises(ConstraintConflict, match="no token is allowed"):  # the grammar wants EOS, min_tokens masks it
        constraints.fill_mask(row, [a, by_piece[b"b"]])
    assert constraints.fill_mask(row, [a, by_piece[b"b"], 1]) and ids_of(row) == {eos}


def test_forked_constraints_advance_independently(grammar_compiler):
    """n > 1: each sample gets its own grammar position (runtime/samples.py forks the request's constraints)."""
    from ignition.runtime.samples import sample_requests
    compiler, eos, by_piece = grammar_compiler
    matcher = compiler.matcher(compiler.compile(grammar_spec(structured_outputs={"choice": ["ab", "cd"]})))
    request = Request([1], n=3, constraints=LaneConstraints.build(640, grammar=matcher, logit_bias={7: 1.0}))
    samples = sample_requests(request, "r")
    assert len({id(s.constraints.grammar) for s in samples} | {id(matcher)}) == 4
    samples[0].constraints.grammar.accept(by_piece[b"a"])
    rows = [np.zeros(compiler.words, dtype=np.int32) for _ in samples]
    for row, sample in zip(rows, samples):
        sample.constraints.fill_mask(row, [])
    assert ids_of(rows[0]) == {by_piece[b"b"]}
    assert ids_of(rows[1]) == ids_of(rows[2]) and {by_piece[b"a"], by_piece[b"c"], by_piece[b"ab"]} <= ids_of(rows[1])
    bias = samples[1].constraints.logit_bias
    assert bias == {7: 1.0} and bias is not request.constraints.logit_bias
    assert sample_requests(Request([1], n=2), "u")[1].constraints is None


def test_fill_mask_rows_batches_the_grammar_rows(grammar_compiler):
    compiler, eos, by_piece = grammar_compiler
    lanes = []
    for index, pattern in enumerate(["[a-c]+", "x[0-9]", None, "(yes|no)"]):
        grammar = None if pattern is None else compiler.matcher(
            compiler.compile(grammar_spec(structured_outputs={"regex": pattern})))
        lanes.append((index, LaneConstraints.build(640, grammar=grammar, bad_words=[(by_piece[b"b"],)]), []))
    batch = np.full((5, compiler.words), 7, dtype=np.int32)
    fill_mask_rows(batch, lanes)
    for index, constraints, generated in lanes:
        single = np.zeros(compiler.words, dtype=np.int32)
        constraints.fill_mask(single, generated)
        np.testing.assert_array_equal(batch[index], single)
        assert by_piece[b"b"] not in ids_of(single)
    assert not batch[4].any()


def fake_variant(lanes: int, words: int, constrained: bool = True):
    buffers = {"token_bitmask": torch.full((lanes, words), 99, dtype=torch.int32),
               "logit_bias_ids": torch.zeros(lanes, MAX_LOGIT_BIAS, dtype=torch.int64),
               "logit_bias_values": torch.ones(lanes, MAX_LOGIT_BIAS)}
    bindings = {"token_bitmask": S.TOKEN_BITMASK, "logit_bias_ids": S.LOGIT_BIAS_IDS,
                "logit_bias_values": S.LOGIT_BIAS_VALUES} if constrained else {}
    return SimpleNamespace(name="decode.c4", bindings=bindings, buffers=buffers if constrained else {})


def fake_lane(constraints, generated=(), chunk=None, retire=False):
    state = SimpleNamespace(request=Request([1], constraints=constraints), generated=list(generated))
    return Lane(state, chunk=chunk, retire=retire)


def test_fill_constraints_writes_sampling_lanes_only():
    vocab, words = 250, 8
    variant = fake_variant(4, words)
    masked = LaneConstraints.build(vocab, allowed_token_ids=[5, 6], logit_bias={"6": 3.0})
    lanes = [fake_lane(masked, [1]),
             fake_lane(None),  # an unconstrained request
             fake_lane(masked, chunk=SimpleNamespace(emits=False)),  # a prompt chunk that samples nothing
             fake_lane(masked, retire=True)]
    fill_constraints(variant, lanes)
    mask, ids, values = (variant.buffers[n] for n in ("token_bitmask", "logit_bias_ids", "logit_bias_values"))
    assert ids_of(mask[0].numpy()) == {5, 6} and not mask[1:].any()
    assert ids[0, 0] == 6 and values[0, 0] == 3.0 and (ids[0, 1:] == -1).all() and (ids[1:] == -1).all()
    assert not values[1:].any()


def test_fill_constraints_skips_the_upload_while_the_inputs_stay_neutral():
    variant = fake_variant(2, 8)
    fill_constraints(variant, [fake_lane(None)])
    mask = variant.buffers["token_bitmask"]
    assert not mask.any() and (variant.buffers["logit_bias_ids"] == -1).all()
    mask.fill_(7)  # a round without constrained lanes does not upload again
    fill_constraints(variant, [fake_lane(None), fake_lane(None)])
    assert (mask == 7).all()
    fill_constraints(variant, [fake_lane(LaneConstraints.build(250, allowed_token_ids=[3]))])
    assert ids_of(mask[0].numpy()) == {3} and not mask[1].any()
    fill_constraints(variant, [fake_lane(None)])  # the constrained row must be cleared
    assert not mask.any()


def test_fill_constraints_refuses_a_variant_without_the_inputs():
    constrained = LaneConstraints.build(250, allowed_token_ids=[5])
    fill_constraints(fake_variant(2, 8, constrained=False), [fake_lane(None)])  # nothing to do
    with pytest.raises(RuntimeError, match="takes no structured-output inputs"):
        fill_constraints(fake_variant(2, 8, constrained=False), [fake_lane(constrained)])


def test_admission_refuses_constraints_on_a_core_without_the_feature():
    features = Features(allow_logprobs=True, explicit_ids=True, prompt_logprobs=False)
    spec = SimpleNamespace(k=20, vocab_size=250, features=features)  # the typed Manifest's fields check_options reads
    request = Request([1, 2], constraints=LaneConstraints.build(250, min_tokens=1, stop_ids=[3], logit_bias={1: 2}))
    with pytest.raises(AdmissionError, match="cannot serve min_tokens, logit_bias; re-export") as raised:
        check_options(request, spec)
    assert raised.value.param == "min_tokens"
    check_options(request, SimpleNamespace(k=20, vocab_size=250, features=Features(True, True, False, True)))
    check_options(Request([1, 2]), spec)  # an old core still serves unconstrained requests
    check_options(Request([1, 2], constraints=LaneConstraints.build(250)), spec)  # and empty constraints
