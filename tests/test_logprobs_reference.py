"""The reference reduction against an independent fp64 numpy oracle.

Tolerance: reported values are ``fp32(x) - lse32``. lse32 accumulates V exponentials in
FP32 chunk by chunk, so its error against the fp64 logsumexp is bounded by about
log2(V) * 2**-24 relative on the sum, i.e. < 2e-6 absolute on the log for V <= 2**20;
the final subtraction adds half an ulp of the result (< 2e-6 for |value| < 32). We allow
5e-6 absolute: a wrong normalization (e.g. including one padded lane or dropping one
vocabulary chunk) moves values by orders of magnitude more.

Ordering is bit-exact: the oracle sorts, in numpy, the FP32 values ``fp32(x) - lse32``
with lse32 from the reference's own normalization (itself checked against fp64), so
ties introduced by the subtraction are predicted exactly.
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
    if request.param:
        monkeypatch.setattr(L, "VOCAB_CHUNK", request.param)
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
