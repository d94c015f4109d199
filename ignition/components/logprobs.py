"""Generation logprob reduction: the reference implementation and its opaque op.

For every requested row the reduction reports, in FP32 and from the *raw* logits:

1. the normalization ``lse = logsumexp(logits[:vocab_size])`` (FP32 accumulation);
2. the chosen token's pair ``(t, logits[t] - lse)``;
3. either the K natural alternatives, ordered by decreasing reported value and increasing
   token id for equal values (ties created by the subtraction included, -0.0 == +0.0), or,
   for a row with ``n > 0`` selected ids, those ids in caller order with the same
   normalization.

Values are stored as FP32 bit patterns inside the int32 packed output. A row with a zero
request flag is neither read nor written. Lanes ``>= vocab_size`` (padded vocabulary) never
enter. The reference works in vocabulary chunks so no ``[rows, vocabulary]`` FP32 copy is
made; it is the CPU implementation of ``ignition::reduce_logprobs`` and the oracle the
Triton launches are tested against.
"""

from __future__ import annotations

import torch

from ignition.catalog.contract import (
    INVALID_TOKEN_ID,
    MAX_SELECTED_IDS,
    NAN_BITS,
    NATURAL_K,
    PACKED_CHOSEN_WORDS,
    packed_width,
)

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VOCAB_CHUNK = 16384
ROW_BLOCK = 4

_LOW32 = 0xFFFFFFFF
_SIGN32 = 0x80000000
_NO_KEY = torch.iinfo(torch.int64).min  # below every real key (NaN maps to -inf's key)


def sort_keys(values: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (value desc, token id asc).

    High 32 bits: the order-preserving image of the FP32 value with -0.0 mapped to +0.0 and
    NaN below -inf; low 32 bits: the inverse token id, so equal values prefer smaller ids.
    """
    values = torch.where(torch.isnan(values), torch.full_like(values, float("-inf")), values)
    bits = (values + 0.0).view(torch.int32).to(torch.int64) & _LOW32  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= _SIGN32, bits ^ _LOW32, bits | _SIGN32)
    return ((ordered - _SIGN32) << 32) + (_LOW32 - token_ids.to(torch.int64))


def key_token_ids(keys: torch.Tensor) -> torch.Tensor:
    return _LOW32 - (keys & _LOW32)


def check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    """Shape, dtype and layout checks shared by every implementation; raises ValueError."""
    problems = []
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        problems.append(f"logits must be 2-D float32/bfloat16/float16, got {logits.dtype} {list(logits.shape)}")
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not 1 <= vocab_size <= (logits.shape[-1] if logits.dim() else 0):
        problems.append(f"vocab_size must be in [1, {logits.shape[-1] if logits.dim() else 0}], got {vocab_size}")
    if not 0 <= k <= NATURAL_K:
        problems.append(f"k must be in [0, {NATURAL_K}], got {k}")
    for name, tensor, dtypes in (("chosen", chosen, (torch.int32, torch.int64)), ("requested", requested, (torch.int32,)),
                                 ("out_rows", out_rows, (torch.int64,))):
        if tensor.dtype not in dtypes or list(tensor.shape) != [rows]:
            problems.append(f"{name} must be {'/'.join(str(d) for d in dtypes)} [{rows}], got {tensor.dtype} {list(tensor.shape)}")
    width = packed_width(k, token_ids is not None)
    if out.dtype != torch.int32 or out.dim() < 1 or out.shape[-1] != width or not out.is_contiguous():
        problems.append(f"out must be contiguous int32 [..., {width}], got {out.dtype} {list(out.shape)}")
    if (token_ids is None) != (token_id_counts is None):
        problems.append("token_ids and token_id_counts must be given together")
    if token_ids is not None and (token_ids.dtype != torch.int32 or list(token_ids.shape) != [rows, MAX_SELECTED_IDS]):
        problems.append(f"token_ids must be int32 [{rows}, {MAX_SELECTED_IDS}], got {token_ids.dtype} {list(token_ids.shape)}")
    if token_id_counts is not None and (token_id_counts.dtype != torch.int32 or list(token_id_counts.shape) != [rows]):
        problems.append(f"token_id_counts must be int32 [{rows}], got {token_id_counts.dtype} {list(token_id_counts.shape)}")
    if problems:
        raise ValueError("reduce_logprobs: " + "; ".join(problems))


def _normalization(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """FP32 logsumexp over the first vocab_size lanes, one vocabulary chunk at a time."""
    rows = logits.shape[0]
    running_max = torch.full((rows,), float("-inf"), dtype=torch.float32)
    running_sum = torch.zeros(rows, dtype=torch.float32)
    for start in range(0, vocab_size, VOCAB_CHUNK):
        chunk = logits[:, start:min(start + VOCAB_CHUNK, vocab_size)].float()  # [rows, chunk]; may alias fp32 input
        chunk_max = chunk.amax(dim=1)
        new_max = torch.maximum(running_max, chunk_max)
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        chunk_sum = (chunk - safe_max[:, None]).exp_().sum(dim=1)
        running_sum = running_sum * torch.exp(running_max - safe_max) + chunk_sum
        running_max = new_max
    safe_max = torch.where(torch.isinf(running_max), torch.zeros_like(running_max), running_max)
    return torch.where(torch.isinf(running_max), running_max, safe_max + torch.log(running_sum))


def _natural_alternatives(logits, lse, vocab_size, k):
    """Best k (ids, values) per row by (reported value desc, id asc); ids -1 where vocab < k."""
    rows = logits.shape[0]
    best_keys = torch.empty(rows, 0, dtype=torch.int64)
    for start in range(0, vocab_size, VOCAB_CHUNK):
        stop = min(start + VOCAB_CHUNK, vocab_size)
        values = logits[:, start:stop].float() - lse[:, None]  # reported values: [rows, chunk]
        values.masked_fill_(values.isnan(), float("-inf"))  # NaN ranks as -inf (torch.topk ranks it first)
        take = min(k, stop - start)
        top = values.topk(take, dim=1)  # torch.topk's tie order is unspecified: keys decide
        at_or_above = values >= top.values[:, -1:]
        counts = at_or_above.sum(dim=1)
        if bool((counts == take).all()):
            chunk_keys = sort_keys(top.values, top.indices + start)  # no tie straddles the cutoff
        else:  # keys only for the lanes at or above the cutoff, packed per row
            row_idx, col_idx = torch.nonzero(at_or_above, as_tuple=True)  # row-major: rows ascending
            first = torch.cumsum(counts, 0) - counts
            chunk_keys = torch.full((rows, int(counts.max())), _NO_KEY, dtype=torch.int64)
            slot = torch.arange(row_idx.numel()) - first[row_idx]
            chunk_keys[row_idx, slot] = sort_keys(values[row_idx, col_idx], col_idx + start)
        merged = torch.cat([best_keys, chunk_keys], dim=1)
        best_keys = merged.topk(min(k, merged.shape[1]), dim=1).values
    ids = key_token_ids(best_keys)
    valid = best_keys != _NO_KEY
    ids = torch.where(valid, ids, torch.full_like(ids, INVALID_TOKEN_ID))
    values = logits.gather(1, ids.clamp(min=0)).float() - lse[:, None]
    if ids.shape[1] < k:
        pad = k - ids.shape[1]
        ids = torch.cat([ids, torch.full((rows, pad), INVALID_TOKEN_ID, dtype=ids.dtype)], dim=1)
        values = torch.cat([values, torch.full((rows, pad), float("nan"))], dim=1)
        valid = torch.cat([valid, torch.zeros(rows, pad, dtype=torch.bool)], dim=1)
    return ids, torch.where(valid, values, torch.full_like(values, float("nan")))


def _gather_values(logits, lse, ids, vocab_size):
    """Reported values of caller-given ids; out-of-vocabulary ids get NaN."""
    in_vocab = (ids >= 0) & (ids < vocab_size)
    raw = logits.gather(1, torch.where(in_vocab, ids, torch.zeros_like(ids)).to(torch.int64)).float()
    return torch.where(in_vocab, raw - lse[:, None], torch.full_like(raw, float("nan")))


def _pack(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Interleave (id, FP32 bits) pairs: [rows, n] x 2 -> [rows, 2n] int32."""
    bits = (values + 0.0).view(torch.int32)  # -0.0 reported as +0.0, as ordered
    bits = torch.where(torch.isnan(values), torch.full_like(bits, NAN_BITS), bits)
    return torch.stack([ids.to(torch.int32), bits], dim=-1).reshape(ids.shape[0], 2 * ids.shape[1])


def reduce_logprobs_reference(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    """Reference implementation: writes ``out.view(-1, W)[out_rows[r]]`` for requested rows."""
    check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)
    flat_out = out.view(-1, out.shape[-1])
    requested_rows = torch.nonzero(requested != 0).flatten()
    if requested_rows.numel() == 0:
        return  # a zero request flag bypasses vocabulary reads and payload writes
    for block in requested_rows.split(ROW_BLOCK):
        first, count = int(block[0]), block.numel()
        contiguous = int(block[-1]) - first + 1 == count
        block_logits = logits[first:first + count] if contiguous else logits[block]  # a view when possible
        lse = _normalization(block_logits, vocab_size)  # [block]
        chosen_ids = chosen[block].to(torch.int64)
        packed = [_pack(chosen_ids[:, None], _gather_values(block_logits, lse, chosen_ids[:, None], vocab_size))]
        counts = token_id_counts[block] if token_id_counts is not None else torch.zeros_like(block, dtype=torch.int32)
        counts = counts.clamp(0, MAX_SELECTED_IDS)
        natural = counts == 0
        target = out_rows[block]
        if natural.any() and k > 0:
            every = bool(natural.all())
            ids, values = _natural_alternatives(block_logits if every else block_logits[natural],
                                                lse if every else lse[natural], vocab_size, k)
            flat_out[target[natural], PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + 2 * k] = _pack(ids, values)
        if (~natural).any():
            selected = token_ids[block][~natural].to(torch.int64)  # [n_rows, 128]
            values = _gather_values(block_logits[~natural], lse[~natural], selected, vocab_size)
            width = 2 * int(counts.max())
            sel_packed = _pack(selected, values)[:, :width]
            keep = torch.arange(width)[None, :] < 2 * counts[~natural][:, None]
            rows_out = target[~natural]
            existing = flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width]
            flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width] = torch.where(keep, sel_packed, existing)
        flat_out[target, :PACKED_CHOSEN_WORDS] = packed[0]


@torch.library.custom_op("ignition::reduce_logprobs", mutates_args=("out",))
def reduce_logprobs_op(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    requested: torch.Tensor,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    token_ids: torch.Tensor | None,
    token_id_counts: torch.Tensor | None,
    vocab_size: int,
    k: int,
) -> None:
    """One opaque node in exported graphs; CPU runs the reference, CUDA the Triton launches."""
    reduce_logprobs_reference(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)


@reduce_logprobs_op.register_fake
def _reduce_logprobs_fake(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)


def reduce_logprobs(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    requested: torch.Tensor,
    out: torch.Tensor,
    *,
    vocab_size: int,
    k: int = NATURAL_K,
    token_ids: torch.Tensor | None = None,
    token_id_counts: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> None:
    """Write each requested row's packed logprobs into ``out`` (int32 ``[rows, 2 + 2*A]``).

    ``A`` is 128 when ``token_ids`` is given, else ``k``. ``out_rows`` optionally maps row r
    to row ``out_rows[r]`` of ``out.view(-1, 2 + 2*A)`` (how graphs address a frame, slot
    and token position of ``completion_logprobs``); by default row r writes row r.
    """
    if out_rows is None:
        out_rows = torch.arange(logits.shape[0], device=logits.device)
    torch.ops.ignition.reduce_logprobs(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)
