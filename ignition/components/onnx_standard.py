"""Standard-ONNX-operator formulations of what ``torch.onnx`` cannot translate, for the ONNX capture only.

``torch.onnx`` cannot translate the opaque ``ignition::reduce_logprobs`` and
``ignition::score_prompt_rows`` nodes (nor ``aten.sort.stable``, which sampling uses), so the
ONNX exporter replaces each such node with the function below of the same signature. The two
reductions keep the reference's contract
(``ignition.components.logprobs``, ``ignition.components.prompt_scoring``) with static shapes and
tensor-only control flow, and every step is one standard operator (opset 18):

1. ``lse``: an FP32 log-sum-exp over ``logits[:, :vocab_size]`` (ReduceMax, Sub, Exp, ReduceSum,
   Log, Add); padded lanes are sliced off and never enter;
2. reported values ``logits - lse`` (Sub); NaN ranks as -inf (Where);
3. natural alternatives by ``TopK(largest=1, sorted=1)``, whose specified tie-break (the lower
   index first) is the contract's (value desc, id asc) order on FP32 reported values, ties created
   by the subtraction and -0.0 == +0.0 included;
4. chosen, natural and selected ids' values by GatherElements (NaN outside the vocabulary);
5. the FP32 -> int32 bit-cast by exact arithmetic (``float_bits``: ONNX's BitCast needs opset 26),
   with +0.0 for -0.0 and one quiet NaN pattern;
6. rows written with ScatterND; rows with a zero request flag keep their old words.
"""

from __future__ import annotations

import math

import torch

from ignition.catalog.contract import (INVALID_TOKEN_ID, MAX_SELECTED_IDS, NAN_BITS, NATURAL_K, PACKED_CHOSEN_WORDS,
                                       PROMPT_ROW_WIDTH)

_MIN_NORMAL_EXPONENT, _MAX_EXPONENT = -126, 127
_MANTISSA_BITS = 23
_INF_BITS = 0x7F800000
_SIGN_BIT = 1 << 31


def _powers_of_two(device) -> torch.Tensor:
    """float32 2**e for e in [-126, 127]: every normal power of two, each exact."""
    return torch.tensor([math.ldexp(1.0, e) for e in range(_MIN_NORMAL_EXPONENT, _MAX_EXPONENT + 1)],
                        dtype=torch.float32, device=device)


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """The IEEE-754 bits of float32 ``values`` as int32, computed with exact arithmetic only.

    -0.0 gives +0.0's bits and every NaN gives ``NAN_BITS``. Normal numbers: the exponent e with
    2**e <= |v| < 2**(e+1) by an 8-step binary search over exact powers of two (Gather, compare,
    Where), the mantissa as (|v| / 2**e - 1) * 2**23 (a division by a power of two, exact);
    subnormals: |v| * 2**126 * 2**23 (two exact scalings). Nothing depends on the accuracy of
    Log or Pow, so the words equal ``values.view(torch.int32)`` bit for bit.
    """
    magnitude = values.abs()  # [...]
    normal = magnitude >= math.ldexp(1.0, _MIN_NORMAL_EXPONENT)
    finite = magnitude < float("inf")  # False for inf and NaN
    safe = torch.where(normal & finite, magnitude, 1.0)
    powers = _powers_of_two(values.device)  # powers[i] = 2**(i - 126)
    top = _MAX_EXPONENT - _MIN_NORMAL_EXPONENT
    index = torch.zeros_like(safe, dtype=torch.int64)  # the largest i with powers[i] <= safe
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        candidate = (index + step).clamp(max=top)
        index = torch.where(safe >= powers[candidate], candidate, index)
    mantissa = ((safe / powers[index] - 1.0) * float(1 << _MANTISSA_BITS)).to(torch.int64)
    normal_bits = (index + 1) * (1 << _MANTISSA_BITS) + mantissa  # biased exponent e + 127 = index + 1
    tiny = torch.where(normal | ~finite, 0.0, magnitude)  # subnormal magnitudes, else 0
    subnormal_bits = (tiny * math.ldexp(1.0, -_MIN_NORMAL_EXPONENT) * float(1 << _MANTISSA_BITS)).to(torch.int64)
    bits = torch.where(normal, normal_bits, subnormal_bits)
    bits = torch.where(finite, bits, _INF_BITS)
    bits = bits + torch.where(values < 0, _SIGN_BIT, 0)  # -0.0 < 0 is False: +0.0's bits
    bits = bits - torch.where(bits >= _SIGN_BIT, 1 << 32, 0)  # the int32 with those bits, still in int64
    # NOTE: multiplications, not shifts: ONNX's BitShift is defined for unsigned types only.
    return torch.where(torch.isnan(values), NAN_BITS, bits).to(torch.int32)


def _reported(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits[:, :vocab_size] - lse`` in FP32, the reference's max-shifted log-sum-exp."""
    vocab = logits[:, :vocab_size].float()  # [rows, V]; padded lanes never enter
    row_max = vocab.amax(dim=1, keepdim=True)  # [rows, 1]
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    total = (vocab - shift).exp().sum(dim=1, keepdim=True)
    lse = torch.where(torch.isinf(row_max), row_max, shift + total.log())
    return vocab - lse


def _gather_values(reported: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Reported values of ``ids [rows, n]``; ids outside the vocabulary get NaN."""
    vocab_size = reported.shape[1]
    in_vocab = (ids >= 0) & (ids < vocab_size)
    values = reported.gather(1, ids.clamp(0, vocab_size - 1).to(torch.int64))
    return torch.where(in_vocab, values, float("nan"))


def _natural_ids(reported: torch.Tensor, k: int) -> torch.Tensor:
    """TopK ids ``[rows, k]`` by (reported value desc, id asc); -1 past a vocabulary smaller than k."""
    rows, vocab_size = reported.shape
    ranked = torch.where(torch.isnan(reported), float("-inf"), reported)  # NaN ranks as -inf
    take = min(k, vocab_size)
    _, ids = ranked.topk(take, dim=1, largest=True, sorted=True)  # ties: lower index first
    if take < k:
        ids = torch.cat([ids, torch.full((rows, k - take), INVALID_TOKEN_ID, dtype=ids.dtype, device=ids.device)], 1)
    return ids


def _pairs(ids: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Interleaved (id, FP32 bits) words: [rows, n] x 2 -> int32 [rows, 2n]."""
    return torch.stack([ids.to(torch.int32), bits], dim=-1).reshape(ids.shape[0], 2 * ids.shape[1])


def reduce_logprobs_standard(logits, chosen, requested, out, out_rows, token_ids, token_id_counts,
                             vocab_size: int, k: int) -> None:
    """``ignition::reduce_logprobs`` in standard operators: writes ``out.view(-1, W)[out_rows[r]]``."""
    flat = out.view(-1, out.shape[-1])
    old = flat[out_rows]  # [rows, W]
    reported = _reported(logits, vocab_size)  # [rows, V]
    ids = [chosen.to(torch.int64).unsqueeze(1)]  # chosen, then natural, then selected: [rows, 1 + k + 128]
    if k > 0:
        ids.append(_natural_ids(reported, k))
    if token_ids is not None:
        ids.append(token_ids.to(torch.int64))
    ids = torch.cat(ids, dim=1)
    words = _pairs(ids, float_bits(_gather_values(reported, ids)))  # one bit-cast for every reported value
    alternatives = old[:, PACKED_CHOSEN_WORDS:]  # [rows, W - 2]: kept where nothing is written
    natural_rows = torch.ones_like(requested, dtype=torch.bool).unsqueeze(1)  # [rows, 1]
    written = alternatives
    if token_ids is not None:  # W - 2 == 2 * 128: selected ids fill their caller-order prefix
        counts = token_id_counts.clamp(0, MAX_SELECTED_IDS).unsqueeze(1)  # [rows, 1]
        natural_rows = counts == 0
        columns = torch.arange(alternatives.shape[1], device=out.device).unsqueeze(0)
        written = torch.where(columns < 2 * counts, words[:, PACKED_CHOSEN_WORDS + 2 * k:], alternatives)
    if k > 0:
        natural = words[:, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + 2 * k]  # [rows, 2k]
        if alternatives.shape[1] > 2 * k:
            natural = torch.cat([natural, alternatives[:, 2 * k:]], dim=1)
        written = torch.where(natural_rows, natural, written)
    new = torch.cat([words[:, :PACKED_CHOSEN_WORDS], written], dim=1)  # [rows, W]
    flat.index_put_((out_rows,), torch.where((requested != 0).unsqueeze(1), new, old))


def _invalid_prompt_row(device) -> torch.Tensor:
    """id -1, NaN, rank 0, then 20 pairs (-1, NaN): the reference's row for a target of -1."""
    pairs = [INVALID_TOKEN_ID, NAN_BITS] * NATURAL_K
    return torch.tensor([INVALID_TOKEN_ID, NAN_BITS, 0] + pairs, dtype=torch.int32, device=device)


def score_prompt_rows_standard(logits, targets, out, out_rows, vocab_size: int) -> None:
    """``ignition::score_prompt_rows`` in standard operators: every row written, invalid rows as the reference."""
    flat = out.view(-1, PROMPT_ROW_WIDTH)
    reported = _reported(logits, vocab_size)  # [rows, V]
    valid = ((targets >= 0) & (targets < vocab_size)).unsqueeze(1)  # [rows, 1]
    ids = torch.cat([targets.to(torch.int64).unsqueeze(1), _natural_ids(reported, NATURAL_K)], dim=1)  # [rows, 21]
    values = _gather_values(reported, ids)
    rank = (reported > values[:, :1]).sum(dim=1, keepdim=True) + 1  # strictly greater reported values
    words = _pairs(ids, float_bits(values))  # [rows, 42]: the target pair, then 20 alternatives
    row = torch.cat([words[:, :2], rank.to(torch.int32), words[:, 2:]], dim=1)  # [rows, 43]
    flat.index_put_((out_rows,), torch.where(valid, row, _invalid_prompt_row(out.device)))


def stable_sort_standard(values: torch.Tensor, *, stable: bool | None = None, dim: int = -1,
                         descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(stable=True)`` as one ``TopK(k = the extent, sorted=1)``: ONNX specifies that equal
    elements keep the lower index first, which is exactly a stable sort (descending or ascending)."""
    return values.topk(values.shape[dim], dim=dim, largest=descending, sorted=True)


STANDARD_FORMULATIONS = {
    "ignition.reduce_logprobs.default": reduce_logprobs_standard,
    "ignition.score_prompt_rows.default": score_prompt_rows_standard,
    "aten.sort.stable": stable_sort_standard,
}
"""Node target (as named in an exported graph) -> its standard-operator formulation."""
