"""Tests for ignition.components.sampling (CPU)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ignition.catalog.buffers import BIAS_IDS, BIAS_VALUES, SAMPLING_INPUTS, TOKEN_BITMASK
from ignition.components.constraints import allowed_tokens, sampling_logits
from ignition.components.sampling import (
    SAMPLING_DEFAULTS,
    SAMPLING_FIELDS,
    SamplingTensors,
    apply_penalties,
    first_argmax,
    philox4x32_10,
    philox_uniform,
    sample,
    update_output_counts,
)

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


# ---- Pure-Python references ----
def reference_philox(counter: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 from the algorithm definition, on Python ints."""
    word0, word1, word2, word3 = counter
    key0, key1 = key
    for round_index in range(10):
        if round_index:
            key0, key1 = (key0 + 0x9E3779B9) & MASK32, (key1 + 0xBB67AE85) & MASK32
        product0, product1 = 0xD2511F53 * word0, 0xCD9E8D57 * word2
        word0, word1, word2, word3 = (
            (product1 >> 32) ^ word1 ^ key0,
            product1 & MASK32,
            (product0 >> 32) ^ word3 ^ key1,
            product0 & MASK32,
        )
    return word0, word1, word2, word3


def reference_uniform(seed: int, offset: int, column: int) -> float:
    seed, offset, block = seed & MASK64, offset & MASK64, column // 4
    counter = (offset & MASK32, offset >> 32, block & MASK32, block >> 32)
    words = reference_philox(counter, (seed & MASK32, seed >> 32))
    return (words[column % 4] >> 8) / float(1 << 24)


def reference_distribution(logits, vocab_size, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Expected fp64 token distribution over the padded width, same tie rules as `sample`."""
    x = np.full(len(logits), -np.inf)
    x[:vocab_size] = np.asarray(logits[:vocab_size], dtype=np.float64) / temperature
    if 0 < top_k < vocab_size:
        kth = np.sort(x[:vocab_size])[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)  # ties with the k-th value kept
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if top_p < 1.0:
        descending = np.sort(probs)[::-1]
        last_kept = int(np.argmax(np.cumsum(descending) >= top_p))
        probs = np.where(probs >= descending[last_kept], probs, 0.0)  # ties at the cutoff kept
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def chi_squared_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    support = expected_probs > 0
    expected = expected_probs[support] * observed.sum()
    statistic = float((((observed[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    # chi2 survival function = regularized upper incomplete gamma Q(dof/2, x/2)
    half_dof, half_statistic = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, half_statistic))


def make_params(requests):
    """Sampling tensors for ``requests``; these tests sample at temperature 1 unless a request says otherwise
    (the catalog's default is greedy)."""
    return SamplingTensors.from_requests([{"temperature": 1.0} | dict(r) if isinstance(r, dict) else r
                                          for r in requests])


def no_history(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, width, dtype=torch.int32), torch.zeros(batch, width, dtype=torch.bool)


# ---- Philox ----
# Random123 tests/kat_vectors for philox4x32-10: (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),  # pi digits
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert reference_philox(counter, key) == expected
    words = philox4x32_10([torch.tensor([w]) for w in counter], [torch.tensor([k]) for k in key])
    assert tuple(int(w) for w in words) == expected


def test_philox_uniform_bit_exact_against_reference():
    rng = random.Random(1234)
    seeds = [0, 1, MASK64, 1 << 63, 0xDEADBEEF] + [rng.getrandbits(64) for _ in range(43)]
    offsets = [0, 1, (1 << 63) - 1, MASK32, 1 << 32]
    offsets += [rng.getrandbits(rng.choice([8, 32, 63])) for _ in range(43)]
    num_columns = 11  # not a multiple of 4: exercises the partial last block
    params = make_params([{"seed": s, "offset": o} for s, o in zip(seeds, offsets)])
    got = philox_uniform(params.seed, params.offset, num_columns)  # [48, 11]
    assert got.dtype == torch.float32 and got.shape == (len(seeds), num_columns)
    expected = [[reference_uniform(s, o, c) for c in range(num_columns)] for s, o in zip(seeds, offsets)]
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32))
    # A column's value does not depend on how many columns were asked for.
    assert torch.equal(philox_uniform(params.seed, params.offset, 3), got[:, :3])


def test_philox_uniform_range_and_spread():
    seed = torch.arange(512, dtype=torch.int64) * 7919
    uniforms = philox_uniform(seed, torch.zeros_like(seed), 2048).flatten()  # 1M values
    assert float(uniforms.min()) >= 0.0 and float(uniforms.max()) < 1.0
    assert abs(float(uniforms.mean()) - 0.5) < 2e-3
    counts = torch.bincount((uniforms * 16).long(), minlength=16).numpy()
    assert chi_squared_p_value(counts, np.full(16, 1 / 16)) > 1e-4


def test_largest_uniform_times_total_stays_below_total():
    """Inverse-CDF relies on fp32 `u * total < total` for every u the Philox path can emit."""
    largest_uniform = torch.tensor((MASK32 >> 8) / float(1 << 24), dtype=torch.float32)
    totals = torch.cat([
        torch.rand(200000, generator=torch.Generator().manual_seed(3), dtype=torch.float32) * 2 + 1e-6,
        2.0 ** torch.arange(-30, 4, dtype=torch.float32),  # powers of two: the rounding-tie case
        torch.nextafter(2.0 ** torch.arange(-30, 4, dtype=torch.float32), torch.tensor(0.0)),
    ])
    assert bool((largest_uniform * totals < totals).all())


# ---- SamplingTensors ----
def test_sampling_fields_are_the_catalog_table():
    assert SAMPLING_FIELDS == tuple((spec.name, getattr(torch, spec.dtype)) for spec in SAMPLING_INPUTS)
    buffers = {name: torch.zeros(3, dtype=dtype) for name, dtype in SAMPLING_FIELDS} | {"input_ids": torch.zeros(3)}
    params = SamplingTensors.from_buffers(buffers)
    assert all(a is buffers[name] for a, (name, _) in zip(params.as_tuple(), SAMPLING_FIELDS))


def test_sampling_tensors_table_and_builder():
    assert [f.name for f in dataclasses.fields(SamplingTensors)] == [name for name, _ in SAMPLING_FIELDS]
    assert set(SAMPLING_DEFAULTS) == {name for name, _ in SAMPLING_FIELDS}
    as_object = SimpleNamespace(temperature=0.5, top_k=3, seed=None)
    params = SamplingTensors.from_requests([{"top_p": 0.9, "seed": MASK64, "offset": 7}, as_object])
    for name, dtype in SamplingTensors.FIELDS:
        assert getattr(params, name).dtype == dtype and getattr(params, name).shape == (2,)
    assert params.seed.tolist() == [-1, 0] and params.offset.tolist() == [7, 0]
    assert params.temperature.tolist() == [0.0, 0.5] and params.top_k.tolist() == [0, 3]  # the catalog default: greedy
    round_trip = SamplingTensors.from_tuple(params.as_tuple())
    assert all(a is b for a, b in zip(round_trip.as_tuple(), params.as_tuple()))
    with pytest.raises(AttributeError):
        params.not_a_field = 1  # slotted


# ---- Penalties ----
def reference_penalties(logits, counts, prompt_mask, rep, presence, frequency) -> np.ndarray:
    out = np.array(logits, dtype=np.float32)
    for row in range(out.shape[0]):
        for token in range(out.shape[1]):
            value, count = out[row, token], counts[row, token]
            if prompt_mask[row, token] or count > 0:
                value = value / rep[row] if value > 0 else value * rep[row]
            value = value - frequency[row] * np.float32(count)
            value = value - presence[row] * np.float32(count > 0)
            out[row, token] = value
    return out


def test_penalties_match_loop_reference_bit_exact():
    generator = torch.Generator().manual_seed(0)
    batch, width = 6, 40
    logits = torch.randn(batch, width, generator=generator) * 3
    logits[:, :3] = torch.tensor([0.0, -0.0, float("-inf")])
    counts = torch.randint(0, 4, (batch, width), generator=generator, dtype=torch.int32)
    counts[counts == 1] = 0  # sparser history
    prompt_mask = torch.rand(batch, width, generator=generator) < 0.3
    settings = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.5, 0.0), (1.1, 0.0, 0.25), (2.0, -0.4, 1.5), (1.17, 0.3, 0.3)]
    params = make_params([
        {"repetition_penalty": r, "presence_penalty": p, "frequency_penalty": f} for r, p, f in settings
    ])
    before = (logits.clone(), counts.clone(), prompt_mask.clone())
    got = apply_penalties(logits, counts, prompt_mask, params)
    expected = reference_penalties(
        logits.numpy(), counts.numpy(), prompt_mask.numpy(),
        params.repetition_penalty.numpy(), params.presence_penalty.numpy(), params.frequency_penalty.numpy(),
    )
    np.testing.assert_array_equal(got.numpy(), expected)
    assert torch.equal(got[0], logits[0])  # all-off row is the identity
    assert all(torch.equal(a, b) for a, b in zip(before, (logits, counts, prompt_mask)))


def test_penalties_change_sampling_like_reference():
    """Greedy sees the penalized logits: a repeated top token loses to the runner-up."""
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0]] * 2)
    counts, prompt_mask = no_history(2, 4)
    counts[:, 0] = 2
    params = make_params([
        {"temperature": 0.0, "repetition_penalty": 1.5},
        {"temperature": 0.0, "frequency_penalty": 0.6},
    ])
    assert sample(logits, counts, prompt_mask, params, vocab_size=4).tolist() == [1, 1]


# ---- Greedy, padding, determinism ----
def test_greedy_ties_pick_smallest_id_and_padding_never_selected():
    vocab_size, width = 10, 16
    logits = torch.zeros(3, width)
    logits[0, [7, 3, 9]] = 5.0
    logits[1, vocab_size:] = float("inf")
    logits[1, 4] = 1.0
    logits[2, vocab_size:] = 1e30
    counts, prompt_mask = no_history(3, width)
    params = make_params([{"temperature": 0.0}] * 3)
    assert sample(logits, counts, prompt_mask, params, vocab_size).tolist() == [3, 4, 0]


def test_padding_never_selected_when_sampling():
    vocab_size, width, rows = 10, 16, 4000
    logits = torch.zeros(rows, width)
    logits[:, vocab_size:] = float("inf")
    logits[1::2, vocab_size:] = 1e30
    counts, prompt_mask = no_history(rows, width)
    params = make_params([{"seed": 3, "offset": i, "top_p": 0.95 if i % 3 else 1.0} for i in range(rows)])
    tokens = sample(logits, counts, prompt_mask, params, vocab_size)
    assert int(tokens.max()) < vocab_size and len(tokens.unique()) == vocab_size


def _mixed_requests() -> tuple[torch.Tensor, list[dict]]:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 32, generator=generator) * 2
    requests = [
        {"seed": 11, "offset": 0},
        {"seed": 11, "offset": 5, "temperature": 0.8, "top_k": 5},
        {"seed": 12345678901, "offset": 2, "top_p": 0.7},
        {"seed": -5, "offset": 9, "min_p": 0.1, "temperature": 1.4},
        {"temperature": 0.0},
        {"seed": 99, "offset": 1, "top_k": 8, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2},
    ]
    return logits, requests


def test_same_seed_offset_same_token_regardless_of_batch():
    logits, requests = _mixed_requests()
    counts, prompt_mask = no_history(6, 32)
    tokens = sample(logits, counts, prompt_mask, make_params(requests), vocab_size=30)
    assert torch.equal(tokens, sample(logits, counts, prompt_mask, make_params(requests), vocab_size=30))
    # Reverse the rows and surround them with unrelated requests.
    filler_logits = torch.randn(4, 32)
    order = list(reversed(range(6)))
    big_logits = torch.cat([filler_logits[:2], logits[order], filler_logits[2:]])
    big_requests = [{"seed": 1}, {"top_k": 2}] + [requests[i] for i in order] + [{"seed": 4}, {"temperature": 0.0}]
    big_counts, big_prompt = no_history(10, 32)
    big_tokens = sample(big_logits, big_counts, big_prompt, make_params(big_requests), vocab_size=30)
    assert torch.equal(big_tokens[2:8], tokens[order])
    # Each request alone.
    for row, request in enumerate(requests):
        alone = sample(logits[row : row + 1], counts[:1], prompt_mask[:1], make_params([request]), vocab_size=30)
        assert int(alone) == int(tokens[row])


def test_different_offsets_and_seeds_give_different_draws():
    rows, width = 256, 16
    logits = torch.zeros(rows, width)  # uniform over 16 tokens
    counts, prompt_mask = no_history(rows, width)
    def draw(requests):
        return sample(logits, counts, prompt_mask, make_params(requests), width)

    by_offset = draw([{"seed": 5, "offset": i} for i in range(rows)])
    by_seed = draw([{"seed": i, "offset": 0} for i in range(rows)])
    assert len(by_offset.unique()) == width and len(by_seed.unique()) == width
    assert not torch.equal(by_offset, by_seed)
    repeated_offset = draw([{"seed": 5, "offset": 0}] * rows)
    assert len(repeated_offset.unique()) == 1  # same (seed, offset) -> same draw


# ---- Distributions ----
VOCAB_SIZE, PADDED_WIDTH, DRAWS = 12, 16, 20000
# Token probabilities, shuffled over ids so tied tokens are not neighbours.
BASE_PROBS = np.array([0.03, 0.15, 0.02, 0.30, 0.05, 0.15, 0.01, 0.10, 0.05, 0.10, 0.02, 0.02])
BASE_LOGITS = np.log(BASE_PROBS) + 1.7

DISTRIBUTION_CASES = {
    "plain": {},
    "temperature": {"temperature": 0.6},
    "hot": {"temperature": 1.8},
    # sorted probs 0.30, 0.15, 0.15, 0.10, 0.10, ...: the 4th value (0.10) is tied -> 5 kept
    "top_k_tie": {"top_k": 4},
    "top_k_no_tie": {"top_k": 3, "temperature": 0.9},
    # mass 0.30, 0.45 < 0.5, crosses at the first 0.15 -> its tie (ids 1 and 5) both kept
    "top_p_tie": {"top_p": 0.4},
    "top_p": {"top_p": 0.8},
    # 0.25 * 0.30 = 0.075: keeps probs >= 0.10
    "min_p": {"min_p": 0.25},
    "combined": {"temperature": 1.3, "top_k": 7, "top_p": 0.85, "min_p": 0.08},
}


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
def test_sampled_distribution_matches_reference(case):
    config = DISTRIBUTION_CASES[case]
    logits_row = np.full(PADDED_WIDTH, 50.0, dtype=np.float32)  # huge padded lanes must be ignored
    logits_row[:VOCAB_SIZE] = BASE_LOGITS
    logits = torch.from_numpy(np.tile(logits_row, (DRAWS, 1)))
    counts, prompt_mask = no_history(DRAWS, PADDED_WIDTH)
    requests = [{**config, "seed": 1000 + i // 200, "offset": i % 200} for i in range(DRAWS)]
    tokens = sample(logits, counts, prompt_mask, make_params(requests), VOCAB_SIZE)
    observed = np.bincount(tokens.numpy(), minlength=PADDED_WIDTH)
    expected = reference_distribution(logits_row, VOCAB_SIZE, **config)
    assert observed[expected == 0].sum() == 0, f"filtered tokens drawn: {observed}"
    p_value = chi_squared_p_value(observed, expected)
    assert p_value > 1e-4, f"{case}: p={p_value:.2e} observed={observed} expected={np.round(expected * DRAWS)}"


def test_tie_rules_documented_by_expected_support():
    expected_top_k = reference_distribution(BASE_LOGITS, VOCAB_SIZE, top_k=4)
    assert sorted(np.flatnonzero(expected_top_k)) == [1, 3, 5, 7, 9]  # 5 survive top_k=4
    expected_top_p = reference_distribution(BASE_LOGITS, VOCAB_SIZE, top_p=0.4)
    assert sorted(np.flatnonzero(expected_top_p)) == [1, 3, 5]


# ---- Output counts ----
def test_update_output_counts_accumulates_active_rows_only():
    counts = torch.zeros(4, 8, dtype=torch.int32)
    slots = torch.tensor([2, 0, 2, 3, -1])
    tokens = torch.tensor([5, 1, 5, 7, 99])  # last row is padding with garbage indices
    active = torch.tensor([True, True, True, False, False])
    result = update_output_counts(counts, slots, tokens, active)
    assert result is counts
    expected = torch.zeros(4, 8, dtype=torch.int32)
    expected[2, 5], expected[0, 1] = 2, 1
    assert torch.equal(counts, expected)
    # Integer lane flags (the runtime's int32 ACTIVE_LANES): any nonzero adds exactly one.
    update_output_counts(counts, slots, tokens, torch.tensor([3, 0, 0, 0, 0], dtype=torch.int32))
    expected[2, 5] = 3
    assert torch.equal(counts, expected)


# ---- torch.export ----
class SampleModule(torch.nn.Module):
    """Takes the sampling tensors flat, in SAMPLING_FIELDS order, as an exporter would declare them."""

    def forward(self, logits, output_counts, prompt_mask, *sampling_inputs):
        params = SamplingTensors.from_tuple(sampling_inputs)
        return sample(logits, output_counts, prompt_mask, params, vocab_size=30)


class StructuredSampleModule(torch.nn.Module):
    def forward(self, logits, output_counts, prompt_mask, params: SamplingTensors):
        return sample(logits, output_counts, prompt_mask, params, vocab_size=30)


class CountModule(torch.nn.Module):
    def forward(self, output_counts, slots, tokens, active):
        update_output_counts(output_counts, slots, tokens, active)
        return output_counts.sum()


def test_export_matches_eager_and_leaves_logits_untouched():
    logits, requests = _mixed_requests()
    counts, prompt_mask = no_history(6, 32)
    counts[5, :4] = 1
    prompt_mask[3, 4:9] = True
    params = make_params(requests)
    logits_before = logits.clone()
    eager = sample(logits, counts, prompt_mask, params, vocab_size=30)
    assert torch.equal(logits, logits_before)

    flat_inputs = (logits, counts, prompt_mask, *params.as_tuple())
    exported = torch.export.export(SampleModule(), flat_inputs)
    graph_ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not [op for op in graph_ops if any(word in op for word in ("rand", "multinomial", "exponential", "_local_scalar_dense"))]
    assert torch.equal(exported.module()(*flat_inputs), eager)
    structured = torch.export.export(StructuredSampleModule(), (logits, counts, prompt_mask, params))
    assert torch.equal(structured.module()(logits, counts, prompt_mask, params), eager)
    assert torch.equal(logits, logits_before)
    # Different offsets through the exported graph still follow eager.
    moved = dataclasses.replace(params, offset=params.offset + 17)
    assert torch.equal(
        exported.module()(logits, counts, prompt_mask, *moved.as_tuple()),
        sample(logits, counts, prompt_mask, moved, vocab_size=30),
    )


def test_export_update_output_counts():
    slots, tokens, active = torch.tensor([0, 2, 0]), torch.tensor([4, 4, 4]), torch.tensor([True, True, False])
    inputs = (torch.zeros(3, 8, dtype=torch.int32), slots, tokens, active)
    exported = torch.export.export(CountModule(), inputs)
    counts = torch.zeros(3, 8, dtype=torch.int32)
    assert int(exported.module()(counts, *inputs[1:])) == 2
    assert counts[0, 4] == 1 and counts[2, 4] == 1 and int(counts.sum()) == 2


class WindowedSampleModule(torch.nn.Module):
    def forward(self, logits, output_counts, prompt_mask, window, *sampling_inputs):
        params = SamplingTensors.from_tuple(sampling_inputs)
        return sample(logits, output_counts, prompt_mask, params, vocab_size=30, window=window)


def test_sample_window_full_extent_is_bit_identical_and_short_window_keeps_greedy_tokens():
    """``window`` at the whole row gives exactly the unwindowed tokens (sampled and greedy rows); a short window
    (what a round of greedy lanes only passes) gives the same greedy tokens, also through an exported graph
    whose window extent is dynamic, with penalties, top-k past the window and ties."""
    logits, requests = _mixed_requests()
    counts, prompt_mask = no_history(6, 32)
    counts[5, :4] = 1
    prompt_mask[3, 4:9] = True
    params = make_params(requests)
    unwindowed = sample(logits, counts, prompt_mask, params, vocab_size=30)
    full = torch.zeros(32, dtype=torch.int64)
    assert torch.equal(sample(logits, counts, prompt_mask, params, vocab_size=30, window=full), unwindowed)
    greedy = make_params([{"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.3}] * 6)
    logits[2, 7] = logits[2, 12] = logits[2].max() + 1  # a tie: the smallest id wins either way
    expected = sample(logits, counts, prompt_mask, greedy, vocab_size=30)
    assert expected[2] == 7
    width = torch.export.Dim("window", min=2, max=32)
    flat = greedy.as_tuple()
    exported = torch.export.export(WindowedSampleModule(), (logits, counts, prompt_mask, full[:16], *flat),
                                   dynamic_shapes=(None, None, None, {0: width}, (None,) * len(flat))).module()
    for extent in (2, 5, 16, 32):
        window = torch.zeros(extent, dtype=torch.int64)
        assert torch.equal(sample(logits, counts, prompt_mask, greedy, vocab_size=30, window=window), expected)
        assert torch.equal(exported(logits, counts, prompt_mask, window, *flat), expected)
    assert torch.equal(exported(logits, counts, prompt_mask, full, *params.as_tuple()),
                       sample(logits, counts, prompt_mask, params, vocab_size=30))


class TransformedSampleModule(torch.nn.Module):
    def forward(self, logits, output_counts, prompt_mask, window, transform, bitmask, bias_ids, bias_values,
                *sampling_inputs):
        params = SamplingTensors.from_tuple(sampling_inputs)
        buffers = {TOKEN_BITMASK: bitmask, BIAS_IDS: bias_ids, BIAS_VALUES: bias_values}
        return sample(logits, output_counts, prompt_mask, params, vocab_size=30, window=window, transform=transform,
                      constrain=lambda part, columns: sampling_logits(buffers, part, columns))


def _constraint_buffers(rows: int, width: int, allowed: dict[int, list[int]], bias: dict[int, dict[int, float]]):
    bitmask = torch.zeros(rows, (width + 31) // 32, dtype=torch.int64)
    for row, ids in allowed.items():
        for token in ids:
            bitmask[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)  # the words' 32 bits
    bias_ids, bias_values = torch.full((rows, 4), -1, dtype=torch.int64), torch.zeros(rows, 4)
    for row, entries in bias.items():
        for index, (token, value) in enumerate(entries.items()):
            bias_ids[row, index], bias_values[row, index] = token, value
    return {TOKEN_BITMASK: bitmask, BIAS_IDS: bias_ids, BIAS_VALUES: bias_values}


def test_transform_window_full_extent_is_bit_identical_and_short_window_keeps_untransformed_rows():
    """``transform`` (the transform window) at the whole row gives exactly the unwindowed tokens with penalties, a
    bitmask and a bias, eagerly and through an exported graph whose extent is dynamic; rows without any transform
    give the same tokens (sampled, greedy, tied) at every shorter extent; and a short window does bound the transformed
    columns, which is why the runtime passes the whole row whenever a lane has a transform."""
    logits, requests = _mixed_requests()
    counts, prompt_mask = no_history(6, 32)
    counts[5, :4] = 1
    counts[0, 3] = 2
    prompt_mask[3, 4:9] = True
    requests[0] = requests[0] | {"frequency_penalty": 0.4, "presence_penalty": -0.3}
    params = make_params(requests)
    buffers = _constraint_buffers(6, 32, {1: [2, 9, 20, 31], 4: [7]}, {2: {25: 3.0, 1: -2.0}})
    constrain = lambda part, columns: sampling_logits(buffers, part, columns)  # noqa: E731
    full = torch.zeros(32, dtype=torch.int64)
    expected = sample(sampling_logits(buffers, logits), counts, prompt_mask, params, vocab_size=30, window=full)
    assert expected[4] == 7  # the bitmask decides the greedy row
    assert torch.equal(sample(logits, counts, prompt_mask, params, 30, full, full, constrain), expected)
    extent = torch.export.Dim("transform", min=2, max=32)
    flat = params.as_tuple()
    exported = torch.export.export(
        TransformedSampleModule(), (logits, counts[:, :16].contiguous(), prompt_mask[:, :16].contiguous(), full, full[:16],
                                    *buffers.values(),
                                    *flat),
        dynamic_shapes=(None, {1: extent}, {1: extent}, None, {0: extent}, None, None, None, (None,) * len(flat)))
    exported = exported.module()
    assert torch.equal(exported(logits, counts, prompt_mask, full, full, *buffers.values(), *flat), expected)

    neutral = make_params([{k: v for k, v in r.items() if "penalty" not in k} for r in requests])
    none = _constraint_buffers(6, 32, {}, {})
    logits[4, 3] = logits[4, 21] = logits[4].max() + 1  # a greedy tie across the window's edge: the smallest id
    untransformed = sample(logits, counts, prompt_mask, neutral, vocab_size=30, window=full)
    assert untransformed[4] == 3
    for width in (2, 5, 16, 32):
        transform = torch.zeros(width, dtype=torch.int64)
        assert torch.equal(sample(logits, counts[:, :width], prompt_mask[:, :width], neutral, 30, full, transform),
                           untransformed), width
        assert torch.equal(exported(logits, counts[:, :width].contiguous(), prompt_mask[:, :width].contiguous(), full,
                                    transform,
                                    *none.values(), *neutral.as_tuple()), untransformed), width

    greedy = make_params([{"temperature": 0.0, "repetition_penalty": 4.0}] * 6)
    seen = torch.ones(6, 32, dtype=torch.bool)
    penalized = sample(logits, counts, seen, greedy, 30, full, full)
    short = sample(logits, counts[:, :16], seen[:, :16], greedy, 30, full, full[:16])
    assert not torch.equal(penalized, short)  # columns past a short window keep their raw logits


def test_a_short_transform_window_puts_the_float32_row_back():
    """A short transform window rewrites its columns of a float32 row in place (the penalties here move the greedy
    token) and puts them back before ``sample`` returns, eagerly and through an exported graph: BF16 graphs hand the
    same float32 row to sampling and then to the logprob reduction (``recipes.graphs``' ``sample_and_commit``), which
    must read the raw logits."""
    logits, _ = _mixed_requests()
    logits[:, 2] = logits.amax(dim=1) + 0.5  # every row's greedy token is 2, inside the window, before the penalties
    counts, _ = no_history(6, 32)
    counts[:, :8] = 3
    seen = torch.ones(6, 32, dtype=torch.bool)
    penalties = make_params([{"temperature": 0.0, "repetition_penalty": 4.0, "frequency_penalty": 0.5}] * 6)
    full = torch.zeros(32, dtype=torch.int64)
    before = logits.clone()
    penalized = sample(logits, counts[:, :16], seen[:, :16], penalties, 30, full, full[:16])
    assert (penalized != 2).all()  # the window's columns were transformed
    assert torch.equal(logits, before)
    none, flat = _constraint_buffers(6, 32, {}, {}), penalties.as_tuple()
    extent = torch.export.Dim("transform", min=2, max=32)
    exported = torch.export.export(
        TransformedSampleModule(), (logits, counts[:, :16].contiguous(), seen[:, :16].contiguous(), full, full[:16],
                                    *none.values(), *flat),
        dynamic_shapes=(None, {1: extent}, {1: extent}, None, {0: extent}, None, None, None, (None,) * len(flat)))
    assert torch.equal(exported.module()(logits, counts[:, :16].contiguous(), seen[:, :16].contiguous(), full,
                                         full[:16], *none.values(), *flat), penalized)
    assert torch.equal(logits, before)


def test_windowed_constraints_equal_the_whole_rows_columns():
    """``allowed_tokens`` and ``sampling_logits`` on a prefix of the columns (``columns``) give that prefix of the
    whole row's result; a bias id past the prefix is left out, not clamped onto its last column."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 100, generator=generator)
    buffers = _constraint_buffers(3, 100, {0: [0, 31, 32, 63, 64, 99], 2: [40]}, {1: {5: 1.5, 70: 9.0}, 2: {40: -1.0}})
    whole = sampling_logits(buffers, logits)
    for width in (1, 31, 32, 33, 64, 100):
        columns = torch.arange(width)
        assert torch.equal(allowed_tokens(buffers[TOKEN_BITMASK], width, columns),
                           allowed_tokens(buffers[TOKEN_BITMASK], 100)[:, :width]), width
        assert torch.equal(sampling_logits(buffers, logits[:, :width], columns), whole[:, :width]), width


@pytest.mark.parametrize("grouped_from", [0, None], ids=["two passes at every width", "default"])
@pytest.mark.parametrize("width", [1, 127, 128, 129, 1000, 4096, 151_936])
def test_first_argmax_is_amax_and_argmax(width, grouped_from, monkeypatch):
    """Group maxima then one group: the same maximum and the same first index as torch's amax/argmax, for ties
    across groups, signed zeros, -inf rows, NaN lanes and a partial last group."""
    import ignition.components.sampling as sampling

    if grouped_from is not None:
        monkeypatch.setattr(sampling, "ARGMAX_GROUPED_LANES", grouped_from)
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(9, width, generator=g) * 3
    rows[1, :] = float("-inf")
    rows[2, torch.randint(0, width, (3,), generator=g)] = rows[2].max() + 1  # a tie, possibly across groups
    rows[3, :] = -1.0
    rows[3, width // 2] = -0.0
    rows[3, width - 1] = 0.0  # -0.0 == +0.0: the first one wins
    rows[4, torch.randint(0, width, (2,), generator=g)] = float("nan")
    rows[5, width - 1] = 100.0  # the last lane, in the partial group when there is one
    rows[6, 0] = 100.0
    rows[7] = torch.round(rows[7])  # many exact ties
    row_max, index = first_argmax(rows)
    assert torch.equal(index, rows.argmax(dim=-1))
    assert torch.equal(row_max.isnan(), rows.amax(dim=-1).isnan())
    assert torch.equal(row_max.nan_to_num(), rows.amax(dim=-1).nan_to_num())
