"""The paged KV layout (catalog/geometry.py ``PAGED_STATE``) at the recipe level: a pool of blocks addressed through
hand-made block tables gives the slot layout's logits and tokens, whatever blocks a slot holds: GQA's K and V
(qwen3), and MLA's latent and rope key (deepseek_v3)."""

from __future__ import annotations

import pytest
import torch

from _decoder_cores import TinyCase, save_checkpoint
from ignition.catalog.buffers import KEY_WINDOW, WINDOWS
from ignition.catalog.geometry import max_blocks
from ignition.recipes.checkpoint import open_checkpoint, read_config
from ignition.recipes.config import ModelConfig, kv_cache_shape, load_weights
from ignition.recipes.deepseek_v3 import WEIGHT_MAP as MLA_WEIGHT_MAP
from ignition.recipes.deepseek_v3 import DeepseekV3Config
from ignition.recipes.layers import Rows
from ignition.recipes.mla import mla_decoder
from ignition.recipes.transformer import gqa_decoder, lm_head_logits
from ignition.recipes.weights import load_weights as load_mapped_weights

SLOTS, MAX_SEQ_LEN, BLOCK_SIZE = 3, 64, 8
BLOCKS = max_blocks(MAX_SEQ_LEN, BLOCK_SIZE)
SPARE = 5  # pool blocks no slot uses (a pool larger than the tables need), holding junk


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("paged")
    save_checkpoint(TinyCase("qwen3", request.param, tie=False, vocab_size=96), directory, reload=False)
    cfg = ModelConfig.from_hf_config(read_config(directory))
    return cfg, load_weights(open_checkpoint(directory), cfg)


def permuted_tables(seed: int) -> tuple[torch.Tensor, int]:
    """Every slot's blocks scattered over a pool of SLOTS * BLOCKS + SPARE blocks: (tables, pool blocks)."""
    pool = SLOTS * BLOCKS + SPARE
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:SLOTS * BLOCKS]
    return order.view(SLOTS, BLOCKS).to(torch.int32), pool


def window(needed: int) -> torch.Tensor:
    return torch.zeros(WINDOWS[KEY_WINDOW].covering(needed, MAX_SEQ_LEN), dtype=torch.int64)


def run(cfg, weights, caches, tables, steps, decoder=gqa_decoder):
    """Prefill three prompts (two chunks for the longest), then decode all three lanes (one inactive lane aimed at
    lane 0's cell) for ``steps`` greedy steps: every step's logits and the tokens."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (length,), generator=generator) for length in (13, 5, 22)]
    slots = [2, 0, 1]
    logits, tokens = [], []
    for prompt, slot in zip(prompts, slots):
        for start in range(0, prompt.shape[0], 16):
            chunk = prompt[start:start + 16]
            rows = Rows.prefill(16, torch.tensor([start]), torch.tensor([chunk.shape[0]]), torch.tensor([slot]),
                                window(start + 16), tables)
            padded = torch.cat([chunk, torch.full((16 - chunk.shape[0],), 7)])
            logits.append(lm_head_logits(weights, cfg, decoder(weights, cfg, padded, rows, caches))[:chunk.shape[0]])
    lengths = [prompt.shape[0] for prompt in prompts]
    current = [int(logits[index].argmax(-1)[-1]) for index in (0, 1, 3)]
    for step in range(steps):
        positions = [length + step for length in lengths]
        rows = Rows.decode(torch.tensor(positions + [positions[0]]), torch.tensor(slots + [slots[0]]),
                           torch.tensor([True, True, True, False]), window(max(positions) + 1), block_tables=tables)
        step_logits = lm_head_logits(weights, cfg, decoder(weights, cfg, torch.tensor(current + [3]), rows, caches))
        logits.append(step_logits[:3])
        current = step_logits[:3].argmax(-1).tolist()
        tokens.append(current)
    return logits, tokens


def test_permuted_block_tables_give_the_slot_layouts_logits(model) -> None:
    cfg, weights = model
    dtype = weights["embed"].dtype
    slot_caches = {name: torch.zeros(kv_cache_shape(cfg, SLOTS, MAX_SEQ_LEN), dtype=dtype) for name in cfg.cache_names}
    expected, expected_tokens = run(cfg, weights, slot_caches, None, steps=12)
    tables, pool = permuted_tables(seed=4)
    shape = kv_cache_shape(cfg, SLOTS, MAX_SEQ_LEN, BLOCK_SIZE, pool)
    assert shape == (cfg.num_layers, pool, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    paged_caches = {name: torch.full(shape, 1e4, dtype=dtype) for name in cfg.cache_names}  # junk: never read unmasked
    found, found_tokens = run(cfg, weights, paged_caches, tables, steps=12)
    assert found_tokens == expected_tokens
    tolerance = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=0, rtol=0)
    for ours, theirs in zip(found, expected):
        torch.testing.assert_close(ours, theirs, **tolerance)
    # the cells each slot wrote are the slot layout's, moved to its blocks; the spare blocks were never written
    used = torch.zeros(pool, dtype=torch.bool)
    used[tables.flatten().long()] = True
    assert (paged_caches["k_cache"][:, ~used] == 1e4).all()
    for slot in range(SLOTS):
        cells = paged_caches["k_cache"][:, tables[slot].long()].flatten(1, 2)  # [layers, positions, ...]
        written = slot_caches["k_cache"][:, slot]
        live = written.abs().sum((0, 2, 3)) > 0  # the positions the slot wrote
        assert live.any()
        torch.testing.assert_close(cells[:, live], written[:, live], atol=0, rtol=0)


def test_table_entries_past_a_slots_blocks_are_not_read(model) -> None:
    """A slot's table past its live blocks may name any block (even another slot's): the logits do not change."""
    cfg, weights = model
    tables, pool = permuted_tables(seed=5)
    shape = kv_cache_shape(cfg, SLOTS, MAX_SEQ_LEN, BLOCK_SIZE, pool)
    caches = {name: torch.zeros(shape, dtype=weights["embed"].dtype) for name in cfg.cache_names}
    reference, reference_tokens = run(cfg, weights, caches, tables, steps=3)
    stale = tables.clone()  # each slot's entries past its live blocks (inside the key window) name another's block
    stale[2, 2:], stale[0, 1:], stale[1, 4:] = tables[1, 0], tables[1, 0], tables[2, 0]  # 16, 8, 25 positions live
    caches = {name: torch.zeros(shape, dtype=weights["embed"].dtype) for name in cfg.cache_names}
    found, found_tokens = run(cfg, weights, caches, stale, steps=3)
    assert found_tokens == reference_tokens
    for ours, theirs in zip(found, reference):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("paged-mla")
    save_checkpoint(TinyCase("deepseek_v3", torch.float32, tie=False, vocab_size=96), directory, reload=False)
    cfg = DeepseekV3Config.from_hf_config(read_config(directory), "config.json")
    return cfg, load_mapped_weights(open_checkpoint(directory), cfg, MLA_WEIGHT_MAP, torch.float32)


def test_mla_pools_through_permuted_tables_give_the_slot_layouts_logits(mla_model) -> None:
    """deepseek_v3's latent and rope key pools read and written through scattered block tables: the slot layout's
    tokens and logits, the slot layout's cells in each slot's blocks, and nothing in the blocks no table names."""
    cfg, weights = mla_model
    slot_caches = {name: torch.zeros(shape) for name, shape in cfg.cache_shapes(SLOTS, MAX_SEQ_LEN).items()}
    expected, expected_tokens = run(cfg, weights, slot_caches, None, steps=8, decoder=mla_decoder)
    tables, pool = permuted_tables(seed=6)
    shapes = cfg.cache_shapes(SLOTS, MAX_SEQ_LEN, BLOCK_SIZE, pool)
    assert shapes == {"latent_cache": (cfg.num_layers, pool, BLOCK_SIZE, cfg.kv_lora_rank),
                      "rope_key_cache": (cfg.num_layers, pool, BLOCK_SIZE, cfg.qk_rope_head_dim)}
    paged_caches = {name: torch.full(shape, 1e4) for name, shape in shapes.items()}  # junk: never read unmasked
    found, found_tokens = run(cfg, weights, paged_caches, tables, steps=8, decoder=mla_decoder)
    assert found_tokens == expected_tokens
    for ours, theirs in zip(found, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    used = torch.zeros(pool, dtype=torch.bool)
    used[tables.flatten().long()] = True
    for name in shapes:
        assert (paged_caches[name][:, ~used] == 1e4).all(), name
        for slot in range(SLOTS):
            cells = paged_caches[name][:, tables[slot].long()].flatten(1, 2)  # [layers, positions, width]
            written = slot_caches[name][:, slot]
            live = written.abs().sum((0, 2)) > 0
            assert live.any()
            torch.testing.assert_close(cells[:, live], written[:, live], atol=0, rtol=0)


@pytest.fixture(scope="module")
def paged_core(tmp_path_factory):
    """A tiny qwen3 core of 4 slots x 64 positions in blocks of 8: a pool of at most 32 blocks."""
    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    root = tmp_path_factory.mktemp("paged_core")
    save_checkpoint(TinyCase("qwen3", torch.float32, tie=False, vocab_size=96), root / "checkpoint", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "checkpoint", capacities=(1, 2), chunk_limit=16,
                              max_seq_len=MAX_SEQ_LEN, num_slots=4, block_size=BLOCK_SIZE), root / "core")
    return root / "core"


def generate(core, requests_tokens):
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    results = Engine(core).generate([Request(prompt_ids=prompt, max_tokens=6, ignore_eos=True)
                                     for prompt in requests_tokens])
    return [result.token_ids for result in results]


def test_a_budgeted_pool_holds_fewer_blocks_and_serves_the_same_tokens(paged_core) -> None:
    from ignition.runtime.core import load_core
    from ignition.runtime.options import LoadOptions

    full = load_core(paged_core)
    assert (full.kv_pool.num_blocks, full.kv_pool.block_size, full.kv_pool.capacity_tokens) == (32, 8, 248)
    bytes_per_block = full.kv_pool.bytes_per_block  # k and v: 2 layers x 8 positions x 2 heads x 16 x 4 bytes
    assert bytes_per_block == 2 * 2 * 8 * 2 * 16 * 4
    small = load_core(paged_core, LoadOptions.create(kv_cache_memory=12 * bytes_per_block + 5, kv_host_memory=0))
    assert small.kv_pool.num_blocks == 12 and small.state["k_cache"].shape[1] == 12
    prompts = [[5, 9, 3, 7, 1, 2, 8, 4, 6, 2, 11, 30, 31, 32, 1, 2, 3, 17, 9], [4, 4, 2], [60, 61, 62, 63, 1, 0, 9]]
    assert generate(small, prompts) == generate(full, prompts)


def test_a_pool_below_one_sequence_is_refused_by_name(paged_core) -> None:
    from ignition.runtime.core import load_core
    from ignition.runtime.options import LoadOptions
    from ignition.runtime.verified import CoreLoadError

    with pytest.raises(CoreLoadError, match=r"kv_cache_memory 36863 bytes holds 8 KV blocks of 4096 bytes; one "
                                            r"sequence of max_seq_len 64 positions needs 8 and the null block "
                                            r"\(36864 bytes\)"):
        load_core(paged_core, LoadOptions.create(kv_cache_memory=36863))
    assert load_core(paged_core, LoadOptions.create(kv_cache_memory=36864)).kv_pool.capacity_tokens == 64


def test_block_moves_copy_every_paged_tensor(paged_core) -> None:
    from ignition.runtime.core import load_core
    from ignition.runtime.options import LoadOptions

    core = load_core(paged_core, LoadOptions.create(kv_cache_memory=10 * 4096, kv_host_memory=3 * 4096 + 7))
    pool = core.kv_pool
    assert (pool.num_blocks, pool.host_blocks) == (10, 3)
    for index, name in enumerate(("k_cache", "v_cache")):
        core.state[name].copy_(torch.randn(core.state[name].shape, generator=torch.Generator().manual_seed(index)))
    before = {name: core.state[name].clone() for name in ("k_cache", "v_cache")}
    pool.copy_blocks([1, 7], [4, 2])
    pool.to_host([4, 9], [2, 0])
    pool.from_host([2, 0], [0, 5])
    for name, old in before.items():
        now = core.state[name]
        assert torch.equal(now[:, 4], old[:, 1]) and torch.equal(now[:, 2], old[:, 7])
        assert torch.equal(now[:, 0], old[:, 1]) and torch.equal(now[:, 5], old[:, 9])  # the round trip via host
        assert torch.equal(now[:, 3], old[:, 3]) and torch.equal(now[:, 9], old[:, 9])  # untouched
    with pytest.raises(ValueError, match="out of range"):
        pool.copy_blocks([10], [0])


def test_inspect_reports_the_pools_capacity_in_tokens(paged_core) -> None:
    from ignition.catalog.inspect import inspect_core
    from ignition.validate.core import validate_core

    memory = inspect_core(validate_core(paged_core, check_graphs=False))["memory"]
    assert (memory["kv_block_size"], memory["kv_blocks_max"], memory["kv_capacity_tokens_max"]) == (8, 32, 248)
    assert memory["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, FP32
