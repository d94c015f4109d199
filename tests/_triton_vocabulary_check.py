"""Runs the six sharded Triton launches under TRITON_INTERPRET=1 against the torch reference stages.

Started in one subprocess by tests/test_triton_vocabulary.py (the interpreter must be enabled before
Triton is imported). The ranks run in this process; an all-gather is the rank-ordered concatenation.
Every case is checked three ways, at TP=2 and TP=4:

1. stage by stage on the *same* inputs (the reference's gathered exchanges): exchange 1's words are
   bit-identical except the mass (word 1: the launches sum exp() per tile, the reference per 16384-lane
   chunk), which is within MASS_TOLERANCE relative; exchange 2's words and the packed output are
   bit-identical (every word, sentinel rows included);
2. for the cases marked ``pipeline``, the all-Triton pipeline against the all-reference pipeline: ids and
   untouched words exact, values within 2**-17 + 2**-22 * (|lse| + |value|) (tests/_triton_interp_check.py
   explains the bound);
3. the all-Triton pipeline's ids against the single-rank reference (TP=1).

The ``score_*`` cases check sharded prompt scoring's seven launches the same three ways against
``score_shard_statistics`` / ``score_shard_candidates`` / ``merge_prompt_scores`` (exchange 1 except
its mass word, exchange 2 and the 43-word rows bit for bit; ids against single-rank scoring). On the
CPU the reference normalization uses numpy's expf/logf, as the interpreter does (``_numpy_normalization``).

    python tests/_triton_vocabulary_check.py [--device cuda] [--only PREFIX]  -> one JSON line per case
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, packed_width
from ignition.catalog.parallel import EXCHANGE_WORDS, SCORING_LAUNCHES, padded_vocabulary
from ignition.components import vocabulary_logprobs as V
from ignition.components.logprobs import reduce_logprobs_reference
from ignition.components.prompt_scoring import score_rows_reference
from ignition.components.triton_scoring import TritonScoring, scoring_launch_plan
from ignition.components.triton_vocabulary import TritonVocabulary, stage_launches, vocabulary_launch_plan

SENTINEL = 0x5A5A5A5A


def _numpy_normalization(maxima, masses):
    """``V.global_normalization`` with numpy's float32 exp/log, the functions Triton's interpreter runs for
    ``_exp``/``_log`` (it has no libdevice): numpy's and torch's CPU expf differ in the last bit for some
    inputs, so on CPU the reference stages use this and every exchange word stays comparable bit for bit.
    Same operations in the same order; on CUDA nothing is replaced (libdevice is torch's expf/logf)."""
    import numpy as np

    with np.errstate(all="ignore"):
        m, s = maxima.float().numpy(), masses.float().numpy()
        top = m.max(axis=0)  # NaN propagates, as torch's amax
        shift = np.where(np.isinf(top), np.float32(0), top).astype(np.float32)
        total = np.zeros_like(top)
        for rank in range(m.shape[0]):
            total = (total + s[rank] * np.exp((m[rank] - shift).astype(np.float32))).astype(np.float32)
        lse = np.where(np.isinf(top), top, (shift + np.log(total)).astype(np.float32)).astype(np.float32)
    return torch.from_numpy(lse)

MASS_TOLERANCE = 2.0**-18  # relative: both sums carry < (log2(lanes) + 2) eps with exp() within 2 ulp
DEVICE = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""  # a case-name prefix (development)
if DEVICE == "cpu":
    V.global_normalization = _numpy_normalization


def make_case(name, logits, ranks, vocab_size, *, k=NATURAL_K, requested=None, chosen=None, ids=None, counts=None,
              pipeline=False):
    rows = logits.shape[0]
    requested = torch.ones(rows, dtype=torch.int32) if requested is None else torch.tensor(requested, dtype=torch.int32)
    chosen = torch.arange(rows, dtype=torch.int64) * 7 % vocab_size if chosen is None else torch.tensor(chosen)
    token_ids = token_counts = None
    if ids is not None:
        token_ids = torch.full((rows, MAX_SELECTED_IDS), -7, dtype=torch.int32)
        for r, row_ids in enumerate(ids):
            token_ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        token_counts = torch.tensor(counts, dtype=torch.int32)
    return name, dict(logits=logits, ranks=ranks, vocab_size=vocab_size, k=k, requested=requested, chosen=chosen,
                      token_ids=token_ids, counts=token_counts, pipeline=pipeline)


def padded(rows, vocab_size, ranks, generator, dtype=torch.float32, scale=3.0):
    logits = torch.randn(rows, padded_vocabulary(vocab_size, ranks), generator=generator) * scale
    logits[:, vocab_size:] = 1e30  # padding lanes hold huge values: they must never enter
    return logits.to(dtype)


def cases():
    g = torch.Generator().manual_seed(7)
    for ranks in (4,):  # TP=2 over an uneven vocabulary: tp2_explicit_ids_fp32
        uneven = padded(6, 1823, ranks, g)  # 1823 lanes: the last shard is partly padding
        uneven[1, :1823:3] = 2.0  # raw ties across every shard
        uneven[2, :911] = float("-inf")
        uneven[2, 911:1823] = -0.0
        uneven[3, :1823] = torch.linspace(5.0, 5.0 + 2e-6, 1823)  # ties only after subtracting lse
        uneven[4, :1823] = float("-inf")  # lse = -inf
        uneven[5, 1500] = float("inf")  # lse = +inf
        yield make_case(f"tp{ranks}_uneven_adversarial_fp32", uneven, ranks, 1823, chosen=[0, 1822, 911, 5, 3, 1500],
                        pipeline=True)
    nan = padded(3, 1000, 4, g)
    nan[0, 999] = float("nan")  # a NaN lane in the last shard: lse NaN everywhere
    nan[1, 3] = float("nan")
    nan[1, 600] = float("inf")
    nan[2, [10, 700]] = float("inf")  # two +inf lanes on different ranks
    yield make_case("tp4_nan_inf_fp32", nan, 4, 1000, k=5, chosen=[999, 600, 700])
    ids = padded(5, 1823, 2, g)
    yield make_case("tp2_explicit_ids_fp32", ids, 2, 1823, pipeline=True, requested=[1, 1, 0, 1, 1], chosen=[3, 1823, 4, 1822, -1],
                    ids=[[1822, -5, 0, 1823, 7, 911, 912], [9], [1, 2], list(range(1822, 1822 - 128, -1)),
                         [2**31 - 1, 1824, 455, 456, 1367]],
                    counts=[7, 0, 2, MAX_SELECTED_IDS, 5])
    g4 = torch.Generator().manual_seed(11)
    small = padded(3, 100, 4, g4, torch.bfloat16, scale=1.0)  # 4 shards of 25 lanes: all in the vocabulary
    yield make_case("tp4_bf16_ties_k0", small, 4, 100, k=0)
    wholly = padded(3, 30, 4, g4)  # padded to 32, shards of 8: lanes 30, 31 are padding
    wide = torch.cat([wholly[:, :30], torch.full((3, 34), 1e30)], dim=1)  # 64 lanes, shards of 16: rank 2, 3 pad
    yield make_case("tp4_shards_wholly_in_padding_fp32", wide, 4, 30, chosen=[29, 30, 63])
    yield make_case("tp2_fp16_k5_mixed_requests", padded(4, 3001, 2, g4, torch.float16), 2, 3001, k=5,
                    requested=[0, 1, 0, 1])


def shards(case):
    logits, ranks = case["logits"], case["ranks"]
    width = logits.shape[1] // ranks
    return [logits[:, r * width:(r + 1) * width].contiguous().to(DEVICE) for r in range(ranks)], width


def reference_pipeline(case, parts, width, out):
    args = (case["chosen"], case["requested"], case["token_ids"], case["counts"])
    chosen, requested, ids, counts = [t.to(DEVICE) if t is not None else None for t in args]
    stats = torch.cat([V.shard_statistics(x, requested, r * width, case["vocab_size"]) for r, x in enumerate(parts)])
    cands = torch.cat([V.shard_candidates(x, stats, chosen, requested, ids, counts, r * width, case["vocab_size"])
                       for r, x in enumerate(parts)])
    V.merge_vocabulary_logprobs(stats, cands, chosen, requested, out, torch.arange(len(chosen), device=DEVICE), ids,
                                counts, case["vocab_size"], width, case["k"])
    return stats, cands


def words_differ(label, got, want, skip_word=None):
    got, want = got.cpu().contiguous().view(torch.int32), want.cpu().contiguous().view(torch.int32)
    differ = got != want
    if skip_word is not None:
        differ[:, skip_word] = False
    if differ.any():
        where = differ.nonzero()[:4].tolist()
        return [f"{label}: words differ at {where}: {[got[tuple(i)].item() for i in where]} vs "
                f"{[want[tuple(i)].item() for i in where]}"]
    return []


def check(name, case):
    parts, width = shards(case)
    ranks = [TritonVocabulary() for _ in parts]  # one process (and workspace) per rank
    vocab_size, k, rows = case["vocab_size"], case["k"], case["logits"].shape[0]
    chosen, requested, ids, counts = [t.to(DEVICE) if t is not None else None
                                      for t in (case["chosen"], case["requested"], case["token_ids"], case["counts"])]
    out_rows = torch.arange(rows, device=DEVICE)
    explicit = ids is not None
    plan = vocabulary_launch_plan(rows, width, len(parts), k, explicit, parts[0].dtype)
    failures = [] if [len(stage_launches(plan, s)) for s in ("statistics", "candidates", "merge")] == [2, 3, 1] else [
        "the plan should issue 2 + 3 + 1 launches"]
    blank = torch.full((rows, packed_width(k, explicit)), SENTINEL, dtype=torch.int32, device=DEVICE)
    reference_out = blank.clone()
    stats, cands = reference_pipeline(case, parts, width, reference_out)

    # 1. stage by stage on the reference's exchanges
    triton_stats = [rank.statistics(x, requested, r * width, vocab_size) for r, (rank, x) in enumerate(zip(ranks, parts))]
    for r, (rank, x) in enumerate(zip(ranks, parts)):
        got, want = triton_stats[r], stats[r * rows:(r + 1) * rows]
        failures += words_differ(f"rank {r} exchange 1", got, want, skip_word=1)
        mass, expected = got[:, 1], want[:, 1]
        close = ((mass - expected).abs() <= MASS_TOLERANCE * expected.abs()) | (mass.isnan() & expected.isnan())
        close |= mass.view(torch.int32) == expected.view(torch.int32)
        if not close.all():
            failures.append(f"rank {r} exchange 1 mass {mass.tolist()} vs {expected.tolist()}")
        got = rank.candidates(x, stats, chosen, requested, ids, counts, r * width, vocab_size)
        failures += words_differ(f"rank {r} exchange 2", got, cands[r * rows:(r + 1) * rows])
    stage_out = blank.clone()
    ranks[0].merge(stats, cands, chosen, requested, stage_out, out_rows, ids, counts, vocab_size, width, k)
    failures += words_differ("merge", stage_out, reference_out)

    # 2. the all-Triton pipeline (each rank's stage 2 reads the workspace its own stage 1 filled)
    got = stage_out.cpu()
    if case["pipeline"]:
        triton_stats = torch.cat(triton_stats)
        triton_cands = torch.cat([rank.candidates(x, triton_stats, chosen, requested, ids, counts, r * width,
                                                  vocab_size) for r, (rank, x) in enumerate(zip(ranks, parts))])
        triton_out = blank.clone()
        ranks[-1].merge(triton_stats, triton_cands, chosen, requested, triton_out, out_rows, ids, counts, vocab_size,
                        width, k)
        got, want = triton_out.cpu(), reference_out.cpu()
        if not torch.equal(got[:, 0::2], want[:, 0::2]):
            failures.append(f"pipeline ids differ at {(got[:, 0::2] != want[:, 0::2]).nonzero()[:4].tolist()}")
        lse = V.global_normalization(stats.view(len(parts), rows, EXCHANGE_WORDS)[:, :, 0].cpu(),
                                     stats.view(len(parts), rows, EXCHANGE_WORDS)[:, :, 1].cpu())
        a, b = got[:, 1::2].contiguous(), want[:, 1::2].contiguous()
        fa, fb = a.view(torch.float32), b.view(torch.float32)
        bound = 2.0**-17 + 2.0**-22 * (lse.abs()[:, None] + fb.abs())
        same = (a == b) | ((fa - fb).abs() <= bound)
        if not same.all():
            failures.append(f"pipeline values beyond tolerance at {(~same).nonzero()[:4].tolist()}")

    # 3. ids against TP=1
    single = blank.clone().cpu()
    reduce_logprobs_reference(case["logits"], case["chosen"], case["requested"], single, out_rows.cpu(),
                              case["token_ids"], case["counts"], vocab_size, k)
    if not torch.equal(got[:, 0::2], single[:, 0::2]):
        failures.append(f"ids differ from TP=1 at {(got[:, 0::2] != single[:, 0::2]).nonzero()[:4].tolist()}")
    return failures


# ---- prompt scoring: the seven launches against score_shard_statistics / _candidates / merge_prompt_scores ----
def scoring_cases():
    g = torch.Generator().manual_seed(5)
    uneven = padded(7, 1823, 4, g)  # TP=4 over 1823 lanes: the last shard is partly padding
    uneven[1, :1823:3] = 2.0  # raw ties across every shard, the target among them
    uneven[2, :1823] = torch.linspace(5.0, 5.0 + 2e-6, 1823)  # ties only after subtracting lse
    uneven[3, 1500] = float("inf")  # lse = +inf
    uneven[4, :1823] = float("-inf")  # lse = -inf
    uneven[5, 17] = float("nan")  # NaN in rank 0's shard, the target on rank 3
    yield "score_tp4_uneven_adversarial_fp32", dict(logits=uneven, ranks=4, vocab_size=1823,
                                                   targets=[1822, 3, 911, 1500, 0, 1700, 455], pipeline=True)
    ids = padded(6, 1001, 2, g)
    ids[3, 500] = float("nan")  # the target itself is NaN
    yield "score_tp2_invalid_targets_fp32", dict(logits=ids, ranks=2, vocab_size=1001,
                                                targets=[-1, 1000, 1001, 501, 500, 2**31 - 1], pipeline=True)
    small = padded(5, 70, 4, g, torch.bfloat16, scale=1.0)  # bf16 ties; shards of 18 lanes (< 20 pairs each)
    yield "score_tp4_bf16_ties", dict(logits=small, ranks=4, vocab_size=70, targets=[69, 0, 18, 36, -1])
    wholly = padded(3, 30, 4, g)
    wide = torch.cat([wholly[:, :30], torch.full((3, 34), 1e30)], dim=1)  # shards of 16: ranks 2, 3 are padding
    yield "score_tp4_shards_wholly_in_padding_fp32", dict(logits=wide, ranks=4, vocab_size=30, targets=[29, 0, 30])
    yield "score_tp2_fp16", dict(logits=padded(4, 3001, 2, g, torch.float16), ranks=2, vocab_size=3001,
                                 targets=[3000, 1500, 1501, 7])


def check_scoring(name, case):
    logits, vocab_size = case["logits"], case["vocab_size"]
    parts, width = shards(case)
    rows, ranks = logits.shape[0], [TritonScoring() for _ in parts]
    targets = torch.tensor(case["targets"], dtype=torch.int32, device=DEVICE)
    out_rows = torch.arange(rows, device=DEVICE) + rows  # frame 1 of a [2, rows, 43] output
    blank = torch.full((2, rows, 43), SENTINEL, dtype=torch.int32, device=DEVICE)
    plan = scoring_launch_plan(rows, width, len(parts), parts[0].dtype)
    failures = [] if [len(stage_launches(plan, s, SCORING_LAUNCHES)) for s in ("statistics", "candidates", "merge")] == [
        2, 4, 1] else ["the scoring plan should issue 2 + 4 + 1 launches"]
    stats = torch.cat([V.score_shard_statistics(x, targets, r * width, vocab_size) for r, x in enumerate(parts)])
    cands = torch.cat([V.score_shard_candidates(x, stats, targets, r * width, vocab_size) for r, x in enumerate(parts)])
    reference_out = blank.clone()
    V.merge_prompt_scores(stats, cands, targets, reference_out, out_rows, vocab_size, width)

    # 1. stage by stage on the reference's exchanges
    triton_stats = [rank.statistics(x, targets, r * width, vocab_size) for r, (rank, x) in enumerate(zip(ranks, parts))]
    for r, x in enumerate(parts):
        got, want = triton_stats[r], stats[r * rows:(r + 1) * rows]
        failures += words_differ(f"rank {r} scoring exchange 1", got, want, skip_word=1)
        mass, expected = got[:, 1].view(torch.float32), want[:, 1].view(torch.float32)
        close = ((mass - expected).abs() <= MASS_TOLERANCE * expected.abs()) | (mass.isnan() & expected.isnan())
        close |= got[:, 1] == want[:, 1]
        if not close.all():
            failures.append(f"rank {r} scoring exchange 1 mass {mass.tolist()} vs {expected.tolist()}")
        got = ranks[r].candidates(x, stats, targets, r * width, vocab_size)
        failures += words_differ(f"rank {r} scoring exchange 2", got, cands[r * rows:(r + 1) * rows])
    stage_out = blank.clone()
    ranks[0].merge(stats, cands, targets, stage_out, out_rows, vocab_size, width)
    failures += words_differ("scoring merge", stage_out.view(-1, 43), reference_out.view(-1, 43))

    # 2. the all-Triton pipeline: ids exact, values within the generation pipeline's bound, ranks within one
    got = stage_out[1].cpu()
    if case.get("pipeline"):
        triton_stats = torch.cat(triton_stats)
        triton_cands = torch.cat([rank.candidates(x, triton_stats, targets, r * width, vocab_size)
                                  for r, (rank, x) in enumerate(zip(ranks, parts))])
        triton_out = blank.clone()
        ranks[-1].merge(triton_stats, triton_cands, targets, triton_out, out_rows, vocab_size, width)
        got, want = triton_out[1].cpu(), reference_out[1].cpu()
        id_words = [0] + list(range(3, 43, 2))
        if not torch.equal(got[:, id_words], want[:, id_words]) or not torch.equal(triton_out[0], blank[0]):
            failures.append(f"scoring pipeline ids differ at {(got[:, id_words] != want[:, id_words]).nonzero()[:4].tolist()}")
        floats = stats.view(len(parts), rows, 64).view(torch.float32).cpu()
        lse = V.global_normalization(floats[:, :, 0], floats[:, :, 1])
        value_words = [1] + list(range(4, 43, 2))
        a, b = got[:, value_words].contiguous(), want[:, value_words].contiguous()
        fa, fb = a.view(torch.float32), b.view(torch.float32)
        same = (a == b) | ((fa - fb).abs() <= 2.0**-17 + 2.0**-22 * (lse.abs()[:, None] + fb.abs()))
        if not same.all():
            failures.append(f"scoring pipeline values beyond tolerance at {(~same).nonzero()[:4].tolist()}")

    # 3. ids against single-rank scoring (TP=1)
    single = torch.full((rows, 43), SENTINEL, dtype=torch.int32)
    score_rows_reference(logits, targets.cpu(), single, torch.arange(rows), vocab_size)
    id_words = [0] + list(range(3, 43, 2))
    if not torch.equal(got[:, id_words], single[:, id_words]):
        failures.append(f"scoring ids differ from TP=1 at {(got[:, id_words] != single[:, id_words]).nonzero()[:4].tolist()}")
    return failures


CASE_NAMES = tuple(name for name, _ in cases()) + tuple(name for name, _ in scoring_cases())


def main():
    for name, case in [(n, (check, c)) for n, c in cases()] + [(n, (check_scoring, c)) for n, c in scoring_cases()]:
        if ONLY and not name.startswith(ONLY):
            continue
        try:
            failures = case[0](name, case[1])
        except Exception:  # noqa: BLE001 - reported per case to the parent test
            failures = [traceback.format_exc()]
        print(json.dumps({"case": name, "failures": failures}), flush=True)


if __name__ == "__main__":
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (or --device cuda on a GPU machine)")
    main()
