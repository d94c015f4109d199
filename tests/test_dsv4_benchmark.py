"""benchmarks/dsv4.py: the V4-Flash-width checkpoint it builds (published values, the stated reductions, the layer
pattern), its tiny form's config as the recipe reads it, and its closing checks."""

from __future__ import annotations

import pytest

from benchmarks import dsv4

transformers = pytest.importorskip("transformers")


def test_the_checkpoint_is_flash_width_with_only_the_stated_reductions():
    config = dsv4.flash_config(4)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (4096, 64, 1, 512)
    assert (config.q_lora_rank, config.o_groups, config.o_lora_rank) == (1024, 8, 1024)
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 512)
    assert (config.sliding_window, config.hc_mult, config.hc_sinkhorn_iters) == (128, 4, 20)
    assert (config.num_experts_per_tok, config.moe_intermediate_size, config.n_shared_experts) == (6, 2048, 1)
    assert config.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert config.layer_types == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention"]  # compress_ratios [0, 0, 4, 128]
    assert config.mlp_layer_types == ["hash_moe", "hash_moe", "hash_moe", "moe"]
    assert dsv4.reductions(config) == ["n_routed_experts 256 -> 8", "vocab_size 129280 -> 4096"]
    assert len(dsv4.FLASH_PATTERN) == 43


def test_the_tiny_form_is_a_checkpoint_the_recipe_reads():
    from ignition.recipes.deepseek_v4 import DeepseekV4Config

    config = dsv4.flash_config(4, dsv4.TINY, eos_token_id=0)
    parsed = DeepseekV4Config.from_hf_config(config.to_dict(), "tiny")
    assert parsed.layer_kinds == ("shared_window", "shared_window", "compressed", "heavily_compressed")
    assert (parsed.csa_rate, parsed.hca_rate, parsed.sliding_window) == (4, 8, 8)
    assert "hidden_size 4096 -> 64" in dsv4.reductions(config)


def test_each_failed_check_is_named():
    checks = {check: met for check, _, met in dsv4.verdicts({1: True, 8: False}, True, 0)}
    assert checks == {"batch 1: greedy tokens equal transformers'": True,
                      "batch 8: greedy tokens equal transformers'": False,
                      "the served completion's tokens are the engine's": True, "validate-core finds no violation": True}
    assert not dict((c, m) for c, _, m in dsv4.verdicts({1: True}, False, 2))["validate-core finds no violation"]
