"""The prompt-scoring reduction against an fp64 numpy oracle: ids, ranks (ties), alternatives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ignition.components.logprobs as L
from ignition.catalog.contract import NAN_BITS
from ignition.components.prompt_scoring import score_hidden_rows, score_prompt_rows_op

ATOL = 5e-6  # as in test_logprobs_reference: FP32 normalization vs fp64


def score(logits, targets, vocab_size=None):
    out = torch.full((1, logits.shape[0], 43), -5, dtype=torch.int32)
    score_prompt_rows_op(logits, targets, out, torch.arange(logits.shape[0]), vocab_size or logits.shape[1])
    return out[0]


@pytest.mark.parametrize("chunk", [None, 32])
def test_rows_match_oracle(monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(L, "VOCAB_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 150, generator=g) * 3
    logits[2, :60] = logits[2, 7]  # a plateau: equal values share a rank
    logits[:, 140:] = 1e30  # padded lanes
    targets = torch.tensor([3, -1, 7, 139, 0], dtype=torch.int32)
    out = score(logits, targets, vocab_size=140)
    x = logits[:, :140].double()
    lse32 = L._normalization(logits, 140)
    for r, t in enumerate(targets.tolist()):
        if t < 0:
            assert out[r, 0] == -1 and out[r, 1] == NAN_BITS and out[r, 2] == 0
            assert (out[r, 3::2] == -1).all() and (out[r, 4::2] == NAN_BITS).all()
            continue
        values32 = (logits[r, :140].float() - lse32[r]).numpy()
        assert out[r, 0] == t
        assert abs(out[r, 1].view(torch.float32).item() - (x[r, t] - torch.logsumexp(x[r], 0)).item()) < ATOL
        assert out[r, 2] == 1 + int(np.sum(values32 > values32[t]))
        order = sorted(range(140), key=lambda i: (-values32[i], i))[:20]
        assert out[r, 3::2].tolist() == order
    assert out[2, 2] == 1 + int(np.sum((logits[2, :140] > logits[2, 7]).numpy()))


def test_hidden_rows_are_projected_in_blocks_of_64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(130, 8, generator=g)
    head_weight = torch.randn(40, 8, generator=g)
    seen = []

    def head(rows):
        seen.append(rows.shape[0])
        return rows @ head_weight.T

    targets = torch.randint(-1, 40, (130,), generator=g, dtype=torch.int32)
    out = torch.full((2, 130, 43), 9, dtype=torch.int32)
    score_hidden_rows(hidden, targets, out, torch.tensor([1]), head, 40)
    assert seen == [64, 64, 2]
    assert (out[0] == 9).all()
    blocks = [(0, 64), (64, 128), (128, 130)]  # same row blocks, so BLAS rounds the logits identically
    expected = torch.cat([score(hidden[a:b] @ head_weight.T, targets[a:b], 40) for a, b in blocks])
    assert torch.equal(out[1], expected)
