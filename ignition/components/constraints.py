"""Structured-output constraints on the sampling logits: the token bitmask and the sparse logit bias.

``sampling_logits`` turns a graph's raw logit rows into the rows its sampler reads; the raw rows are never
modified, so the logprob reduction (which reads them) reports the unconstrained model's logprobs, as the
contract requires ("report logits[t] - logsumexp(logits) ... before every sampling transformation").

Steps, in order, for each lane (row):

1. the bitmask (``token_bitmask int32 [capacity, VOCAB_WORDS]``): bit ``i`` of word ``w`` allows token
   ``32*w + i``; a disallowed token's sampling logit becomes -inf. A row with no bit set leaves the lane
   unmasked (idle lanes and unconstrained requests upload zeros; a constrained request always allows at
   least one token, which the host checks before upload);
2. the bias (``logit_bias_ids int64 [capacity, B]``, ``logit_bias_values float32 [capacity, B]``): each
   entry with an id >= 0 adds its value to that token's sampling logit (ids are distinct per lane).

Everything is elementwise or a scatter over static shapes, in standard operators only (no shifts: ONNX's
BitShift takes unsigned types only), so it exports to ``.pt2`` and ONNX alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ignition.catalog.buffers import BIAS_IDS, BIAS_VALUES, TOKEN_BITMASK
from ignition.catalog.contract import BITMASK_WORD_BITS

__all__ = ["allowed_tokens", "apply_logit_bias", "sampling_logits"]


def allowed_tokens(bitmask: torch.Tensor, width: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """``int32 [B, W] -> bool [B, width]``: token ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set,
    or when its row has no bit set at all (an unmasked lane). ``width <= 32 * W``. ``columns`` (int64 ``[T]``, token
    ids): those tokens only, ``bool [B, T]``."""
    rows = bitmask.shape[0]
    bit_values = torch.pow(2, torch.arange(BITMASK_WORD_BITS, dtype=torch.int64, device=bitmask.device))  # [32]
    words = bitmask.to(torch.int64) & 0xFFFFFFFF  # [B, W]: the 32 bits as a non-negative int64
    if columns is None:
        bits = (words.unsqueeze(-1) & bit_values) != 0  # [B, W, 32]
        allowed = bits.reshape(rows, -1)[:, :width]  # [B, width]
    else:  # each token's word and bit: [B, T]
        word = columns // BITMASK_WORD_BITS
        allowed = (words.index_select(1, word) & bit_values.index_select(0, columns - word * BITMASK_WORD_BITS)) != 0
    masked = (bitmask != 0).any(dim=1, keepdim=True)  # [B, 1]
    return allowed | ~masked


def apply_logit_bias(logits: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor) -> torch.Tensor:
    """``float32 [B, V]`` plus each row's sparse bias (``int64 [B, N]`` ids, -1 empty; ``float32 [B, N]``): a new
    tensor. Empty entries, and ids past the row (a ``transform_window`` narrower than the vocabulary), add 0 to a
    clamped index, which leaves every value (-inf included) unchanged."""
    present = (bias_ids >= 0) & (bias_ids < logits.shape[1])
    safe_ids = bias_ids.clamp(0, logits.shape[1] - 1)  # [B, N]
    return logits.scatter_add(1, safe_ids, torch.where(present, bias_values, 0.0))


def sampling_logits(buffers: Mapping[str, torch.Tensor], logits: torch.Tensor,
                    columns: torch.Tensor | None = None) -> torch.Tensor:
    """The rows the sampler reads: ``logits [B, V]`` itself in a variant without the constraint inputs, else a
    float32 copy with the bitmask and the bias applied (steps 1-2 above). ``logits`` is never modified.
    ``columns`` (int64 ``[T]``: ``0..T-1``): ``logits`` holds those tokens' columns only (``[B, T]``; see
    ``components.sampling.transformed_row``)."""
    if TOKEN_BITMASK not in buffers:
        return logits
    width = logits.shape[1]
    allowed = allowed_tokens(buffers[TOKEN_BITMASK], width, columns)  # [B, V]
    work = torch.where(allowed, logits.to(torch.float32), float("-inf"))  # a new tensor: raw rows stay raw
    return apply_logit_bias(work, buffers[BIAS_IDS], buffers[BIAS_VALUES])
