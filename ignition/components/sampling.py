"""Shared token sampling that can be captured by ``torch.export``.

Everything here is plain tensor arithmetic with static shapes: no ``.item()``,
no Python branching on tensor values, no ``torch.multinomial``/``torch.rand``.
Randomness comes from a counter-based Philox4x32-10 keyed by each request's
seed and counted by its offset (the generated-token index), so a row's token
depends only on its own logits and parameters, never on batch composition or
on hidden RNG state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ignition.catalog.buffers import SAMPLING_DEFAULTS, SAMPLING_INPUTS

__all__ = [
    "GREEDY_TEMPERATURE",
    "SAMPLING_DEFAULTS",
    "SAMPLING_FIELDS",
    "SamplingTensors",
    "apply_penalties",
    "draw_sorted",
    "filtered_distribution",
    "first_argmax",
    "narrows",
    "philox4x32_10",
    "philox_uniform",
    "sample",
    "transformed_row",
    "update_output_counts",
    "window_columns",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_ROUNDS = 10
_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_BUMPS = (0x9E3779B9, 0xBB67AE85)
_UNIFORM_BITS = 24

# NOTE: like vLLM's _SAMPLING_EPS, temperatures this small are treated as
# greedy: dividing logits by ~0 overflows to inf and softmax turns it into NaN.
GREEDY_TEMPERATURE = 1e-5


# ---- Philox4x32-10 on int64 tensors ----
def _pair(first: int, second: int, device: torch.device) -> torch.Tensor:
    """int64 ``[first, second]`` built from ``arange`` (no tensor constant in a captured graph)."""
    return torch.arange(2, dtype=torch.int64, device=device) * (second - first) + first


def philox4x32_10(
    counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 block function (Salmon et al., SC11) on int64 tensors.

    ``counter`` is four tensors and ``key`` two tensors, each holding 32-bit
    words in [0, 2**32) as int64; all broadcast together. Returns the four
    output words with the broadcast shape, also in [0, 2**32).

    Both multiplications of a round run as one on a last dim of two, ``(word0, word2)`` against the two
    multipliers, as do the cross words ``(word1, word3)`` and the key: 15 graph nodes a round instead of 26. The
    full 64-bit product overflows int64, so each multiplier is split into 16-bit halves (partial products
    < 2**48).
    """
    shape = torch.broadcast_shapes(*(t.shape for t in (*counter, *key)))
    word0, word1, word2, word3 = (word.expand(shape) for word in counter)
    device = word0.device
    multiplied = torch.stack((word0, word2), dim=-1)  # [..., 2]: the words each round multiplies
    crossed = torch.stack((word1, word3), dim=-1)  # [..., 2]: the words xored into the other pair's high halves
    key_shape = torch.broadcast_shapes(*(t.shape for t in key))
    keys = torch.stack(tuple(k.expand(key_shape) for k in key), dim=-1)  # [..., 2], broadcast against the words
    low_halves = _pair(_PHILOX_MULTIPLIERS[0] & 0xFFFF, _PHILOX_MULTIPLIERS[1] & 0xFFFF, device)
    high_halves = _pair(_PHILOX_MULTIPLIERS[0] >> 16, _PHILOX_MULTIPLIERS[1] >> 16, device)
    bumps = _pair(*_PHILOX_KEY_BUMPS, device)
    swap = 1 - torch.arange(2, dtype=torch.int64, device=device)  # [1, 0]
    for round_index in range(_PHILOX_ROUNDS):
        if round_index > 0:
            keys = (keys + bumps) & _MASK32
        partial_lo = multiplied * low_halves  # < 2**48
        partial_hi = multiplied * high_halves  # < 2**48
        low = (partial_lo + ((partial_hi & 0xFFFF) << 16)) & _MASK32  # (lo0, lo1)
        high = ((partial_lo >> 16) + partial_hi) >> 16  # (hi0, hi1)
        multiplied = high.index_select(-1, swap) ^ crossed ^ keys  # (hi1 ^ word1 ^ key0, hi0 ^ word3 ^ key1)
        crossed = low.index_select(-1, swap)  # (lo1, lo0)
    return multiplied[..., 0], crossed[..., 0], multiplied[..., 1], crossed[..., 1]


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): ``int64[B], int64[B] -> float32[B, n]``.

    Key = the 64 bits of ``seed`` (low word, high word). Counter = (offset low,
    offset high, block low, block high) where block = column // 4; the block's
    four output words give columns 4*block .. 4*block+3. Column ``c`` therefore
    has the same value for every ``n > c``. Each uniform is the word's 24 high
    bits / 2**24, so 1.0 is never produced.
    """
    num_blocks = (n + 3) // 4
    seed = seed.to(torch.int64).reshape(-1, 1)  # [B, 1]
    offset = offset.to(torch.int64).reshape(-1, 1)  # [B, 1]
    block = torch.arange(num_blocks, dtype=torch.int64, device=seed.device).reshape(1, -1)  # [1, nb]
    zeros = torch.zeros_like(seed) + torch.zeros_like(block)  # [B, nb]
    counter = (
        (offset & _MASK32) + zeros,
        ((offset >> 32) & _MASK32) + zeros,
        (block & _MASK32) + zeros,
        ((block >> 32) & _MASK32) + zeros,
    )
    key = (seed & _MASK32, (seed >> 32) & _MASK32)  # NOTE: arithmetic shift then mask = raw bits
    words = torch.stack(philox4x32_10(counter, key), dim=-1)  # [B, nb, 4]
    words = words.reshape(seed.shape[0], num_blocks * 4)[:, :n]  # [B, n]
    return (words >> (32 - _UNIFORM_BITS)).to(torch.float32) * (1.0 / (1 << _UNIFORM_BITS))


# ---- Per-row sampling parameters ----
# (name, dtype) in graph-argument order, read from the catalog's SAMPLING_INPUTS table (the one source).
SAMPLING_FIELDS: tuple[tuple[str, torch.dtype], ...] = tuple(
    (spec.name, getattr(torch, spec.dtype)) for spec in SAMPLING_INPUTS
)



def _signed64(value: int) -> int:
    """Reinterpret an int in [-2**63, 2**64) as the int64 with the same 64 bits."""
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= (1 << 63) else value


# NOTE: eq=False: a generated __eq__ would compare tensors and raise on bool().
@dataclass(slots=True, eq=False)
class SamplingTensors:
    """Per-row sampling parameters, one tensor of shape ``[B]`` per field.

    Field order and dtypes are given by ``FIELDS`` (== ``SAMPLING_FIELDS``) so an
    exporter can declare them as graph inputs; ``as_tuple``/``from_tuple``
    convert to and from that flat order.
    """

    temperature: torch.Tensor  # float32[B]
    top_k: torch.Tensor  # int32[B]
    top_p: torch.Tensor  # float32[B]
    min_p: torch.Tensor  # float32[B]
    repetition_penalty: torch.Tensor  # float32[B]
    presence_penalty: torch.Tensor  # float32[B]
    frequency_penalty: torch.Tensor  # float32[B]
    seed: torch.Tensor  # int64[B]
    offset: torch.Tensor  # int64[B]

    FIELDS: ClassVar[tuple[tuple[str, torch.dtype], ...]] = SAMPLING_FIELDS

    @classmethod
    def from_requests(
        cls, requests: Sequence[Mapping[str, Any] | Any], device: torch.device | str | None = None
    ) -> SamplingTensors:
        """Build from per-request parameters (mappings or attribute objects).

        Missing or ``None`` values take ``SAMPLING_DEFAULTS``.
        Seeds may be any int in [-2**63, 2**64); they are kept as raw 64 bits.
        NOTE: an unseeded request gets seed 0; the runtime should draw a seed
        per request if it wants unseeded requests to differ.
        """
        columns: dict[str, torch.Tensor] = {}
        for name, dtype in SAMPLING_FIELDS:
            default, values = SAMPLING_DEFAULTS[name], []
            for request in requests:
                value = request.get(name) if isinstance(request, Mapping) else getattr(request, name, None)
                value = default if value is None else value
                values.append(_signed64(value) if dtype == torch.int64 else value)
            columns[name] = torch.tensor(values, dtype=dtype, device=device)  # [B]
        return cls(**columns)

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The tensors in ``FIELDS`` order."""
        return tuple(getattr(self, name) for name, _ in SAMPLING_FIELDS)

    @classmethod
    def from_tuple(cls, tensors: Sequence[torch.Tensor]) -> SamplingTensors:
        """Inverse of ``as_tuple``."""
        return cls(*tensors)

    @classmethod
    def from_buffers(cls, buffers: Mapping[str, torch.Tensor]) -> SamplingTensors:
        """The sampling inputs of a graph's argument dict, by their catalog names."""
        return cls(**{name: buffers[name] for name, _ in SAMPLING_FIELDS})


# NOTE: the dataclass spells the fields out for readers and type checkers; the table decides.
if tuple(f.name for f in fields(SamplingTensors)) != tuple(name for name, _ in SAMPLING_FIELDS) or set(
        SAMPLING_DEFAULTS) != {name for name, _ in SAMPLING_FIELDS}:
    raise ImportError("SamplingTensors fields and SAMPLING_DEFAULTS must follow "
                      "ignition.catalog.buffers.SAMPLING_INPUTS in order")


# NOTE: registering lets exported modules take SamplingTensors directly.
torch.export.register_dataclass(SamplingTensors, serialized_type_name=f"{__name__}.SamplingTensors")


# ---- Penalties, sampling, count bookkeeping ----
def apply_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingTensors
) -> torch.Tensor:
    """Repetition, frequency and presence penalties with vLLM semantics.

    ``logits [B, V]`` (any float dtype), ``output_counts int32[B, V]``,
    ``prompt_mask bool[B, V]`` -> new ``float32[B, V]``; inputs are not modified.

    1. Repetition: for tokens seen in the prompt or the output, positive
       logits are divided by the penalty, non-positive ones multiplied.
    2. Frequency: subtract ``frequency_penalty * count`` (output tokens only).
    3. Presence: subtract ``presence_penalty`` where ``count > 0``.
    """
    logits = logits.to(torch.float32)  # NOTE: may alias a float32 input; every op below is out-of-place
    output_seen = output_counts > 0  # [B, V]
    seen = prompt_mask | output_seen  # [B, V]
    repetition = params.repetition_penalty.reshape(-1, 1)  # [B, 1]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    # NOTE: the counts and flags are promoted to float32 inside each product (the same values as a converted copy,
    # without one more pass over the row)
    logits = logits - params.frequency_penalty.reshape(-1, 1) * output_counts
    logits = logits - params.presence_penalty.reshape(-1, 1) * output_seen
    return logits


def narrows(window: torch.Tensor | None, width: int) -> bool:
    """Whether a window input may pass fewer than ``width`` columns: it is present and its extent is not statically
    the whole row (a graph traced at the full extents, as ONNX's are, takes the whole-row path)."""
    return window is not None and not (isinstance(window.shape[0], int) and window.shape[0] >= width)


def window_columns(window: torch.Tensor, width: int) -> torch.Tensor:
    """``[0, T)`` for a window input of extent ``T <= width`` (its contents are never read): built from the extent
    alone, as a cumulative sum of ones on its device."""
    columns = torch.ones_like(window).cumsum(0) - 1  # [T]: 0..T-1
    torch._check(columns.shape[0] <= width)
    return columns


def transformed_row(logits: torch.Tensor, transform: torch.Tensor | None,
                    head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                    ) -> tuple[torch.Tensor, Callable[[], object]]:
    """``(row, restore)``: ``logits [B, V]`` as float32 with ``head`` applied to the columns the ``transform_window``
    bounds, and what puts ``logits`` back as it was.

    ``head(part, columns)`` maps ``part`` (float32 ``[B, T]``: columns ``[0, T)``) to its transformed values
    (``columns``: the int64 ``[T]`` column ids, None for the whole row). Without a window (or a static one of the
    row's width) the whole row is ``part``: ``row`` is a new tensor and ``restore`` does nothing. A shorter window
    copies its T columns out, transforms them and writes them back **in place**, into ``logits`` itself when it is
    float32 (a bfloat16 row's float32 copy otherwise; into a copy when the rows are not contiguous, as a mixed round's
    expanded prompt row is); the columns past ``T`` keep their raw values, which is the
    whole transform's result whenever the runtime passes a short window (no lane has a constraint or penalty).
    ``restore()`` writes the T raw columns back: the caller calls it once nothing reads ``row`` any more, before
    anything reads ``logits`` again (the logprob reduction reads the raw row). What this saves is a copy of the whole
    ``[B, vocabulary]`` float32 row each round (an out-of-place ``index_copy``); the export keeps the in-place writes
    in program order."""
    width = logits.shape[-1]
    row = logits.to(torch.float32)  # may alias a float32 input
    if not narrows(transform, width):
        return head(row, None), lambda: None
    columns = window_columns(transform, width)  # [T]
    raw = row.index_select(1, columns)  # [B, T]: a copy
    if not row.is_contiguous():  # rows that share memory (a mixed round's prompt row, expanded): out of place
        return row.index_copy(1, columns, head(raw, columns)), lambda: None
    row = row.index_copy_(1, columns, head(raw, columns))
    return row, lambda: row.index_copy_(1, columns, raw)


ARGMAX_GROUP = 128
"""Lanes per group in ``first_argmax``."""
ARGMAX_GROUPED_LANES = 1 << 16
"""``first_argmax`` takes two passes from this many lanes (rows x width) up; below it torch's argmax is as fast
(8 rows of 8,192 lanes: 26 us either way; 1 row of 2,048: 4 us against 20)."""


def first_argmax(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values.amax(-1), values.argmax(-1))`` of ``values [B, W]``: each row's maximum and the smallest index holding
    it, in two short passes. The first pass takes the maximum of each ARGMAX_GROUP lanes; the first group holding the
    row's maximum also holds its first lane, so the second pass reads that group alone. torch's CPU argmax reads a
    row one lane at a time: 0.71 ms for 8 rows of 151,936 lanes (with amax), against 0.14 ms here
    (``python -m benchmarks.sampling_rows --argmax``). argmax returns the first (smallest) index of the maximum on
    every backend torch documents; a NaN ranks above every number in both passes, so a row holding one gets its
    first NaN's index either way."""
    rows, width = values.shape
    whole = width // ARGMAX_GROUP * ARGMAX_GROUP
    count = rows * width  # both static in every graph; a symbolic count is not guarded on
    if whole == 0 or (isinstance(count, int) and count < ARGMAX_GROUPED_LANES):
        return values.amax(dim=-1), values.argmax(dim=-1)
    maxima = values.narrow(1, 0, whole).unflatten(1, (-1, ARGMAX_GROUP)).amax(dim=2)  # [B, W // G]
    if whole < width:
        maxima = torch.cat([maxima, values.narrow(1, whole, width - whole).amax(dim=1, keepdim=True)], dim=1)
    group = maxima.argmax(dim=1, keepdim=True)  # [B, 1]: the first group holding the row's maximum
    lanes = (group * ARGMAX_GROUP + torch.arange(ARGMAX_GROUP, device=values.device)).clamp(max=width - 1)  # [B, G]
    return maxima.amax(dim=1), group.squeeze(1) * ARGMAX_GROUP + values.gather(1, lanes).argmax(dim=1)


def filtered_distribution(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingTensors,
    vocab_size: int,
    window: torch.Tensor | None = None,
    transform: torch.Tensor | None = None,
    constrain: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-8 of ``sample``: ``(greedy_tokens int64[B], sorted_ids int64[B, W], probs float32[B, W])``.

    ``probs`` is the filtered, unnormalized distribution in ``sorted_ids`` order (descending); its
    kept tokens form a prefix. Speculative acceptance (components/speculative.py) reads the same
    distribution, so the target distribution has one definition.

    ``window`` (the ``sample_window`` input; only its extent W is read): steps 4-8 run over lanes ``[0, W)``. The
    runtime passes the whole row (W = V: the same result as no window) whenever a row samples; a round of greedy
    rows only passes a short prefix, whose distribution is computed and discarded (step 10 takes the step-3 token).

    ``transform`` (the ``transform_window`` input; only its extent T is read): step 2 runs over columns ``[0, T)``
    (``transformed_row``), and ``output_counts`` and ``prompt_mask`` hold those columns only (``[B, T]``).
    ``constrain(part, columns)``: the structured-output constraints (``components.constraints.sampling_logits``),
    applied to the same columns before the penalties.
    """
    width = logits.shape[-1]
    if width > vocab_size:  # padded lanes (a sharded vocabulary's padding) -> -inf: a new [B, V]
        padded = torch.arange(width, device=logits.device) >= vocab_size  # [V]
        logits = torch.where(padded.reshape(1, -1), float("-inf"), logits.to(torch.float32))

    def head(part: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
        part = part if constrain is None else constrain(part, columns)
        return apply_penalties(part, output_counts, prompt_mask, params)

    work, restore = transformed_row(logits, transform, head)

    # a row holding a NaN (whose maximum amax propagates) takes the last id
    row_max, first = first_argmax(work)  # [B] x2
    greedy_tokens = torch.where(row_max != row_max, vocab_size - 1, first)  # [B]: NaN differs from itself
    greedy_tokens = greedy_tokens.clamp(max=vocab_size - 1)

    if window is not None:  # [B, W]: the sorted width (the whole row unless every row is greedy)
        lane_ids = window_columns(window, width)  # [W]: 0..W-1
        work = work.index_select(1, lane_ids)  # a fresh row (a narrowed view would make its stride a guard)
    else:
        lane_ids = torch.arange(width, device=logits.device)  # [V]
    greedy_rows = params.temperature < GREEDY_TEMPERATURE  # [B]
    temperature = torch.where(greedy_rows, 1.0, params.temperature).reshape(-1, 1)  # [B, 1]
    scaled = work / temperature  # [B, W]: a new tensor, so nothing below reads the transformed row
    restore()  # the raw columns back into ``logits`` (``transformed_row``)
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [B, W] x2

    top_k = params.top_k.to(torch.int64)
    top_k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)  # [B]
    if window is not None:  # a short window holds fewer than top_k lanes (its result is discarded)
        top_k = top_k.clamp(max=lane_ids.shape[0])
    kth_logit = sorted_logits.gather(-1, (top_k - 1).reshape(-1, 1))  # [B, 1]
    sorted_logits = torch.where(sorted_logits >= kth_logit, sorted_logits, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V], descending

    top_p = params.top_p.reshape(-1, 1)  # [B, 1]
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1), (1, 0)).narrow(1, 0, probs.shape[1])  # [B, V]
    in_nucleus = (mass_before < top_p) | (lane_ids == 0)  # position 0 always kept
    cutoff_prob = torch.where(in_nucleus, probs, float("inf")).amin(dim=-1, keepdim=True)  # [B, 1]
    # NOTE: top_p >= 1 bypasses the cutoff: fp32 cumsum can reach 1 before the tail ends.
    keep = (probs >= cutoff_prob) | (top_p >= 1.0)
    probs = torch.where(keep, probs, 0.0)

    min_prob = params.min_p.reshape(-1, 1) * probs[:, :1]  # [B, 1]; position 0 is the max
    probs = torch.where(probs >= min_prob, probs, 0.0)
    return greedy_tokens, sorted_ids, probs


def draw_sorted(sorted_ids: torch.Tensor, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Step 9 of ``sample``: inverse CDF over ``probs [B, V]`` (sorted order) with ``uniform [B, 1]``: int64[B]."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    position = (cdf <= uniform * cdf[:, -1:]).sum(dim=-1)  # [B]
    # NOTE: kept tokens form a prefix of the sorted row. In fp32, u * total < total
    # for u <= 1 - 2**-24, so a monotone cdf never passes the last kept position;
    # the clamp guards backends whose parallel cumsum is not exactly monotone.
    last_kept = ((probs > 0).sum(dim=-1) - 1).clamp(min=0)  # [B]
    position = torch.minimum(position, last_kept)
    return sorted_ids.gather(-1, position.reshape(-1, 1)).reshape(-1)  # [B]


def sample(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingTensors,
    vocab_size: int,
    window: torch.Tensor | None = None,
    transform: torch.Tensor | None = None,
    constrain: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pick one token per row: ``logits [B, V] -> int64[B]`` (V >= vocab_size); ``window``, ``transform``: see
    ``filtered_distribution`` (a short sample window only when every row is greedy, a short transform window only
    when no row has a constraint or a penalty; ``constrain``, the constraints, see there).

    ``logits`` is left as it was (raw logits also feed the logprob reduction): a short transform window writes its
    columns in place and puts them back before ``sample`` returns (``transformed_row``).
    Lanes ``>= vocab_size`` (vocabulary padding) are never selected.

    Steps, in order:
    1. Upcast to a float32 copy; padded lanes -> -inf.
    2. The constraints (``constrain``), then the penalties (``apply_penalties``), over the transform window's
       columns (``transformed_row``).
    3. Greedy candidate: argmax of the penalized logits, ties -> smallest id.
    4. Temperature: divide by it (greedy rows divide by 1; result discarded).
    5. Sort descending (stable, so equal logits keep ascending id order).
    6. Top-k: keep logits >= the k-th largest. Tie rule: every token tied with
       the k-th value is kept (vLLM's rule), so more than k may survive.
    7. Top-p on the softmax of the top-k survivors: keep the shortest
       descending prefix whose mass reaches top_p, then also every token whose
       probability equals the last kept one (ties at the cutoff all kept).
    8. Min-p: drop tokens with probability < min_p * max probability (ratio is
       the same before or after renormalizing, so no renormalization needed).
    9. Draw by inverse CDF over the filtered probabilities in sorted order,
       with one Philox uniform per row from (seed, offset): the token is the
       first position whose cumulative mass exceeds ``u * total``.
    10. Greedy rows (temperature < GREEDY_TEMPERATURE) take the step-3 token.
    """
    greedy_tokens, sorted_ids, probs = filtered_distribution(logits, output_counts, prompt_mask, params, vocab_size,
                                                             window, transform, constrain)
    uniform = philox_uniform(params.seed, params.offset, 1)  # [B, 1]
    sampled_tokens = draw_sorted(sorted_ids, probs, uniform)
    greedy_rows = params.temperature < GREEDY_TEMPERATURE  # [B]
    return torch.where(greedy_rows, greedy_tokens, sampled_tokens).to(torch.int64)


def update_output_counts(
    output_counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """Add one to ``output_counts[slots[b], tokens[b]]`` for every active row, in place.

    ``output_counts int32[S, V]``, ``slots int64[B]``, ``tokens int64[B]``,
    ``active bool[B]`` (or an integer flag, nonzero = active). Duplicate (slot, token) pairs accumulate. Inactive rows
    add zero, and their (possibly garbage) indices are clamped into range.
    Returns ``output_counts``.
    """
    num_slots, width = output_counts.shape
    safe_slots = slots.to(torch.int64).clamp(0, num_slots - 1)  # [B]
    safe_tokens = tokens.to(torch.int64).clamp(0, width - 1)  # [B]
    increments = (active != 0).to(output_counts.dtype)  # [B]; NOTE: int32 lane flags may be any nonzero
    output_counts.index_put_((safe_slots, safe_tokens), increments, accumulate=True)
    return output_counts
