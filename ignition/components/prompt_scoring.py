"""Prompt scoring: per prompt row, the actual next token's logprob, its rank and the top 20.

For each valid row j (target t_j = prompt token at chunk_start + j + 1, or -1):

* value = logits[t_j] - logsumexp(logits[:vocab_size]) in FP32, like generation logprobs;
* rank = 1 + the number of vocabulary entries whose reported value is strictly greater;
* the 20 natural alternatives in the generation ordering (value desc, id asc, subtraction
  ties included, -0.0 == +0.0).

Row layout (int32 [43]): actual id, FP32 bits, rank, then 20 (id, FP32 bits) pairs. Invalid
rows (target -1) write id -1, NaN, rank 0 and alternative ids -1 (values NaN).

``score_hidden_rows`` projects at most 64 hidden rows at a time with the model's own head,
so the only logit matrix is ``[64, vocab_padded]``; each block calls the opaque
``ignition::score_prompt_rows`` op, whose reference (below) works in vocabulary chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ignition.catalog.buffers import PROMPT_BUFFERS, PROMPT_LOGPROBS, PROMPT_TARGETS, resolve_shape
from ignition.catalog.contract import INVALID_TOKEN_ID, NAN_BITS, NATURAL_K, PROMPT_ROW_WIDTH, SCORING_ROW_BLOCK
from ignition.catalog.enums import Role
from ignition.catalog.model import BufferDecl
from ignition.components import logprobs as L


def prompt_arguments(capacity: int):
    """The scoring buffers of a SCORED_PREFILL variant of row capacity C: declarations, bindings, layout."""
    decls = [BufferDecl(s.name, s.dtype, resolve_shape(s, C=capacity), s.role) for s in PROMPT_BUFFERS]
    bindings = {s.name: s.source for s in PROMPT_BUFFERS if s.role is Role.INPUT}
    return decls, bindings, {"buffer": PROMPT_LOGPROBS, "targets": PROMPT_TARGETS, "row_block": SCORING_ROW_BLOCK}


def check_scoring_args(logits, targets, out, out_rows, vocab_size):
    problems = []
    if logits.dim() != 2 or logits.dtype not in L.LOGIT_DTYPES:
        problems.append(f"logits must be 2-D float32/bfloat16/float16, got {logits.dtype} {list(logits.shape)}")
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not 1 <= vocab_size <= (logits.shape[-1] if logits.dim() else 0):
        problems.append(f"vocab_size must be in [1, {logits.shape[-1] if logits.dim() else 0}], got {vocab_size}")
    if targets.dtype != torch.int32 or list(targets.shape) != [rows]:
        problems.append(f"targets must be int32 [{rows}], got {targets.dtype} {list(targets.shape)}")
    if out_rows.dtype != torch.int64 or list(out_rows.shape) != [rows]:
        problems.append(f"out_rows must be int64 [{rows}], got {out_rows.dtype} {list(out_rows.shape)}")
    if out.dtype != torch.int32 or out.shape[-1] != PROMPT_ROW_WIDTH or not out.is_contiguous():
        problems.append(f"out must be contiguous int32 [..., {PROMPT_ROW_WIDTH}], got {out.dtype} {list(out.shape)}")
    if problems:
        raise ValueError("score_prompt_rows: " + "; ".join(problems))


def score_rows_reference(logits, targets, out, out_rows, vocab_size):
    check_scoring_args(logits, targets, out, out_rows, vocab_size)
    flat = out.view(-1, PROMPT_ROW_WIDTH)
    valid = (targets >= 0) & (targets < vocab_size)
    rows = torch.zeros(logits.shape[0], PROMPT_ROW_WIDTH, dtype=torch.int32, device=logits.device)
    rows[:, 0] = INVALID_TOKEN_ID
    rows[:, 1] = NAN_BITS
    rows[:, 3::2] = INVALID_TOKEN_ID
    rows[:, 4::2] = NAN_BITS
    index = torch.nonzero(valid).flatten()
    for block in index.split(L.ROW_BLOCK):
        if block.numel() == 0:
            continue
        block_logits = logits[block]
        lse = L._normalization(block_logits, vocab_size)  # [block]
        target = targets[block].to(torch.int64)
        value = block_logits.gather(1, target[:, None]).float()[:, 0] - lse  # FP32 reported value
        greater = torch.zeros(block.numel(), dtype=torch.int64, device=logits.device)
        for start in range(0, vocab_size, L.VOCAB_CHUNK):
            chunk = block_logits[:, start:min(start + L.VOCAB_CHUNK, vocab_size)].float() - lse[:, None]
            greater += (chunk > value[:, None]).sum(dim=1)  # strictly greater reported values
        ids, values = L._natural_alternatives(block_logits, lse, vocab_size, NATURAL_K)
        rows[block, 0] = target.to(torch.int32)
        rows[block, 1] = L._pack(target[:, None], value[:, None])[:, 1]
        rows[block, 2] = (greater + 1).to(torch.int32)
        rows[block, 3:] = L._pack(ids, values)
    flat[out_rows] = rows


@torch.library.custom_op("ignition::score_prompt_rows", mutates_args=("out",))
def score_prompt_rows_op(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor,
                         vocab_size: int) -> None:
    """One opaque node per row block: writes every row (invalid rows get the invalid pattern)."""
    score_rows_reference(logits, targets, out, out_rows, vocab_size)


@score_prompt_rows_op.register_fake
def _score_fake(logits, targets, out, out_rows, vocab_size):
    check_scoring_args(logits, targets, out, out_rows, vocab_size)


def score_hidden_rows(hidden: torch.Tensor, targets: torch.Tensor, out: torch.Tensor, frame: torch.Tensor,
                      head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                      row_block: int = SCORING_ROW_BLOCK) -> None:
    """Score every row of ``hidden [C, d]`` into ``out[frame]`` (``[2, C, 43]``), 64 rows at a time."""
    rows = hidden.shape[0]
    for start in range(0, rows, row_block):
        stop = min(start + row_block, rows)
        logits = head(hidden[start:stop])  # the only logit matrix: [<=64, vocab_padded]
        out_rows = frame * rows + torch.arange(start, stop, device=hidden.device)
        torch.ops.ignition.score_prompt_rows(logits, targets[start:stop], out, out_rows, vocab_size)
