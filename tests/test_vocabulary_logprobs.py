"""The vocabulary-sharded reduction and prompt scoring against the single-rank reference.

The ranks run in one process here: an all-gather's result is the same on every rank, so each
exchange is the concatenation of every rank's stage output (``SimulatedGroup``), which also
counts the bytes handed to the collectives. The exported graphs run the same stage ops with real
gloo all-gathers in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ignition.catalog.contract import MAX_SELECTED_IDS, PROMPT_ROW_WIDTH, packed_width
from ignition.catalog.parallel import EXCHANGES, EXCHANGE_WORDS, SCORING_EXCHANGE_WORDS, padded_vocabulary, shard_rule
from ignition.components import logprobs as L
from ignition.components import prompt_scoring as P
from ignition.components import vocabulary_logprobs as V
from ignition.recipes.base import RecipeError
from ignition.recipes.sharding import check_tensor_parallel, shard_weights

K = 20


class SimulatedGroup:
    """Every rank's stage in turn; an exchange is the rank-ordered concatenation (what all-gather returns)."""

    def __init__(self, logits: torch.Tensor, ranks: int):
        self.ranks, self.shard = ranks, logits.shape[1] // ranks
        self.logits = [logits[:, r * self.shard:(r + 1) * self.shard].clone() for r in range(ranks)]
        self.sent_bytes = 0

    def gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        self.sent_bytes += sum(p.numel() * p.element_size() for p in parts)
        return torch.cat(parts)

    def reduce(self, chosen, requested, out, ids, counts, vocab_size, k=K):
        stats = self.gather([V.shard_statistics(x, requested, r * self.shard, vocab_size)
                             for r, x in enumerate(self.logits)])
        cands = self.gather([V.shard_candidates(x, stats, chosen, requested, ids, counts, r * self.shard, vocab_size)
                             for r, x in enumerate(self.logits)])
        V.merge_vocabulary_logprobs(stats, cands, chosen, requested, out, torch.arange(chosen.shape[0]), ids, counts,
                                    vocab_size, self.shard, k)

    def score(self, targets, out, vocab_size):
        stats = self.gather([V.score_shard_statistics(x, targets, r * self.shard, vocab_size)
                             for r, x in enumerate(self.logits)])
        cands = self.gather([V.score_shard_candidates(x, stats, targets, r * self.shard, vocab_size)
                             for r, x in enumerate(self.logits)])
        V.merge_prompt_scores(stats, cands, targets, out, torch.arange(targets.shape[0]), vocab_size, self.shard)


def adversarial_logits(rows: int, vocab_size: int, ranks: int, seed: int) -> torch.Tensor:
    """Random logits over the padded vocabulary with raw ties, subtraction ties, -0.0, -inf, huge padding."""
    g = torch.Generator().manual_seed(seed)
    padded = padded_vocabulary(vocab_size, ranks)
    logits = torch.randn(rows, padded, generator=g) * 3
    logits[:, vocab_size:] = 1e30  # padding lanes hold huge values: they must never enter
    logits[1, :vocab_size:3] = 2.0  # raw ties across every shard
    logits[2, : vocab_size // 2] = float("-inf")
    logits[2, vocab_size // 2:vocab_size] = -0.0
    logits[3, :vocab_size] = torch.linspace(5.0, 5.0 + 2e-6, vocab_size)  # ties only after subtracting lse
    logits[4, :vocab_size] = float("-inf")  # a fully masked row: lse = -inf
    logits[5, 7 % vocab_size] = float("inf")  # lse = +inf
    return logits


def ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs().float()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def assert_values_close(reference_bits, sharded_bits, lse):
    """Same NaN pattern; elsewhere within 2 FP32 ulp of the normalization (the only quantity that differs)."""
    a, b = reference_bits.view(torch.float32), sharded_bits.view(torch.float32)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    finite = torch.isfinite(a)
    assert torch.equal(a[~finite & ~torch.isnan(a)], b[~finite & ~torch.isnan(a)])
    bound = 2 * ulp(lse)[:, None].expand_as(a)
    assert bool(((a - b).abs() <= bound)[finite].all()), ((a - b).abs() / bound)[finite].max()


@pytest.mark.parametrize("ranks,vocab_size", [(2, 1000), (4, 1001), (4, 37), (4, 5), (2, 19)])
def test_sharded_reduction_matches_single_rank(ranks, vocab_size):
    rows = 8
    logits = adversarial_logits(rows, vocab_size, ranks, seed=vocab_size)
    g = torch.Generator().manual_seed(ranks)
    chosen = torch.randint(0, vocab_size, (rows,), generator=g)
    requested = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.int32)
    ids = torch.randint(-2, vocab_size + 3, (rows, MAX_SELECTED_IDS), generator=g, dtype=torch.int32)
    counts = torch.tensor([0, 0, 0, 0, 0, 0, 3, 128], dtype=torch.int32)
    counts[5] = 5  # the +inf row reports selected ids
    width = packed_width(K, True)
    reference = torch.full((rows, width), 77, dtype=torch.int32)
    L.reduce_logprobs_reference(logits, chosen, requested, reference, torch.arange(rows), ids, counts, vocab_size, K)
    sharded = torch.full((rows, width), 77, dtype=torch.int32)
    group = SimulatedGroup(logits, ranks)
    group.reduce(chosen, requested, sharded, ids, counts, vocab_size)

    id_words = torch.ones(width, dtype=torch.bool)
    id_words[1::2] = False
    assert torch.equal(reference[:, id_words], sharded[:, id_words])  # ids and their order, bit for bit
    assert torch.equal(reference[6], sharded[6])  # an unrequested row is not written
    lse = torch.logsumexp(logits[:, :vocab_size].double(), dim=1).float()
    assert_values_close(reference[:, 1::2], sharded[:, 1::2], torch.where(torch.isfinite(lse), lse, 0.0))
    assert group.sent_bytes == 2 * ranks * rows * EXCHANGE_WORDS * 4  # two exchanges, never a vocabulary matrix


@pytest.mark.parametrize("ranks,vocab_size", [(2, 1000), (4, 1001), (4, 6)])
def test_sharded_prompt_scores_match_single_rank(ranks, vocab_size):
    rows = 7
    logits = adversarial_logits(rows, vocab_size, ranks, seed=vocab_size + 1)[:, :padded_vocabulary(vocab_size, ranks)]
    logits[4:] = torch.randn(3, logits.shape[1]) * 3  # scoring rows come from finite hidden states
    logits[4:, vocab_size:] = 1e30
    g = torch.Generator().manual_seed(vocab_size)
    targets = torch.randint(0, vocab_size, (rows,), generator=g, dtype=torch.int32)
    targets[0] = -1  # the prompt end
    reference = torch.zeros(rows, PROMPT_ROW_WIDTH, dtype=torch.int32)
    P.score_rows_reference(logits, targets, reference, torch.arange(rows), vocab_size)
    sharded = torch.zeros(rows, PROMPT_ROW_WIDTH, dtype=torch.int32)
    group = SimulatedGroup(logits, ranks)
    group.score(targets, sharded, vocab_size)
    value_words = torch.zeros(PROMPT_ROW_WIDTH, dtype=torch.bool)
    value_words[1] = True
    value_words[4::2] = True
    assert torch.equal(reference[:, ~value_words], sharded[:, ~value_words])  # ids, ranks and order
    lse = torch.logsumexp(logits[:, :vocab_size].double(), dim=1).float()
    assert_values_close(reference[:, value_words], sharded[:, value_words], torch.where(torch.isfinite(lse), lse, 0.0))
    assert group.sent_bytes == 2 * ranks * rows * SCORING_EXCHANGE_WORDS * 4


def test_exchange_bytes_do_not_grow_with_the_vocabulary():
    sizes = []
    for vocab_size in (64, 4096):
        logits = torch.randn(3, vocab_size)
        group = SimulatedGroup(logits, 2)
        out = torch.zeros(3, packed_width(K, True), dtype=torch.int32)
        group.reduce(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int32), out,
                     torch.zeros(3, MAX_SELECTED_IDS, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), vocab_size)
        sizes.append(group.sent_bytes)
    assert sizes[0] == sizes[1] == 2 * 2 * 3 * EXCHANGE_WORDS * 4


def test_exchange_layouts_fit_their_words():
    for exchange in EXCHANGES:
        assert all(first + count <= exchange.words for _, first, count in exchange.layout), exchange.name
    assert [e.words for e in EXCHANGES] == [EXCHANGE_WORDS, EXCHANGE_WORDS, SCORING_EXCHANGE_WORDS,
                                            SCORING_EXCHANGE_WORDS]


def test_heads_that_do_not_divide_are_refused_by_name():
    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=64)
    check_tensor_parallel("qwen3", cfg, 2)
    with pytest.raises(RecipeError, match=r"num_heads = 4 is not divisible by 3.*num_kv_heads = 2 is not divisible"):
        check_tensor_parallel("qwen3", cfg, 3)
    with pytest.raises(RecipeError, match="num_kv_heads = 2 is not divisible by 4"):
        check_tensor_parallel("llama", cfg, 4)
    with pytest.raises(RecipeError, match="recipe toy has no sharded layout"):
        check_tensor_parallel("toy", cfg, 2)


def test_shard_weights_split_pad_and_keep_biases_once():
    weights = {"embed": torch.arange(10.0).view(5, 2), "layers.0.q_proj": torch.arange(8.0).view(4, 2),
               "layers.0.o_proj": torch.arange(8.0).view(2, 4), "layers.0.o_bias": torch.ones(2),
               "layers.0.attn_norm": torch.ones(2)}
    shards = shard_weights(weights, 2, padded_vocabulary(5, 2))
    assert shards[1]["embed"].tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]  # padded with a zero row
    assert shards[0]["layers.0.q_proj"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert shards[1]["layers.0.o_proj"].tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert shards[0]["layers.0.o_bias"].tolist() == [1.0, 1.0] and shards[1]["layers.0.o_bias"].tolist() == [0.0, 0.0]
    assert shard_rule("layers.0.attn_norm").kind == "replicated"


def test_sharded_scoring_traces_its_two_exchanges():
    """torch.export of prompt scoring at rank 1 of 2 records two 64-word all-gathers (TP-EXCHANGE holds)."""
    from ignition.exporter.sharded import fake_process_group
    from ignition.recipes.sharding import TensorParallel
    from ignition.validate.parallel import check_program

    class Scoring(torch.nn.Module):
        def forward(self, hidden, targets, out, frame, head):
            shard = TensorParallel(rank=1, ranks=2, vocab_size=151, vocab_padded=152).vocabulary
            V.score_hidden_rows_sharded(shard, hidden, targets, out, frame, lambda rows: rows @ head.T)
            return (out,)

    args = (torch.zeros(8, 4), torch.zeros(8, dtype=torch.int32), torch.zeros(2, 8, PROMPT_ROW_WIDTH, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64), torch.zeros(76, 4))
    with fake_process_group(1, 2) as group:
        program = torch.export.export(Scoring(), args, strict=False)
    gathers = [n for n in program.graph.nodes if "all_gather_into_tensor" in str(n.target)]
    assert [list(n.args[0].meta["val"].shape) for n in gathers] == [[8, SCORING_EXCHANGE_WORDS]] * 2
    assert check_program(program, {"tensor_parallel": {"ranks": 2, "group": group}}, "scoring") == []
    assert [v.rule for v in check_program(program, {"tensor_parallel": {"ranks": 4, "group": group}}, "x")] == \
        ["TP-RANKS", "TP-RANKS"]
