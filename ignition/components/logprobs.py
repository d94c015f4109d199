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

import math

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
VOCAB_CHUNK = 16384  # lanes per normalization chunk: fixes the FP32 summation order, hence lse's bits
ROW_BLOCK = 16
"""Rows per exp-sum: a ``[ROW_BLOCK, VOCAB_CHUNK]`` FP32 scratch (1 MiB). Each row's sums are its own (a row's chunk
sum does not depend on the rows beside it), so this and ``READ_LANES`` set only how many operator calls a reduction
makes, not its words. With 8 rows a block and 16,384 lanes a read, 32 BF16 rows of 151,936 lanes at K=20 took
9.6 ms and 64 rows 19.5-21.3 ms; with these values 8.1 ms and 13.6-14.9 ms (``python -m benchmarks.reduction
--threads 2 --rows 32 --dtype bfloat16``, and ``--quick``)."""
GROUP = 128  # lanes per group maximum (the width used divides VOCAB_CHUNK: see _group_width)
ROWS_PER_PASS = 64  # rows sharing one pass: group maxima [64, vocab / GROUP]
READ_LANES = 131072
"""Lanes per candidate read, over the rows (a ``[rows, READ_LANES / rows]`` FP32 copy, 512 KiB): at 64 rows, 16 groups
of 128 a read; at 8 to 32 rows, every candidate group of K=20 (about 28) in one read."""
MERGE_EVERY = 4  # candidate reads kept ([rows, k] each) before they are merged
SPARE_GROUPS = 8  # groups ranked beyond the k-th, so ties at the floor rarely need a second ranking
FLUSH_BELOW = -87.0
"""Lanes whose shifted logit ``x - shift`` is below this add no exponential mass. Their exponentials (under
exp(-87) = 1.6e-38) sit at FP32's subnormal edge, where torch's vectorized CPU exp takes a slow path about 30x slower
a lane; nothing bounds how far a model spreads its logits. A vocabulary of 2**20 such lanes
sums to under 2e-32, against a mass that holds exp(0) = 1 from the row's maximum. With the flush, 8 rows of 151,936
lanes at a spread of 30 reduce in about 3 ms (``python -m benchmarks.reduction --threads 2 --rows 8 --spread 30
--dtype float32``)."""

_LOW32 = 0xFFFFFFFF
_NO_KEY = torch.iinfo(torch.int64).min  # below every real key (NaN maps to -inf's key)


def sort_keys(values: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (value desc, token id asc).

    High 32 bits: the order-preserving image of the FP32 value with -0.0 mapped to +0.0 and
    NaN ranked as -inf; low 32 bits: the inverse token id, so equal values prefer smaller ids.
    """
    values = torch.where(torch.isnan(values), float("-inf"), values) + 0.0  # + 0.0 turns -0.0 into +0.0
    bits = values.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # signed, order-preserving
    return ((ordered + 1) << 32) - 1 - token_ids.to(torch.int64)  # low word: 0xFFFFFFFF - id


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


def _group_width() -> int:
    """GROUP, or a divisor of it that divides VOCAB_CHUNK, so chunk maxima are maxima of groups."""
    return math.gcd(GROUP, VOCAB_CHUNK)


def _group_maxima(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Raw maximum of each group of the first vocab_size lanes: [rows, ceil(vocab_size / group width)].

    In the logits' own dtype (conversion to FP32 is exact and monotone); NaN propagates.
    """
    group = _group_width()
    whole = vocab_size // group * group
    maxima = logits[:, :whole].unflatten(1, (-1, group)).amax(dim=2)  # [rows, whole / group]
    if whole < vocab_size:
        maxima = torch.cat([maxima, logits[:, whole:vocab_size].amax(dim=1, keepdim=True)], dim=1)
    return maxima


def _normalization(logits: torch.Tensor, vocab_size: int, group_maxima: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 logsumexp over the first vocab_size lanes: ``M + log(mass)``, M the row's maximum (from the group
    maxima) and ``mass = exp_masses(logits, vocab_size, M)``.

    That order (the maximum first, then each VOCAB_CHUNK's ``sum(exp(x - M))`` added in chunk order) defines lse's
    bits; ``tests/test_logprobs_reference.py`` pins them against a plain loop. An infinite M is the result itself
    and NaN propagates. It is also a one-rank vocabulary shard's (maximum, mass) combined (``vocabulary_logprobs``).
    """
    if group_maxima is None:
        group_maxima = _group_maxima(logits, vocab_size)
    row_max = group_maxima.amax(dim=1).float()
    shift = finite_shift(row_max)
    return torch.where(torch.isinf(row_max), row_max, shift + torch.log(exp_masses(logits, vocab_size, shift)))


def finite_shift(maximum: torch.Tensor) -> torch.Tensor:
    """The shift the exponentials are taken against: ``maximum``, with 0 where it is infinite (NaN stays NaN)."""
    return torch.where(torch.isinf(maximum), 0.0, maximum)


def exp_masses(logits: torch.Tensor, vocab_size: int, shift: torch.Tensor) -> torch.Tensor:
    """Each row's FP32 ``sum(exp(x - shift))`` over its first vocab_size lanes: one sum per VOCAB_CHUNK lanes, the
    sums added in chunk order; lanes with ``x - shift < FLUSH_BELOW`` add nothing.

    ROW_BLOCK rows at a time through one reused FP32 scratch of ``[ROW_BLOCK, VOCAB_CHUNK]``: each chunk costs a
    subtraction, an exp and a sum, and no ``[rows, vocabulary]`` FP32 copy is made. The flush costs as much as the
    exp, so only row blocks with a lane below it pay for it: ``fl(min - shift)`` bounds every lane's ``fl(x - shift)``
    from below.
    """
    rows, device = logits.shape[0], logits.device
    total = torch.zeros(rows, device=device)
    scratch = torch.empty(min(ROW_BLOCK, rows), min(VOCAB_CHUNK, vocab_size), device=device)  # FP32, reused
    flushed = None
    for first in range(0, rows, ROW_BLOCK):
        last = min(first + ROW_BLOCK, rows)
        block, block_shift, block_total = logits[first:last, :vocab_size], shift[first:last], total[first:last]
        # the block's minimum, read just before its chunks (which then come from cache, not memory)
        flush = bool((block.amin(dim=1).float() - block_shift < FLUSH_BELOW).any())
        if flush and flushed is None:
            flushed = torch.empty(scratch.shape, dtype=torch.bool, device=device)
        block_scratch = scratch[:last - first]
        for chunk in block.split(VOCAB_CHUNK, dim=1):
            shifted = block_scratch if chunk.shape[1] == scratch.shape[1] else block_scratch[:, :chunk.shape[1]]
            if chunk.dtype == torch.float32:
                torch.sub(chunk, block_shift[:, None], out=shifted)
            else:  # convert in place: a promoting sub would allocate its own FP32 copy
                shifted.copy_(chunk).sub_(block_shift[:, None])
            block_total.add_(exp_mass(shifted, flushed[:last - first, :chunk.shape[1]] if flush else None))
    return total


def exp_mass(shifted: torch.Tensor, flushed: torch.Tensor | None) -> torch.Tensor:
    """Each row's ``sum(exp(shifted))`` with lanes below FLUSH_BELOW counted as 0; ``shifted`` (FP32) is overwritten
    and ``flushed`` (bool, the same shape) is scratch, or None when the caller knows no lane is below FLUSH_BELOW.
    NaN lanes stay NaN, so NaN propagates to the sum."""
    if flushed is None:
        return shifted.exp_().sum(dim=1)
    torch.lt(shifted, FLUSH_BELOW, out=flushed)
    return shifted.clamp_min_(FLUSH_BELOW).exp_().masked_fill_(flushed, 0.0).sum(dim=1)


def _natural_alternatives(logits, lse, vocab_size, k, group_maxima=None, wanted=None):
    """Best k (ids, values) per row by (reported value desc, id asc); ids -1 where vocab < k.

    Only groups that can hold a winner are read again. Rounding ``x - lse`` is monotone in x,
    so every top-k lane reports at least the value of the k-th largest group maximum, and a
    group whose maximum reports less holds no winner. The candidate groups (about k per row)
    are read a few per row at a time; each read keeps its k best lanes by (value, id), and
    sort_keys orders the kept lanes, ties created by the subtraction included. A row with a
    non-finite lse reports only NaN or -inf: all its keys tie, so ids 0..k-1 win. Rows with
    ``wanted`` False are not searched.
    """
    rows = logits.shape[0]
    if group_maxima is None:
        group_maxima = _group_maxima(logits, vocab_size)
    group = _group_width()
    whole = vocab_size // group  # groups of exactly `group` lanes; the partial last group is always read
    finite = torch.isfinite(lse)
    searched = finite if wanted is None else finite & wanted
    group_values = group_maxima[:, :whole].float() - lse[:, None]  # reported value of each group's maximum
    ranked = group_values.topk(min(k + SPARE_GROUPS, whole), dim=1)  # candidates first: [rows, k + spares]
    device = logits.device
    floor = ranked.values[:, k - 1:k] if whole > k else torch.full((rows, 1), float("-inf"), device=device)
    width = int(((ranked.values >= floor) & searched[:, None]).sum(dim=1).max())  # most candidates in a row
    if width < ranked.indices.shape[1] or width == whole:
        order = ranked.indices[:, :width]
    else:  # ties at the floor may outnumber the spares: count and rank every group (row blocks keep temporaries small)
        candidate = (group_values >= floor) & searched[:, None]
        width = max(int(block.sum(dim=1, dtype=torch.int32).max()) for block in candidate.split(8))
        order = group_values.topk(width, dim=1).indices
    del group_values

    grouped = logits[:, :whole * group].unflatten(1, (whole, group))  # a view: [rows, whole, group]
    every_row = torch.arange(rows, device=device)[:, None]
    tail = logits[:, whole * group:vocab_size]  # the partial last group, read whole (none: skipped, unless alone)
    kept = [_keep_best(tail, lse, torch.tensor([[whole * group]], device=device), group, k)] \
        if tail.shape[1] or order.shape[1] == 0 else []
    step = max(1, READ_LANES // (rows * group))
    for column in range(0, order.shape[1], step):  # padding columns read non-candidate groups: harmless
        picked = order[:, column:column + step].sort(dim=1).values  # [rows, step] groups, ascending
        kept.append(_keep_best(grouped[every_row, picked].flatten(1), lse, picked * group, group, k))
        if len(kept) == MERGE_EVERY:  # bounded memory even when every group is a candidate
            kept = [_merge_kept(kept, k)]
    ids = _merge_kept(kept, k)[1]
    if ids.shape[1] < k:  # vocabulary smaller than k
        ids = torch.cat([ids, torch.full((rows, k - ids.shape[1]), INVALID_TOKEN_ID, device=device)], dim=1)
    smallest_ids = torch.arange(k, device=device).expand(rows, k)
    ids = torch.where(finite[:, None], ids, torch.where(smallest_ids < vocab_size, smallest_ids, INVALID_TOKEN_ID))
    values = logits.gather(1, ids.clamp(min=0)).float() - lse[:, None]
    return ids, torch.where(ids >= 0, values, float("nan"))


def _keep_best(raw, lse, group_starts, group, k):
    """(values, ids) of each row's best min(k, lanes) lanes by (value desc, id asc).

    raw: [rows, lanes], consecutive runs of ``group`` lanes (the last may be shorter) holding the
    tokens group_starts[:, g] + 0, 1, ...; group_starts ascends along each row.
    """
    values = torch.sub(raw, lse[:, None]).nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    rows, lanes = values.shape
    group_starts = group_starts.expand(rows, -1)
    if lanes > k:
        top = values.topk(k + 1, dim=1)  # torch.topk's tie order is unspecified
        if bool((top.values[:, k] < top.values[:, k - 1]).all()):  # no tie straddles the k-th value
            index = top.indices[:, :k]
            return top.values[:, :k], group_starts.gather(1, index // group) + index % group
    token_ids = (group_starts[:, :, None] + torch.arange(group, device=raw.device)).flatten(1)[:, :lanes]  # ascending
    if lanes <= k:
        return values, token_ids
    kth = top.values[:, k - 1:k]
    tied = values == kth
    short = k - (top.values[:, :k] > kth).sum(dim=1, keepdim=True)  # every lane above the k-th is in top
    take = (values > kth) | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= short))  # ties: smallest ids
    return values[take].view(rows, k), token_ids[take].view(rows, k)


def _merge_kept(kept, k):
    """One (values, ids) pair: the best min(k, total) of the kept lanes, in key order."""
    values = torch.cat([v for v, _ in kept], dim=1)
    token_ids = torch.cat([t for _, t in kept], dim=1)
    best = sort_keys(values, token_ids).topk(min(k, values.shape[1]), dim=1).indices
    return values.gather(1, best), token_ids.gather(1, best)


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
    for first, count in _row_runs(requested):
        block_logits = logits[first:first + count]  # a view: rows are never copied
        maxima = _group_maxima(block_logits, vocab_size)  # [block, groups]
        lse = _normalization(block_logits, vocab_size, maxima)  # [block]
        chosen_ids = chosen[first:first + count].to(torch.int64)
        chosen_pair = _pack(chosen_ids[:, None], _gather_values(block_logits, lse, chosen_ids[:, None], vocab_size))
        counts = None if token_ids is None else token_id_counts[first:first + count].clamp(0, MAX_SELECTED_IDS)
        if counts is None or not bool(counts.any()):  # every row natural: chosen pair and K pairs in one write
            words = chosen_pair if k == 0 else \
                torch.cat([chosen_pair, _pack(*_natural_alternatives(block_logits, lse, vocab_size, k, maxima))], 1)
            flat_out.narrow(1, 0, words.shape[1]).index_copy_(0, out_rows[first:first + count], words)
            continue
        block = torch.arange(first, first + count, device=logits.device)
        natural = counts == 0
        target = out_rows[block]
        if natural.any() and k > 0:
            ids, values = _natural_alternatives(block_logits, lse, vocab_size, k, maxima, natural)
            flat_out[target[natural], PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + 2 * k] = _pack(ids, values)[natural]
        if (~natural).any():
            selected = token_ids[block].to(torch.int64)  # [block, 128]; rows with natural alternatives dropped below
            values = _gather_values(block_logits, lse, selected, vocab_size)
            width = 2 * int(counts.max())
            sel_packed = _pack(selected, values)[~natural, :width]
            keep = torch.arange(width, device=logits.device)[None, :] < 2 * counts[~natural][:, None]
            rows_out = target[~natural]
            existing = flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width]
            flat_out[rows_out, PACKED_CHOSEN_WORDS:PACKED_CHOSEN_WORDS + width] = torch.where(keep, sel_packed, existing)
        flat_out[target, :PACKED_CHOSEN_WORDS] = chosen_pair


def _row_runs(requested: torch.Tensor) -> list[tuple[int, int]]:
    """(first row, row count) of each run of consecutive requested rows, at most ROWS_PER_PASS long."""
    runs = []
    for row in torch.nonzero(requested != 0).flatten().tolist():
        first, count = runs[-1] if runs else (-2, 0)
        if first + count == row and count < ROWS_PER_PASS:
            runs[-1] = (first, count + 1)
        else:
            runs.append((row, 1))
    return runs


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
