"""The reference reduction against independent oracles.

Normalization: ``chunked_lse`` below is the reference's FP32 summation order written as a
plain loop (the row maximum M, then chunks of VOCAB_CHUNK lanes, each summing exp(x - M) over
the lanes at least FLUSH_BELOW above M, the sums added in chunk order). The reference must
match it bit for bit, so its packed words do not change when its implementation is made faster. Both
are checked against an fp64 logsumexp: lse32 accumulates V exponentials in FP32 chunk by
chunk, so its error is bounded by about log2(V) * 2**-24 relative on the sum, i.e. < 2e-6
absolute on the log for V <= 2**20; the final subtraction adds half an ulp of the result
(< 2e-6 for |value| < 32). We allow 5e-6 absolute: a wrong normalization (e.g. including one
padded lane or dropping one vocabulary chunk) moves values by orders of magnitude more.

Words: ``oracle_out`` computes every packed word from the contract's definition with numpy,
given lse32: reported values ``fp32(x) - lse32``, a full stable sort by (value desc, id asc)
with -0.0 == +0.0 and NaN ranked as -inf, so ties introduced by the subtraction are predicted
exactly. The reference must match every word, untouched rows included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ignition.components.logprobs as L
from ignition.catalog.contract import MAX_SELECTED_IDS, NAN_BITS, packed_width
from ignition.components.logprobs import reduce_logprobs, sort_keys

ATOL = 5e-6
SENTINEL = -7


def lse64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return (m + np.log(np.sum(np.exp(x - m), axis=1, keepdims=True)))[:, 0]


def oracle_order(x32: np.ndarray, lse32: float, k: int) -> list[int]:
    values = (x32 - np.float32(lse32)).astype(np.float32)
    values = np.where(values == 0, np.float32(0), values)  # -0.0 == +0.0
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]
    return order + [-1] * (k - len(order))


def chunked_lse(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The reference's FP32 normalization as a plain loop: the row maximum M, then each VOCAB_CHUNK-lane chunk's
    sum of exp(x - M) over its lanes at least FLUSH_BELOW above M, added in chunk order; M + log(mass)."""
    x = logits[:, :vocab_size].float()
    row_max = x.amax(dim=1)
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    mass = torch.zeros(logits.shape[0])
    for start in range(0, vocab_size, L.VOCAB_CHUNK):
        shifted = x[:, start:start + L.VOCAB_CHUNK] - safe_max[:, None]
        mass = mass + torch.where(shifted < L.FLUSH_BELOW, 0.0, shifted.exp()).sum(dim=1)
    return torch.where(torch.isinf(row_max), row_max, safe_max + torch.log(mass))


def value_bits(values: np.ndarray) -> list[int]:
    """Packed FP32 words: -0.0 stored as +0.0, every NaN as NAN_BITS."""
    values = np.where(values == 0, np.float32(0), values).astype(np.float32)
    return [NAN_BITS if np.isnan(v) else int(b) for v, b in zip(values, values.view(np.int32))]


def oracle_out(logits, chosen, requested, token_ids, counts, vocab_size, k, out):
    """Every word of ``out`` after the reduction, from the contract's definition (numpy, full sort)."""
    expected = out.clone()
    lse32 = chunked_lse(logits, vocab_size).numpy()
    x = logits[:, :vocab_size].float().numpy()
    for r in range(logits.shape[0]):
        if requested[r] == 0:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            values = (x[r] - lse32[r]).astype(np.float32)  # one FP32 subtraction, as specified
        count = int(counts[r]) if counts is not None else 0
        if count:
            tokens = token_ids[r, :count].tolist()
        else:
            ranked = np.where(np.isnan(values), np.float32(-np.inf), values)
            tokens = np.lexsort((np.arange(vocab_size), -ranked))[:k].tolist()  # value desc, then id asc
            tokens += [-1] * (k - len(tokens))
        tokens = [int(chosen[r])] + tokens
        picked = np.array([values[t] if 0 <= t < vocab_size else np.nan for t in tokens], dtype=np.float32)
        words = [w for pair in zip(tokens, value_bits(picked)) for w in pair]
        expected[r, :len(words)] = torch.tensor(words, dtype=torch.int64).to(torch.int32)
    return expected


def run(logits, chosen, k=20, requested=None, token_ids=None, counts=None, vocab_size=None):
    rows = logits.shape[0]
    vocab_size = vocab_size or logits.shape[1]
    requested = torch.ones(rows, dtype=torch.int32) if requested is None else requested
    out = torch.full((rows, packed_width(k, token_ids is not None)), SENTINEL, dtype=torch.int32)
    reduce_logprobs(logits, chosen, requested, out, vocab_size=vocab_size, k=k, token_ids=token_ids, token_id_counts=counts)
    return out


def check_natural(logits, out, vocab_size, k, rows=None):
    x = logits[:, :vocab_size].float().numpy()
    lse_ref = L._normalization(logits, vocab_size).numpy()
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse_ref[finite], lse64(x)[finite], atol=ATOL, rtol=0)
    for r in rows if rows is not None else range(logits.shape[0]):
        ids = out[r, 2:2 + 2 * k:2].tolist()
        assert ids == oracle_order(x[r], lse_ref[r], k), f"row {r}"
        bits = out[r, 3:2 + 2 * k:2]
        values = bits.view(torch.float32).numpy()
        valid = np.array(ids) >= 0
        expected = x[r, np.array(ids, dtype=np.int64)[valid]].astype(np.float64) - lse64(x[r:r + 1])[0]
        np.testing.assert_allclose(values[valid], expected, atol=ATOL, rtol=0)
        assert (bits[~torch.from_numpy(valid)] == NAN_BITS).all()


@pytest.fixture(params=[None, 64], ids=["one-chunk", "chunk-64"])
def chunk(request, monkeypatch):
    """chunk-64: chunks of 64 lanes, groups of 64 (gcd with GROUP), one group per candidate read,
    and merges every two reads, so small vocabularies take every multi-chunk and multi-read path."""
    if request.param:
        monkeypatch.setattr(L, "VOCAB_CHUNK", request.param)
        monkeypatch.setattr(L, "READ_LANES", 1)
        monkeypatch.setattr(L, "MERGE_EVERY", 2)
        monkeypatch.setattr(L, "ROWS_PER_PASS", 3)
    return request.param


@pytest.mark.parametrize("rows,vocab", [(1, 1823), (3, 127), (7, 20), (2, 1)])
def test_random_logits_odd_shapes(rows, vocab, chunk):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 4
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    out = run(logits, chosen)
    check_natural(logits, out, vocab, 20)
    x = logits.double()
    expected_chosen = x.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(x, 1)
    assert out[:, 0].tolist() == chosen.tolist()
    torch.testing.assert_close(out[:, 1].view(torch.float32).double(), expected_chosen, atol=ATOL, rtol=0)


def test_many_equal_logits_prefer_smallest_ids(chunk):
    logits = torch.full((2, 300), 1.5)
    logits[1, 250:] = 2.0  # ties at the top, then a tied plateau at the cutoff
    out = run(logits, torch.tensor([299, 0]))
    assert out[0, 2::2].tolist()[:20] == list(range(20))
    assert out[1, 2::2].tolist()[:20] == list(range(250, 270))
    check_natural(logits, out, 300, 20)


def test_ties_created_only_by_subtraction(chunk):
    # Distinct fp32 logits whose reported values round to the same fp32 number: a dominant
    # logit makes |value| ~ 30 (ulp ~ 2e-6) while the others differ by ~1e-10.
    g = torch.Generator().manual_seed(3)
    vocab = 500
    base = torch.full((vocab,), 1e-3, dtype=torch.float64) + torch.randperm(vocab, generator=g).double() * 1e-10
    logits = base.float()[None].repeat(2, 1)
    logits[:, 17] = 30.0
    assert len(set(logits[0].tolist())) > vocab // 2  # raw logits mostly distinct
    out = run(logits, torch.tensor([3, 4]))
    check_natural(logits, out, vocab, 20)
    ids = out[0, 2::2].tolist()
    assert ids[0] == 17 and ids[1:] == sorted(ids[1:])  # tied after subtraction -> increasing ids


def test_signed_zero_and_negative_infinity(chunk):
    logits = torch.full((1, 40), float("-inf"))
    logits[0, 9] = -0.0  # lse = 0 exactly, so the reported value is -0.0 - 0.0 = -0.0
    out = run(logits, torch.tensor([9]))
    ids = out[0, 2::2].tolist()
    assert ids == [9] + [i for i in range(40) if i != 9][:19]
    assert out[0, 3].item() == 0  # reported as +0.0 bits
    assert torch.isneginf(out[0, 5::2].view(torch.float32)).all()
    keys = sort_keys(torch.tensor([-0.0, 0.0, 0.0, -0.0]), torch.tensor([5, 3, 8, 1]))
    assert torch.argsort(keys, descending=True).tolist() == [3, 1, 0, 2]


@pytest.mark.parametrize("pad_value", [float("inf"), 1e30, float("nan")])
def test_padded_lanes_never_enter(pad_value, chunk):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 200, generator=g)
    logits[:, 150:] = pad_value
    out = run(logits, torch.tensor([0, 1, 2]), vocab_size=150)
    assert (out[:, 2::2] < 150).all()
    check_natural(logits, out, 150, 20)


def test_vocabulary_smaller_than_k():
    logits = torch.tensor([[0.5, -1.0, 2.0, 2.0, 0.0]])
    out = run(logits, torch.tensor([1]))
    assert out[0, 2::2].tolist() == [2, 3, 0, 4, 1] + [-1] * 15
    assert (out[0, 13::2] == NAN_BITS).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_fp32(dtype, chunk):
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(4, 1000, generator=g) * 3).to(dtype)
    logits[0, :50] = logits[0, 0]  # bf16 collapses many values into ties
    out = run(logits, torch.tensor([0, 1, 2, 999]))
    check_natural(logits, out, 1000, 20)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_k_selects_prefix(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(2, 333, generator=g)
    out = run(logits, torch.tensor([7, 8]), k=k)
    assert out.shape[1] == 2 + 2 * k
    check_natural(logits, out, 333, k)


def test_selected_ids_in_caller_order(chunk):
    g = torch.Generator().manual_seed(2)
    vocab = 700
    logits = torch.randn(3, vocab + 12, generator=g)
    token_ids = torch.full((3, MAX_SELECTED_IDS), 12345, dtype=torch.int32)
    selected = [699, 3, 512, 3, -1, 700, 0]  # duplicates and out-of-vocabulary ids included
    token_ids[0, :len(selected)] = torch.tensor(selected)
    token_ids[2, :MAX_SELECTED_IDS] = torch.randperm(vocab, generator=g)[:MAX_SELECTED_IDS].int()
    counts = torch.tensor([len(selected), 0, MAX_SELECTED_IDS], dtype=torch.int32)
    out = run(logits, torch.tensor([5, 6, 7]), token_ids=token_ids, counts=counts, vocab_size=vocab)
    assert out.shape[1] == 258
    x = logits[:, :vocab].double()
    lse = torch.logsumexp(x, 1)
    assert out[0, 2:2 + 2 * len(selected):2].tolist() == selected
    values = out[0, 3:2 + 2 * len(selected):2].view(torch.float32).double()
    for j, token in enumerate(selected):
        if 0 <= token < vocab:
            assert abs(values[j] - (x[0, token] - lse[0])) <= ATOL
        else:
            assert torch.isnan(values[j])
    assert (out[0, 2 + 2 * len(selected):] == SENTINEL).all()  # pairs beyond the count are not written
    check_natural(logits, out, vocab, 20, rows=[1])  # count 0 -> natural alternatives
    assert (out[1, 42:] == SENTINEL).all()
    assert out[2, 2::2].tolist() == token_ids[2].tolist()



def test_selected_id_inputs_with_every_count_zero_report_natural_rows(chunk):
    """A decode graph passes the selected-id buffers on every step; with every count zero (or negative) each row
    reports its natural alternatives, the words past the K pairs are left alone, and the frame rows are addressed
    as without the buffers (the reduction's one-write path)."""
    g = torch.Generator().manual_seed(4)
    vocab = 640  # whole groups: no partial last group to read
    logits = torch.randn(3, vocab + 8, generator=g).to(torch.bfloat16)
    token_ids = torch.randint(0, vocab, (3, MAX_SELECTED_IDS), generator=g, dtype=torch.int32)
    counts = torch.tensor([0, -3, 0], dtype=torch.int32)
    out = run(logits, torch.tensor([5, 6, 7]), token_ids=token_ids, counts=counts, vocab_size=vocab)
    check_natural(logits.float(), out, vocab, 20)
    assert (out[:, 42:] == SENTINEL).all()
    plain = run(logits, torch.tensor([5, 6, 7]), vocab_size=vocab)
    assert torch.equal(out[:, :42], plain)

def test_unrequested_rows_are_neither_read_nor_written():
    logits = torch.randn(4, 64)
    logits[1] = float("nan")  # would poison results if read
    requested = torch.tensor([1, 0, 2, 0], dtype=torch.int32)
    out = run(logits, torch.tensor([1, 2, 3, 4]), requested=requested)
    assert (out[1] == SENTINEL).all() and (out[3] == SENTINEL).all()
    check_natural(logits, out, 64, 20, rows=[0, 2])


def test_chosen_need_not_be_an_alternative():
    logits = torch.arange(100, dtype=torch.float32)[None]
    out = run(logits, torch.tensor([0]))
    assert out[0, 0] == 0 and 0 not in out[0, 2::2].tolist()


def test_out_rows_address_a_frame():
    logits = torch.randn(2, 50)
    frames = torch.full((2, 2, 3, 42), SENTINEL, dtype=torch.int32)  # [frames, capacity, T, width]
    rows = torch.tensor([(1 * 2 + 0) * 3 + 2, (1 * 2 + 1) * 3 + 0])
    reduce_logprobs(logits, torch.tensor([4, 5]), torch.ones(2, dtype=torch.int32), frames, vocab_size=50, out_rows=rows)
    assert (frames[0] == SENTINEL).all()
    assert frames[1, 0, 2, 0] == 4 and frames[1, 1, 0, 0] == 5
    assert (frames[1, 0, :2] == SENTINEL).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="out must be contiguous int32"):
        run_bad = torch.zeros(2, 10, dtype=torch.int32)
        reduce_logprobs(torch.randn(2, 30), torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32), run_bad, vocab_size=30)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        reduce_logprobs(torch.randn(2, 30), torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32),
                        torch.zeros(2, 42, dtype=torch.int32), vocab_size=31)
    with pytest.raises(ValueError, match="k must be in"):
        reduce_logprobs(torch.randn(2, 30), torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32),
                        torch.zeros(2, 44, dtype=torch.int32), vocab_size=30, k=21)


def test_op_is_one_node_in_an_exported_graph():
    class Graph(torch.nn.Module):
        def forward(self, logits, chosen, requested, out):
            reduce_logprobs(logits, chosen, requested, out, vocab_size=30, k=4)
            return chosen + 1

    args = (torch.randn(3, 32), torch.tensor([0, 1, 2]), torch.tensor([1, 0, 1], dtype=torch.int32),
            torch.zeros(3, 10, dtype=torch.int32))
    program = torch.export.export(Graph(), args)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("ignition.reduce_logprobs.default") == 1
    expected = args[3].clone()
    reduce_logprobs(args[0], args[1], args[2], expected, vocab_size=30, k=4)
    program.module()(*args)
    assert torch.equal(args[3], expected)


def test_no_requested_rows_writes_nothing():
    out = run(torch.randn(3, 40), torch.tensor([1, 2, 3]), requested=torch.zeros(3, dtype=torch.int32))
    assert (out == SENTINEL).all()


def adversarial_logits(g: torch.Generator, kinds: list[int], vocab: int, padded: int, dtype: torch.dtype):
    """Random rows, row r of adversarial kind kinds[r] (0-10); padded lanes hold one huge or non-finite value.

    Kinds 1, 9 and 10 make every group a candidate; a batch holding one is searched exhaustively,
    so the candidate bound is exercised by batches without them.
    """
    rows = len(kinds)
    x = torch.randn(rows, padded, generator=g) * float(torch.rand(1, generator=g) * 8 + 0.1)
    for r, kind in enumerate(kinds):
        lane = int(torch.randint(0, vocab, (1,), generator=g))
        if kind == 1:  # every lane equal
            x[r] = x[r, 0]
        elif kind == 2:  # -inf row: lse = -inf, every value NaN
            x[r] = float("-inf")
        elif kind == 3:  # a NaN lane: lse NaN
            x[r, lane] = float("nan")
        elif kind == 4:  # a +inf lane: lse +inf
            x[r, lane] = float("inf")
        elif kind == 5:  # ties created by the subtraction: ulp(1e8) = 8 swallows every other logit
            x[r] = torch.rand(padded, generator=g) * 7.9 - 3.95
            x[r, lane] = 1e8
        elif kind == 6:  # a plateau of equal values straddling the k-th place
            top, plateau = x[r, :vocab].max(), torch.randperm(vocab, generator=g)[:60]
            x[r, plateau] = top - 1
            x[r, plateau[:5]] = top + 1
        elif kind == 7:  # signed zeros everywhere
            x[r, ::3], x[r, 1::3] = -0.0, 0.0
        elif kind == 8:  # mostly -inf
            x[r, torch.rand(padded, generator=g) < 0.8] = float("-inf")
        elif kind == 9:  # integers: many exact ties
            x[r] = torch.round(x[r])
        elif kind == 10:  # one -0.0 among -inf: lse = 0, reported -0.0 stored as +0.0
            x[r] = float("-inf")
            x[r, lane] = -0.0
    x[:, vocab:] = [float("inf"), 1e30, float("nan"), -1e30][int(torch.randint(0, 4, (1,), generator=g))]
    return x.to(dtype)


@pytest.mark.parametrize("seed", range(8))
def test_random_adversarial_rows_match_oracle_word_for_word(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    for case in range(6):
        rows = int(torch.randint(1, 14, (1,), generator=g))
        vocab = int(torch.randint(1, 40 if case == 0 else 2600, (1,), generator=g))
        padded = vocab + int(torch.randint(0, 5, (1,), generator=g))
        dtype = (torch.float32, torch.bfloat16, torch.float16)[(seed + case) % 3]
        k = (20, 20, 1, 5, 0, 19)[case]
        kinds = [int(torch.randint(0, 11, (1,), generator=g))] * rows if case % 3 else [r % 11 for r in range(rows)]
        logits = adversarial_logits(g, kinds, vocab, padded, dtype)
        chosen = torch.randint(-2, vocab + 2, (rows,), generator=g)
        requested = (torch.rand(rows, generator=g) < 0.8).to(torch.int32)
        token_ids = counts = None
        if case % 2:  # some rows select ids (out-of-vocabulary ones included), the rest are natural
            token_ids = torch.randint(-3, vocab + 3, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32)
            counts = torch.randint(1, MAX_SELECTED_IDS + 1, (rows,), generator=g, dtype=torch.int32)
            counts[torch.rand(rows, generator=g) < 0.5] = 0
        out = run(logits, chosen, k=k, requested=requested, token_ids=token_ids, counts=counts, vocab_size=vocab)
        sentinel = torch.full_like(out, SENTINEL)
        expected = oracle_out(logits, chosen, requested, token_ids, counts, vocab, k, sentinel)
        assert torch.equal(out, expected), f"case {case}: rows {rows} vocab {vocab} {dtype} k {k}: " \
            f"first differences at {(out != expected).nonzero()[:4].tolist()}"


def test_normalization_bits_match_the_chunked_loop(chunk):
    g = torch.Generator().manual_seed(21)
    for vocab in (1, 63, 64, 65, 1000, 4097):
        for dtype in (torch.float32, torch.bfloat16):
            logits = adversarial_logits(g, list(range(11)), vocab, vocab + 3, dtype)
            lse, expected = L._normalization(logits, vocab), chunked_lse(logits, vocab)
            assert torch.equal(lse.view(torch.int32), expected.view(torch.int32)), f"vocab {vocab} {dtype}"
            finite = torch.isfinite(expected)
            torch.testing.assert_close(lse[finite].double(), torch.logsumexp(logits[finite, :vocab].double(), 1),
                                       atol=ATOL, rtol=0)


def test_lanes_far_below_the_maximum_add_no_mass(chunk):
    """Logits spread over hundreds of nats, as a random-weight real-size model's are: most lanes sit more than
    -FLUSH_BELOW under the row's maximum and add nothing. lse keeps the loop's bits and fp64's value, and every
    reported word still matches the oracle."""
    g = torch.Generator().manual_seed(5)
    vocab = 4097
    logits = torch.randn(6, vocab, generator=g) * 60
    logits[1] = -200.0
    logits[1, 7], logits[1, 9] = 0.0, L.FLUSH_BELOW  # exactly at the edge: kept, lse = log(1 + exp(-87))
    logits[2, ::2] = float("nan")
    logits[3] = float("-inf")
    logits[3, 11] = -1e4  # alone: lse = -1e4
    lse, expected = L._normalization(logits, vocab), chunked_lse(logits, vocab)
    assert torch.equal(lse.view(torch.int32), expected.view(torch.int32))
    finite = torch.isfinite(lse)
    assert finite.tolist() == [True, True, False, True, True, True]
    torch.testing.assert_close(lse[finite].double(), torch.logsumexp(logits[finite].double(), 1), atol=ATOL, rtol=0)
    assert lse[3].item() == -1e4
    chosen = torch.randint(0, vocab, (6,), generator=g)
    out = run(logits, chosen, vocab_size=vocab)
    expected_out = oracle_out(logits, chosen, torch.ones(6, dtype=torch.int32), None, None, vocab, 20,
                              torch.full_like(out, SENTINEL))
    assert torch.equal(out, expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kinds", [[0, 5, 6, 7, 8, 2, 5], [1, 9, 10, 3, 4]], ids=["bounded", "exhaustive"])
def test_production_vocabulary_matches_oracle(dtype, kinds):
    """151,936 lanes (vocabulary 151,900) with the default chunking: several chunks, a partial group."""
    g = torch.Generator().manual_seed(4)
    vocab = 151_900
    logits = adversarial_logits(g, kinds, vocab, 151_936, dtype)
    if kinds[0] == 0:
        logits[0, 1000:1040] = logits[0, :vocab].max().float() + 1  # 40 equal winners: the 20 smallest ids
    rows = len(kinds)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    requested = torch.ones(rows, dtype=torch.int32)
    out = run(logits, chosen, requested=requested, vocab_size=vocab)
    if kinds[0] == 0:
        assert out[0, 2::2].tolist() == list(range(1000, 1020))
    expected = oracle_out(logits, chosen, requested, None, None, vocab, 20, torch.full_like(out, SENTINEL))
    assert torch.equal(out, expected)


def test_sort_keys_bit_layout():
    """sort_keys against its definition: (order-preserving image of the value, 0xFFFFFFFF - id)."""
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]
    values = torch.cat([torch.tensor(special), torch.randint(-2**31, 2**31 - 1, (5000,), dtype=torch.int32)
                        .view(torch.float32)])
    ids = torch.randint(0, 2**31 - 1, values.shape, dtype=torch.int32)
    keys = sort_keys(values, ids)
    for value, token, key in zip(values.tolist(), ids.tolist(), keys.tolist()):
        value = float("-inf") if np.isnan(value) else value + 0.0
        bits = int(np.float32(value).view(np.uint32))
        ordered = (bits ^ 0xFFFFFFFF) if bits >> 31 else (bits | 0x80000000)  # unsigned, order-preserving
        assert key == ((ordered - 2**31) << 32) + 0xFFFFFFFF - token
