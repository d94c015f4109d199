"""recipes/attention: cached attention against a float64 loop over each row's slot, and the plan shared by layers.

Rows are decode lanes (some inactive, slots in any order, fewer lanes than slots), a single lane, verify
groups of several rows, and a prefill chunk, with and without a key window shorter than the cache. The
oracle attends row by row over positions ``[0, position]`` of the row's slot in float64, query head ``h``
reading KV head ``h // share`` (transformers' ``repeat_kv``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ignition.recipes.attention import cached_attention, plan_attention
from ignition.recipes.layers import Rows

SLOTS, MAX_SEQ_LEN, KV_HEADS, SHARE, HEAD_DIM = 6, 48, 2, 3, 8

CASES = {  # name: (read slots, rows per group, valid groups, window extent or None)
    "decode lanes": ([4, 0, 5, 2], 1, [True, False, True, True], 32),
    "decode, every slot": ([5, 4, 3, 2, 1, 0], 1, [True] * 6, None),
    "one lane": ([3], 1, [True], 16),
    "verify groups": ([1, 5, 2], 4, [True, True, False], 32),
    "prefill chunk": ([2], 7, [True], 32),
}


def _rows(case: str) -> Rows:
    slots, per_group, valid, window = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    limit = window or MAX_SEQ_LEN
    positions = torch.randint(0, limit, (len(slots) * per_group,), generator=generator)
    key_window = None if window is None else torch.zeros(window, dtype=torch.int64)
    return Rows(positions=positions, write_slots=torch.tensor(slots).repeat_interleave(per_group),
                valid=torch.tensor(valid).repeat_interleave(per_group), read_slots=torch.tensor(slots),
                key_window=key_window)


def _oracle(query, key_cache, value_cache, rows: Rows) -> torch.Tensor:
    """``[R, heads * head_dim]`` in float64: each row over its slot's positions ``<=`` its own."""
    per_group = rows.positions.shape[0] // rows.read_slots.shape[0]
    out = torch.zeros(query.shape[0], query.shape[1], HEAD_DIM, dtype=torch.float64)
    for row, position in enumerate(rows.positions.tolist()):
        slot = int(rows.read_slots[row // per_group])
        for head in range(query.shape[1]):
            keys = key_cache[slot, :position + 1, head // SHARE].double()  # [position + 1, head_dim]
            values = value_cache[slot, :position + 1, head // SHARE].double()
            scores = keys @ query[row, head].double() * HEAD_DIM**-0.5
            out[row, head] = torch.softmax(scores, dim=0) @ values
    return out.reshape(query.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_attention_matches_a_float64_loop_over_each_rows_slot(case: str, dtype: torch.dtype) -> None:
    rows = _rows(case)
    generator = torch.Generator().manual_seed(7)
    key_cache, value_cache = (torch.randn(SLOTS, MAX_SEQ_LEN, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
                              for _ in range(2))
    query = torch.randn(rows.positions.shape[0], KV_HEADS * SHARE, HEAD_DIM, generator=generator).to(dtype)
    plan = plan_attention(rows, SLOTS, MAX_SEQ_LEN, SHARE, dtype)
    got = cached_attention(query, key_cache[None], value_cache[None], 0, plan)
    assert got.shape == (query.shape[0], KV_HEADS * SHARE * HEAD_DIM) and got.dtype == dtype
    assert torch.isfinite(got).all()  # rows of inactive groups too: finite garbage
    valid = rows.valid
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got[valid].double(), _oracle(query, key_cache, value_cache, rows)[valid], **tolerance)


class _Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["decode lanes", "prefill chunk"])
def test_a_layer_reuses_the_plan_and_builds_no_mask(case: str) -> None:
    """The rows' part (window, mask, cells) is planned once per forward; a layer only moves its
    queries and runs its products, so a deeper model does not rebuild the mask per layer."""
    rows = _rows(case)
    plan = plan_attention(rows, SLOTS, MAX_SEQ_LEN, SHARE, torch.float32)
    key_cache = value_cache = torch.zeros(SLOTS, MAX_SEQ_LEN, KV_HEADS, HEAD_DIM)
    query = torch.zeros(rows.positions.shape[0], KV_HEADS * SHARE, HEAD_DIM)
    with _Operators() as layer:
        cached_attention(query, key_cache[None], value_cache[None], 0, plan)
    planning = {"masked_fill", "index_put_", "cumsum", "any", "argmax", "gt", "le", "repeat", "ones_like", "zeros"}
    assert not planning & set(layer.names), layer.names
    assert any("scaled_dot_product" in name for name in layer.names), layer.names


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_cached_attention_runs_two_products_a_window_copy_not_two_a_kv_head(case: str) -> None:
    """BF16 attention over cached windows: one product of queries and keys and one of probabilities and values
    over the batch and KV heads of the lanes' gathered windows, not two per KV head on strided views, whose every
    product copied its operand first."""
    rows = _rows(case)
    plan = plan_attention(rows, SLOTS, MAX_SEQ_LEN, SHARE, torch.bfloat16)
    key_cache = value_cache = torch.zeros(SLOTS, MAX_SEQ_LEN, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    query = torch.zeros(rows.positions.shape[0], KV_HEADS * SHARE, HEAD_DIM, dtype=torch.bfloat16)
    with _Operators() as layer:
        cached_attention(query, key_cache[None], value_cache[None], 0, plan)
    assert layer.names.count("bmm") == 2 and layer.names.count("index_select") == 2, layer.names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 128), (8, 8, 2, 37, 128), (4, 2, 6, 17, 16), (3, 2, 24, 5, 8)])
def test_the_merged_product_gives_the_per_head_values_at_decode_shapes(shape, dtype) -> None:
    """Each (batch, KV head) product of the merged BF16/FP16 attention is the per-head loop's GEMM, so decode
    shapes give the same values bit for bit (the per-head loop stays for packed prefill, where they did not)."""
    from ignition.recipes.attention import _eager_low_precision

    batch, kv_heads, rows, window, head_dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    query, keys, values = (torch.randn(batch, kv_heads, n, head_dim, generator=generator).to(dtype)
                           for n in (rows, window, window))
    hidden = torch.rand(batch, 1, rows, window, generator=generator) > 0.7
    hidden[..., 0] = False  # every row sees a key
    merged = _eager_low_precision(query, keys, values, hidden)
    torch.testing.assert_close(merged, _eager_low_precision(query, keys, values, hidden, per_head=True), rtol=0, atol=0)


def _transformers_eager(query, key_cache, value_cache, context: int, mask=None) -> torch.Tensor:
    """transformers' own eager attention (Qwen3's) of ``query [rows, heads, D]`` over slot 1's first ``context``
    keys: ``[rows, heads * D]``."""
    from types import SimpleNamespace

    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key_cache.shape[2], training=False)
    out, _ = eager_attention_forward(module, query.transpose(0, 1).unsqueeze(0),  # [1, heads, rows, D]
                                     key_cache[1:, :context].transpose(1, 2),  # [1, kv, context, D]
                                     value_cache[1:, :context].transpose(1, 2), mask, query.shape[-1] ** -0.5)
    return out.reshape(query.shape[0], -1)  # [1, rows, heads, D] -> [rows, heads * D]


BF16_WIDTH = dict(kv_heads=8, share=2, head_dim=128, slots=2, max_seq_len=96)  # Qwen3-0.6B's attention


def _bf16_caches(generator):
    w = BF16_WIDTH
    return [torch.randn(w["slots"], w["max_seq_len"], w["kv_heads"], w["head_dim"], generator=generator)
            .to(torch.bfloat16) for _ in range(2)]


def _key_window(needed: int) -> torch.Tensor:
    """The key window the loader passes to cover ``needed`` positions of a ``BF16_WIDTH`` cache."""
    from ignition.catalog.buffers import KEY_WINDOW, WINDOWS

    return torch.zeros(WINDOWS[KEY_WINDOW].covering(needed, BF16_WIDTH["max_seq_len"]), dtype=torch.int64)


def _bf16_plan(rows: Rows):
    w = BF16_WIDTH
    return plan_attention(rows, w["slots"], w["max_seq_len"], w["share"], torch.bfloat16)


def _deviations(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (got.double() - reference.double()).abs()


def _assert_bf16_fidelity(cases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], where: list[str]) -> None:
    """BF16 fidelity judged against transformers' own BF16 on this machine: ``cases`` of (ours, transformers'
    eager BF16, transformers' eager FP32 on the same BF16-valued inputs). Each case's largest deviation from the FP32
    reference may exceed transformers' by one BF16 ulp of the case's largest value, and the mean deviation over all
    cases by 2%.

    Why that slack: both sides round the scores, the probabilities and the output to BF16 at the same points; they
    differ only in the FP32 summation order of their products (oneDNN and MKL pick kernels by shape and ISA, and the
    key window gives ours other shapes), which moves an FP32 sum by ~1e-7 relative, so it flips a BF16 rounding
    (2**-9 relative) about once in 10,000 values, and a flip moves an output by at most one BF16 ulp. A structural
    error (one key too many or too few, a wrong scale) moves the mean twenty times or more
    (``test_the_bf16_fidelity_check_fails_attention_over_one_key_too_many``)."""
    ours_total = theirs_total = 0.0
    for (ours, theirs, reference), name in zip(cases, where):
        ours_deviation, theirs_deviation = _deviations(ours, reference), _deviations(theirs, reference)
        ulp = 2.0 ** (torch.floor(torch.log2(reference.abs().max().double())) - 7)
        worst, theirs_worst = float(ours_deviation.max()), float(theirs_deviation.max())
        assert worst <= theirs_worst + ulp, f"{name}: deviation {worst:.3g} against transformers' {theirs_worst:.3g}"
        ours_total += float(ours_deviation.mean())
        theirs_total += float(theirs_deviation.mean())
    assert ours_total <= 1.02 * theirs_total, \
        f"mean deviation {ours_total / len(cases):.4g} against transformers' {theirs_total / len(cases):.4g}"


def _decode_lane(generator, context: int, visible: int | None = None):
    """One lane at ``context`` keys through the key window the loader passes (``WINDOWS[KEY_WINDOW]``, 32 positions
    at least): (ours, transformers' eager BF16, its FP32) over the live keys. ``visible`` (a test of the check):
    ours attends over that many keys instead."""
    w = BF16_WIDTH
    key_cache, value_cache = _bf16_caches(generator)
    query = torch.randn(1, w["kv_heads"] * w["share"], w["head_dim"], generator=generator).to(torch.bfloat16)
    seen = visible or context
    rows = Rows.decode(torch.tensor([seen - 1]), torch.tensor([1]), torch.tensor([True]), _key_window(seen))
    ours = cached_attention(query, key_cache[None], value_cache[None], 0, _bf16_plan(rows))
    return (ours, _transformers_eager(query, key_cache, value_cache, context),
            _transformers_eager(query.float(), key_cache.float(), value_cache.float(), context))


DECODE_CONTEXTS = [*range(2, 18), 24, 31, 32, 33, 47, 64, 65, 80]  # short forwards (< SHORT_ROW), window edges


def test_a_bf16_decode_lane_is_as_close_to_fp32_as_transformers_bf16_eager() -> None:
    """One lane at contexts of 2 to 80 keys (eight draws each), the short forwards (``AttentionPlan.short``) and
    the key window's 32-position granule edges among them: ``_assert_bf16_fidelity``. On a machine whose kernels
    are the same for both (AVX-512 without AMX), the bits are transformers' own, and the check passes with
    equal deviations."""
    generator = torch.Generator().manual_seed(0)
    where = [f"context {context}" for context in DECODE_CONTEXTS for _ in range(8)]
    _assert_bf16_fidelity([_decode_lane(generator, int(name.split()[1])) for name in where], where)


def test_the_bf16_fidelity_check_fails_attention_over_one_key_too_many() -> None:
    generator = torch.Generator().manual_seed(0)
    cases = [_decode_lane(generator, context, visible=context + 1) for context in (4, 15, 31, 64) for _ in range(4)]
    with pytest.raises(AssertionError, match="deviation"):
        _assert_bf16_fidelity(cases, ["one key too many"] * len(cases))


PROMPT_LENGTHS = [*range(2, 18), 23, 31, 32, 33, 40]


@pytest.mark.parametrize("packed", [False, True], ids=["chunk", "packed"])
def test_a_bf16_prompt_is_as_close_to_fp32_as_transformers_bf16_eager_prefill(packed: bool) -> None:
    """A prompt of 2 to 40 tokens in one chunk of 48 rows (a prefill chunk's rows, or one lane of packed prompt
    chunks), through the key window the loader passes, against transformers' eager prefill of the whole prompt (its
    causal mask, rows as long as the prompt): ``_assert_bf16_fidelity`` over every prompt row."""
    from ignition.recipes.packed_attention import packed_attention

    w = BF16_WIDTH
    chunk_rows = 48
    generator = torch.Generator().manual_seed(1)
    cases, where = [], []
    for length in PROMPT_LENGTHS:
        for _ in range(3):
            key_cache, value_cache = _bf16_caches(generator)
            query = torch.randn(chunk_rows, w["kv_heads"] * w["share"], w["head_dim"], generator=generator)
            query = query.to(torch.bfloat16)
            key_window = _key_window(length)
            if packed:
                rows = Rows.packed(chunk_rows, torch.tensor([0, 0]), torch.tensor([length, 0]), torch.tensor([1, 0]),
                                   torch.zeros(chunk_rows, dtype=torch.int64), key_window)
                ours = packed_attention(query, key_cache, value_cache, rows)[:length]
            else:
                rows = Rows.prefill(chunk_rows, torch.tensor(0), torch.tensor(length), torch.tensor([1]), key_window)
                ours = cached_attention(query, key_cache[None], value_cache[None], 0, _bf16_plan(rows))[:length]
            causal = torch.ones(length, length, dtype=torch.bool).triu(1).view(1, 1, length, length)
            theirs, reference = (
                _transformers_eager(query[:length].to(dtype), key_cache.to(dtype), value_cache.to(dtype), length,
                                    torch.zeros(causal.shape, dtype=dtype).masked_fill(causal, torch.finfo(dtype).min))
                for dtype in (torch.bfloat16, torch.float32))
            cases.append((ours, theirs, reference))
            where.append(f"prompt of {length}")
    _assert_bf16_fidelity(cases, where)


def test_a_bf16_verify_row_attends_as_the_decode_step_at_its_position_bit_for_bit() -> None:
    """A verify group's rows (``Rows.row_forwards``) at positions that straddle ``SHORT_ROW``: each row gives the bits
    of a one-lane decode step at its position (each through the key window the loader passes for it), so greedy
    speculation keeps the tokens of plain decode (with one choice for the whole group, this test fails)."""
    w = BF16_WIDTH
    heads = w["kv_heads"] * w["share"]
    generator = torch.Generator().manual_seed(2)
    for first in range(8, 16):  # groups that end past 16 keys with rows below it (11-14) take the most cases
        for _ in range(300 if 11 <= first <= 14 else 20):
            key_cache, value_cache = _bf16_caches(generator)
            query = torch.randn(5, heads, w["head_dim"], generator=generator).to(torch.bfloat16)
            positions = torch.arange(first, first + 5)
            rows = Rows(positions=positions, write_slots=torch.ones(5, dtype=torch.int64),
                        valid=torch.ones(5, dtype=torch.bool), read_slots=torch.tensor([1]),
                        key_window=_key_window(first + 5), row_forwards=True)
            verified = cached_attention(query, key_cache[None], value_cache[None], 0, _bf16_plan(rows))
            for row, position in enumerate(positions.tolist()):
                alone = Rows.decode(torch.tensor([position]), torch.tensor([1]), torch.tensor([True]),
                                    _key_window(position + 1))
                decoded = cached_attention(query[row:row + 1], key_cache[None], value_cache[None], 0, _bf16_plan(alone))
                assert torch.equal(verified[row:row + 1], decoded), f"rows from {first}, row at {position}"
