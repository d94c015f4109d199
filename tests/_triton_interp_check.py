"""Runs the Triton logprob launches under TRITON_INTERPRET=1 and checks them; one JSON line per case.

Started in a subprocess by tests/test_triton_logprobs.py: TRITON_INTERPRET must be set before
Triton is imported and breaks torch.export in the same process. On a machine with a GPU,
``python tests/_triton_interp_check.py --device cuda`` runs the same checks on the compiled kernels.

Every case is checked three ways:

1. Triton against an independent oracle evaluated with Triton's own lse (full sort of
   ``sort_keys``, no top-k prefilter): every word of ``out`` bit-exact, sentinel rows included.
   ``x.float() - lse`` is one correctly rounded FP32 subtraction in both, so values are exact too.
2. Triton against ``reduce_logprobs_reference``: every id word and untouched row exact, values
   within VALUE_TOLERANCE (the two sum exp() in different orders, so lse may differ slightly).
3. Triton's lse against an FP64 logsumexp, within the same tolerance.

VALUE_TOLERANCE: |a - b| <= 2**-17 + 2**-22 * (|lse| + |value|). Each path's FP32 sum of
exp(x - max) carries a relative error of at most ~(log2(vocab) + 2) eps (tree reductions,
exp() within 2 ulp), i.e. < 2**-19 in log(S) for these vocabularies; m + log(S) and x - lse
each round once more (half an ulp of |lse| and |value|). The bound is 4x that sum, and a
wrong normalization (off by one lane's mass, or a missed tile) exceeds it by orders of magnitude.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

from ignition.catalog.contract import MAX_SELECTED_IDS, NAN_BITS, NATURAL_K, packed_width
from ignition.components.logprobs import reduce_logprobs_reference, sort_keys
from ignition.components.triton_logprobs import _sort_keys, launch_reduction

SENTINEL = 0x5A5A5A5A
DEVICE = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"  # where the kernels run


def oracle(logits, lse, chosen, requested, out, out_rows, token_ids, counts, vocab_size, k):
    """Expected ``out`` from the contract's definition, evaluated with the given per-row lse."""
    expected = out.clone().view(-1, out.shape[-1])
    for r in range(logits.shape[0]):
        if requested[r] == 0:
            continue
        values = logits[r, :vocab_size].float() - lse[r]  # FP32 reported values: [vocab_size]
        tokens = [int(chosen[r])]
        if counts is not None and counts[r] != 0:
            tokens += token_ids[r, :int(counts[r])].tolist()
        elif k > 0:
            keys = sort_keys(values, torch.arange(vocab_size)).sort(descending=True).values[:k]
            tokens += (0xFFFFFFFF - (keys & 0xFFFFFFFF)).tolist() + [-1] * (k - len(keys))
        words = []
        for token in tokens:
            value = values[token] if 0 <= token < vocab_size else torch.tensor(math.nan)
            bits = NAN_BITS if value.isnan() else (value + 0.0).view(torch.int32).item()
            words += [token, bits]
        expected[int(out_rows[r]), :len(words)] = torch.tensor(words, dtype=torch.int64).to(torch.int32)
    return expected.view_as(out)


def tolerance(values, lse):
    return 2.0**-17 + 2.0**-22 * (lse.abs() + values.abs())


def make_case(name, logits, *, vocab_size, k=NATURAL_K, requested=None, chosen=None, token_ids=None, counts=None,
              out_rows=None, out_slots=None):
    rows = logits.shape[0]
    requested = torch.ones(rows, dtype=torch.int32) if requested is None else torch.tensor(requested, dtype=torch.int32)
    chosen = torch.arange(rows, dtype=torch.int64) % vocab_size if chosen is None else torch.tensor(chosen)
    out_rows = torch.arange(rows) if out_rows is None else torch.tensor(out_rows, dtype=torch.int64)
    if token_ids is not None:
        padded = torch.full((rows, MAX_SELECTED_IDS), -7, dtype=torch.int32)
        for r, ids in enumerate(token_ids):
            padded[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        token_ids, counts = padded, torch.tensor(counts, dtype=torch.int32)
    slots = out_slots or rows
    out = torch.full((slots, packed_width(k, token_ids is not None)), SENTINEL, dtype=torch.int32)
    return name, (logits, chosen, requested, out, out_rows, token_ids, counts, vocab_size, k)


def padded_logits(rows, vocab, padded, dtype, pad_value, generator, scale=3.0):
    logits = torch.randn(rows, padded, generator=generator) * scale
    logits[:, vocab:] = pad_value  # padded lanes must never enter
    return logits.to(dtype)


def cases():
    g = torch.Generator().manual_seed(1234)
    yield make_case("vocab5_below_k_fp32", padded_logits(1, 5, 8, torch.float32, float("inf"), g), vocab_size=5,
                    chosen=[7])  # chosen in the padding: NaN
    yield make_case("vocab1823_permuted_out_fp32", padded_logits(3, 1823, 1830, torch.float32, 1e30, g),
                    vocab_size=1823, chosen=[5, 1822, -1], out_rows=[4, 0, 2], out_slots=6)
    bf16 = padded_logits(7, 127, 128, torch.bfloat16, 1e30, g, scale=1.0)  # bf16: many exact ties
    yield make_case("vocab127_mixed_requests_bf16", bf16, vocab_size=127, requested=[1, 0, 1, 1, 0, 1, 1],
                    chosen=[0, 3, 126, 127, 5, 64, 1], out_rows=[6, 5, 4, 3, 2, 1, 0], out_slots=8)
    yield make_case("vocab20_equals_k_fp16", padded_logits(3, NATURAL_K, 24, torch.float16, float("inf"), g),
                    vocab_size=NATURAL_K)
    equal = torch.full((3, 1830), 0.5)
    equal[1, ::3] = -0.0  # -0.0 and +0.0 logits tie on value: id order decides
    equal[1, 1::3] = 0.0
    equal[2, 100:] = float("-inf")
    equal[:, 1823:] = float("inf")
    yield make_case("equal_logits_across_tiles_fp32", equal, vocab_size=1823, chosen=[1822, 0, 1000])
    yield make_case("subtraction_ties_fp32", subtraction_ties(g), vocab_size=2500, chosen=[0, 2499, 17])
    sparse = torch.full((3, 127), float("-inf"))
    sparse[:, [90, 3, 40]] = torch.tensor([1.0, 2.0, -0.0])
    sparse[2] = float("-inf")
    sparse[2, 50] = -0.0  # lse = +0.0 exactly, reported value -0.0 - 0.0 = -0.0 is stored as +0.0
    yield make_case("neg_inf_and_signed_zero_fp32", sparse, vocab_size=127, chosen=[40, 0, 50])
    yield make_case("selected_ids_fp32", padded_logits(7, 1823, 1825, torch.float32, 1e30, g), vocab_size=1823,
                    requested=[1, 1, 1, 0, 1, 1, 1], chosen=[3, 2, 1, 0, 1823, 4, 5],
                    token_ids=[[1822, -5, 0, 1823, 7], [9], list(range(1822, 1822 - MAX_SELECTED_IDS, -1)), [1, 2, 3],
                               [], [2**31 - 1, 1824, 11], [500, 3, 500, 2, 1]],
                    counts=[5, 1, MAX_SELECTED_IDS, 3, 0, 3, 5], out_rows=[1, 3, 5, 7, 9, 11, 13], out_slots=14)
    yield make_case("selected_ids_k0_bf16", padded_logits(3, 127, 130, torch.bfloat16, float("inf"), g),
                    vocab_size=127, k=0, token_ids=[[126, 0], [], [5]], counts=[2, 0, 1])
    yield make_case("k0_chosen_only_fp16", padded_logits(3, 1823, 1823, torch.float16, 0.0, g), vocab_size=1823, k=0)
    yield make_case("k5_multi_tile_bf16", padded_logits(1, 2500, 2560, torch.bfloat16, 1e30, g), vocab_size=2500, k=5)
    nonfinite = padded_logits(5, 20, 20, torch.float32, 0.0, g)
    nonfinite[0, 2] = float("inf")  # lse = +inf, lane 2 reports inf - inf = NaN: ranks as -inf, id order
    nonfinite[1, 9] = float("nan")  # lse NaN: every value NaN
    nonfinite[2] = float("-inf")  # lse = -inf: every value NaN
    nonfinite[3, [4, 15]] = torch.tensor([float("inf"), float("nan")])  # NaN wins over +inf
    nonfinite[4] = float("-inf")
    nonfinite[4, 11] = float("nan")
    yield make_case("nonfinite", nonfinite, vocab_size=20, k=5, chosen=[2, 9, 0, 4, 11])
    yield from adversarial_cases(g)


def adversarial_cases(generator):
    """Ties at the cutoff, cutoffs across tiles, equal rows, -inf rows and K near the tile width.

    Vocabularies of 3000-4100 lanes take 1024-lane tiles (launch_plan's minimum for these few
    rows), so ties and winners are placed on both sides of tile boundaries. Vocabularies of at
    most 32 lanes take one tile of 16 or 32 lanes, so K=20 selects most or more than a whole tile.
    """
    plateau = torch.randn(3, 3000, generator=generator)  # fp32; 3 tiles of 1024
    spread = torch.linspace(5, 2995, 50).long()  # 50 tied lanes spread over every tile
    plateau[0, spread] = 8.0  # 50 equal winners: the 20 smallest ids, in two tiles of three
    plateau[1, spread[:10]] = 9.0 + torch.arange(10) * 0.25  # 10 distinct leaders, then 40 tied at the cutoff
    plateau[1, spread[10:]] = 8.0
    plateau[2, 1014:1034] = 8.0  # the cutoff's ties straddle the first tile boundary ...
    plateau[2, 2040:2056] = 8.0  # ... and the second: 36 tied lanes, the 20 smallest ids win
    yield make_case("many_equal_at_cutoff_fp32", plateau, vocab_size=3000, chosen=[5, 2995, 1033])

    crossing = (torch.randn(2, 4100, generator=generator) * 2).to(torch.bfloat16)  # 5 tiles, the last partial
    crossing[0, torch.tensor([3, 1023, 1024, 2047, 2048, 3071, 3072, 4095, 4096, 4099])] = 20.0  # tile edges
    crossing[1, 4080:4100] = 20.0  # all winners in the partial last tile
    yield make_case("cutoff_crosses_tiles_bf16", crossing, vocab_size=4100, chosen=[4099, 0])

    equal = torch.full((2, 4100), -3.25, dtype=torch.bfloat16)  # every lane equal: ids 0..19 in order
    equal[1] = 0.0
    equal[1, 1::2] = -0.0  # signed zeros tie on value
    yield make_case("every_lane_equal_bf16", equal, vocab_size=4100, chosen=[4099, 7])

    neg_inf = torch.full((4, 3000), float("-inf"))
    neg_inf[1, 2500] = 1.0  # a single finite lane: value 0.0 first, then -inf lanes by id
    neg_inf[2, [40, 1500, 2999]] = 2.0  # three tied finite lanes in different tiles
    neg_inf[3] = torch.randn(3000, generator=generator)
    neg_inf[3, ::2] = float("-inf")  # half the lanes -inf: finite lanes win, then -inf lanes by id
    yield make_case("neg_inf_rows_fp32", neg_inf, vocab_size=3000, chosen=[0, 2500, 1500, 1])

    narrow = padded_logits(3, 31, 32, torch.bfloat16, 1e30, generator, scale=0.5)  # one 32-lane tile
    narrow[1, :31] = narrow[1, 5]  # every lane tied: 20 of 31
    yield make_case("k20_of_tile32_bf16", narrow, vocab_size=31, chosen=[30, 0, 15])
    tiny = padded_logits(2, 16, 16, torch.float16, 0.0, generator)  # one 16-lane tile: K=20 exceeds it
    tiny[1, 8:] = tiny[1, 0]
    yield make_case("k20_over_tile16_fp16", tiny, vocab_size=16, chosen=[15, 8])


def subtraction_ties(generator):
    """Rows whose lse is exactly 1e8: lane 0 holds 1e8 and exp(x - 1e8) underflows to 0 elsewhere.

    ulp(1e8) is 8, so distinct logits in (-4, 4) all report exactly -1e8 and tie (smallest ids
    win), logits in (4, 12) report -1e8 + 8; the tie exists only after the subtraction.
    """
    logits = torch.rand(3, 2504, generator=generator) * 7.9 - 3.95
    logits[:, 0] = 1e8
    logits[1, 2000:2010] = 5.0 + torch.arange(10) * 0.5  # rank above the ties, id order among themselves
    logits[2, 1500] = 1e8  # a second lane equal to the max: lse still rounds to 1e8
    logits[:, 2500:] = float("inf")
    return logits


@triton.jit
def sort_keys_kernel(values_ptr, ids_ptr, keys_ptr, BLOCK: tl.constexpr):  # [BLOCK] fp32, [BLOCK] int32 -> int64
    lanes = tl.arange(0, BLOCK)
    tl.store(keys_ptr + lanes, _sort_keys(tl.load(values_ptr + lanes), tl.load(ids_ptr + lanes)))


def check_sort_keys():
    """The kernels' key layout is bit-identical to the reference's ``sort_keys``."""
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]
    values = torch.cat([torch.tensor(special), torch.randn(1024 - len(special)) * 50]).float()
    ids = torch.randint(0, 2**31 - 1, (1024,), dtype=torch.int32)
    ids[:4] = torch.tensor([0, 1, 2**31 - 1, 151935])
    keys = torch.empty(1024, dtype=torch.int64, device=DEVICE)
    sort_keys_kernel[(1,)](values.to(DEVICE), ids.to(DEVICE), keys, BLOCK=1024)
    keys = keys.cpu()
    expected = sort_keys(values, ids)
    if torch.equal(keys, expected):
        return []
    bad = (keys != expected).nonzero().flatten().tolist()[:6]
    return [f"keys differ for values {values[bad].tolist()}: {keys[bad].tolist()} vs {expected[bad].tolist()}"]


def check(name, args):
    logits, chosen, requested, out, out_rows, token_ids, counts, vocab_size, k = args
    triton_out, reference_out = out.clone(), out.clone()
    on_device = [t.to(DEVICE) if t is not None else None for t in (logits, chosen, requested, triton_out, out_rows,
                                                                    token_ids, counts)]
    lse = launch_reduction(*on_device, vocab_size, k).lse.cpu()
    triton_out = on_device[3].cpu()
    reduce_logprobs_reference(logits, chosen, requested, reference_out, out_rows, token_ids, counts, vocab_size, k)
    failures = []
    expected = oracle(logits, lse, chosen, requested, out, out_rows, token_ids, counts, vocab_size, k)
    if not torch.equal(triton_out, expected):
        bad = (triton_out != expected).nonzero().tolist()[:6]
        failures.append(f"oracle mismatch at {bad}: triton {[triton_out[tuple(i)].item() for i in bad]} "
                        f"expected {[expected[tuple(i)].item() for i in bad]}")
    live = requested != 0
    exact = torch.logsumexp(logits[:, :vocab_size].double(), dim=1)
    agrees = ((lse.double() - exact).abs() <= tolerance(exact, exact)) | (lse.double() == exact)
    agrees |= lse.isnan() & exact.isnan()
    if not agrees[live].all():
        failures.append(f"lse {lse[live].tolist()} differs from fp64 logsumexp {exact[live].tolist()}")
    if name == "subtraction_ties_fp32" and not torch.equal(lse, torch.full_like(lse, 1e8)):
        failures.append(f"lse should be exactly 1e8, got {lse.tolist()}")
    width = out.shape[-1]
    got, want = triton_out.view(-1, width), reference_out.view(-1, width)
    if not torch.equal(got[:, 0::2], want[:, 0::2]):
        bad = (got[:, 0::2] != want[:, 0::2]).nonzero().tolist()[:6]
        failures.append(f"ids differ from the reference at {bad}")
    row_lse = torch.zeros(got.shape[0])
    row_lse[out_rows[live]] = lse[live]
    bits_t, bits_r = got[:, 1::2].contiguous(), want[:, 1::2].contiguous()
    values_t, values_r = bits_t.view(torch.float32), bits_r.view(torch.float32)
    same = ((values_t - values_r).abs() <= tolerance(values_r, row_lse[:, None])) | (bits_t == bits_r)
    if not same.all():
        failures.append(f"values differ from the reference beyond tolerance at {(~same).nonzero().tolist()[:6]}")
    return failures


def main():
    print(json.dumps({"case": "sort_keys_layout", "failures": check_sort_keys()}), flush=True)
    for name, args in cases():
        try:
            failures = check(name, args)
        except Exception:  # noqa: BLE001 - reported per case to the parent test
            failures = [traceback.format_exc()]
        print(json.dumps({"case": name, "failures": failures}), flush=True)


CASE_NAMES = ("sort_keys_layout", "vocab5_below_k_fp32", "vocab1823_permuted_out_fp32", "vocab127_mixed_requests_bf16",
              "vocab20_equals_k_fp16", "equal_logits_across_tiles_fp32", "subtraction_ties_fp32",
              "neg_inf_and_signed_zero_fp32", "selected_ids_fp32", "selected_ids_k0_bf16", "k0_chosen_only_fp16",
              "k5_multi_tile_bf16", "nonfinite", "many_equal_at_cutoff_fp32", "cutoff_crosses_tiles_bf16",
              "every_lane_equal_bf16", "neg_inf_rows_fp32", "k20_of_tile32_bf16", "k20_over_tile16_fp16")

if __name__ == "__main__":
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (or --device cuda on a GPU machine)")
    main()
