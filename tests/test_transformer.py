"""Functional Qwen3 / Llama forward against transformers' eager models, cache semantics and torch.export."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ignition.recipes.checkpoint import CheckpointError, open_checkpoint, read_config
from ignition.recipes.config import ModelConfig, kv_cache_shape, load_weights
from ignition.recipes.rope import rope_frequencies
from ignition.recipes.transformer import decode_hidden, lm_head_logits, prefill_hidden

# fp32: both sides run the same ops in the same order except matmul reduction order (attention
# over the padded cache length, chunked prefill). Measured max difference is ~2e-6 on logits of
# magnitude ~4.7 (fp32 eps 1.2e-7, two layers); 1e-4 leaves ~50x margin while a real bug (RoPE
# off by one position, wrong head grouping, a missed mask) moves logits by 1e-2 or more.
FP32_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
# bf16: we round every intermediate to bf16 exactly where HF does; on AVX-512 CPUs without AMX the
# result was measured bit-identical. Other matmul kernels (AMX, other shapes) may flip single roundings,
# so allow 2 bf16 ulps at the largest logits (|logit| in [4, 8): ulp = 2**-5), far below the O(1)
# shifts structural bugs cause.
BF16_TOLERANCE = dict(atol=2 * 2**-5, rtol=1.6e-2)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1000.0}


@dataclass(frozen=True, slots=True)
class TinyCase:
    family: str
    dtype: torch.dtype
    tie: bool
    rope: dict | None = None
    biases: bool = False
    max_shard_size: str | None = None


CASES = {
    # explicit head_dim 16 != hidden/heads (8); sharded; untied
    "qwen3_fp32_sharded": TinyCase("qwen3", torch.float32, tie=False, max_shard_size="20KB"),
    "llama_fp32_llama3_tied_bias": TinyCase("llama", torch.float32, tie=True, rope=LLAMA3_ROPE, biases=True),
    "qwen3_fp32_yarn_tied": TinyCase("qwen3", torch.float32, tie=True, rope=YARN_ROPE),
    "qwen3_bf16_tied": TinyCase("qwen3", torch.bfloat16, tie=True),
    "llama_bf16_untied": TinyCase("llama", torch.bfloat16, tie=False),
}
FP32_CASES = [name for name, case in CASES.items() if case.dtype == torch.float32]
BF16_CASES = [name for name, case in CASES.items() if case.dtype == torch.bfloat16]


def build_hf_model(case: TinyCase) -> torch.nn.Module:
    """Seeded tiny HF model with weights large enough that logits are O(1), not ~0."""
    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=case.tie,
                  rope_parameters=dict(case.rope) if case.rope else None)
    if case.family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=300, attention_bias=case.biases, mlp_bias=case.biases,
                                             **common))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # norm scales around 1, biases around 0
                parameter.copy_(float("norm" in name) + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    return model.to(case.dtype)


@dataclass(slots=True)
class Loaded:
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    hf: torch.nn.Module


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Loaded] = {}

    def get(name: str) -> Loaded:
        if name not in cache:
            case, directory = CASES[name], tmp_path_factory.mktemp(name)
            extra = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
            build_hf_model(case).save_pretrained(directory, **extra)
            cfg = ModelConfig.from_hf_config(read_config(directory))
            hf_class = Qwen3ForCausalLM if case.family == "qwen3" else LlamaForCausalLM
            hf = hf_class.from_pretrained(directory, dtype=case.dtype, attn_implementation="eager").eval()
            cache[name] = Loaded(cfg, load_weights(open_checkpoint(directory), cfg), hf)
        return cache[name]

    return get


def hf_logits(model: Loaded, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.hf(token_ids[None]).logits[0]  # [T, vocab]


def new_caches(model: Loaded, num_slots: int, max_seq_len: int, fill=torch.zeros):
    shape = kv_cache_shape(model.cfg, num_slots, max_seq_len)
    return fill(shape, dtype=model.cfg.dtype), fill(shape, dtype=model.cfg.dtype)


def scalar(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def prefill_chunked(model: Loaded, prompt: torch.Tensor, slot: int, chunk_rows: int, caches) -> torch.Tensor:
    """Prefill ``prompt`` in padded chunks of ``chunk_rows``; return logits of every prompt row."""
    logits = []
    for start in range(0, prompt.shape[0], chunk_rows):
        chunk = prompt[start:start + chunk_rows]
        padded = torch.cat([chunk, torch.full((chunk_rows - chunk.shape[0],), -1)])  # junk padding ids
        hidden = prefill_hidden(model.weights, model.cfg, padded, scalar(start), scalar(chunk.shape[0]),
                                scalar(slot), *caches)
        logits.append(lm_head_logits(model.weights, model.cfg, hidden)[:chunk.shape[0]])
    return torch.cat(logits)


@pytest.mark.parametrize("name", FP32_CASES)
def test_single_chunk_prefill_matches_hf(loaded, name: str) -> None:
    model = loaded(name)
    prompt = torch.randint(0, model.cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    caches = new_caches(model, num_slots=2, max_seq_len=32)
    ours = prefill_chunked(model, prompt, slot=1, chunk_rows=16, caches=caches)
    torch.testing.assert_close(ours, hf_logits(model, prompt), **FP32_TOLERANCE)


def run_chunked_prefill_and_batched_decode(model: Loaded, tolerance: dict) -> None:
    """Three requests in scrambled slots, 8-row padded chunks, then batched teacher-forced decode.

    Lane 3 is inactive and aims at the same (slot, position) as lane 0 to exercise write collisions.
    """
    generator = torch.Generator().manual_seed(2)
    prompt_lengths, slots, decode_steps = [11, 5, 17], [2, 0, 3], 5
    sequences = [torch.randint(0, model.cfg.vocab_size, (length + decode_steps,), generator=generator)
                 for length in prompt_lengths]
    references = [hf_logits(model, sequence) for sequence in sequences]
    caches = new_caches(model, num_slots=4, max_seq_len=32)
    for sequence, length, slot, reference in zip(sequences, prompt_lengths, slots, references):
        ours = prefill_chunked(model, sequence[:length], slot, chunk_rows=8, caches=caches)
        torch.testing.assert_close(ours, reference[:length], **tolerance)
    for step in range(decode_steps):
        positions = [length + step for length in prompt_lengths]
        input_ids = torch.tensor([seq[pos] for seq, pos in zip(sequences, positions)] + [model.cfg.vocab_size + 5])
        hidden = decode_hidden(model.weights, model.cfg, input_ids, torch.tensor(positions + [positions[0]]),
                               torch.tensor(slots + [slots[0]]), torch.tensor([True, True, True, False]), *caches)
        logits = lm_head_logits(model.weights, model.cfg, hidden)
        assert logits.shape == (4, model.cfg.vocab_size) and logits.dtype == model.cfg.dtype
        assert torch.isfinite(logits[3]).all()
        expected = torch.stack([reference[pos] for reference, pos in zip(references, positions)])
        torch.testing.assert_close(logits[:3], expected, **tolerance)


@pytest.mark.parametrize("name", FP32_CASES)
def test_chunked_prefill_and_batched_decode_match_hf_fp32(loaded, name: str) -> None:
    run_chunked_prefill_and_batched_decode(loaded(name), FP32_TOLERANCE)


@pytest.mark.parametrize("name", BF16_CASES)
def test_chunked_prefill_and_batched_decode_match_hf_bf16(loaded, name: str) -> None:
    run_chunked_prefill_and_batched_decode(loaded(name), BF16_TOLERANCE)


def test_padding_rows_leave_cache_bit_identical(loaded) -> None:
    model = loaded("qwen3_fp32_sharded")
    torch.manual_seed(3)
    k_cache, v_cache = new_caches(model, num_slots=3, max_seq_len=32, fill=torch.randn)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # chunk at the end of the cache: padding rows 5..7 aim past max_seq_len, so clamping lands them
    # on the cell valid row 4 writes; they come later in the single index_put_ and must not win
    input_ids = torch.randint(0, model.cfg.vocab_size, (8,))
    hidden = prefill_hidden(model.weights, model.cfg, input_ids, scalar(27), scalar(5), scalar(1), k_cache, v_cache)
    assert torch.isfinite(hidden).all()
    written = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    written[:, 1, 27:32] = True
    for after, before in ((k_cache, k_before), (v_cache, v_before)):
        changed = (after != before).any(dim=(-1, -2))  # [layers, slots, positions]
        assert torch.equal(changed, written)
        assert torch.equal(after[~written], before[~written])
    # an all-padding chunk writes nothing
    prefill_hidden(model.weights, model.cfg, input_ids, scalar(4), scalar(0), scalar(2), k_cache, v_cache)
    assert torch.equal(k_cache[:, 2], k_before[:, 2]) and torch.equal(v_cache[:, 2], v_before[:, 2])


@pytest.mark.parametrize("name", ["llama_fp32_llama3_tied_bias", "llama_bf16_untied"])
def test_inactive_decode_rows_leave_cache_bit_identical(loaded, name: str) -> None:
    model = loaded(name)
    torch.manual_seed(4)
    k_cache, v_cache = new_caches(model, num_slots=3, max_seq_len=16, fill=torch.randn)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # all inactive, with out-of-range slots, positions and token ids
    hidden = decode_hidden(model.weights, model.cfg, torch.tensor([-1, 5, 10_000]), torch.tensor([-3, 40, 5]),
                           torch.tensor([7, -1, 0]), torch.tensor([False, False, False]), k_cache, v_cache)
    assert torch.isfinite(hidden).all()
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    # one active lane; inactive lanes before and after it target the same cell, two others collide
    decode_hidden(model.weights, model.cfg, torch.tensor([3, 4, 5, 6, 7]), torch.tensor([4, 4, 4, 9, 9]),
                  torch.tensor([1, 1, 1, 2, 2]), torch.tensor([False, True, False, False, False]), k_cache, v_cache)
    written = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    written[:, 1, 4] = True
    for after, before in ((k_cache, k_before), (v_cache, v_before)):
        assert torch.equal((after != before).any(dim=(-1, -2)), written)


@pytest.mark.parametrize("name", FP32_CASES)
def test_decode_lanes_in_any_order_make_the_same_bits(loaded, name: str) -> None:
    """Decode lanes with as many slots as lanes: each lane's hidden row and every cache cell are the same bits
    whatever the lanes' order, with inactive lanes (one colliding with an active lane's cell, one at a slot no
    active lane holds) leaving their cells as they were."""
    model = loaded(name)
    torch.manual_seed(6)
    caches = new_caches(model, num_slots=4, max_seq_len=16, fill=torch.randn)
    input_ids, positions = torch.tensor([3, 9, 4, 7]), torch.tensor([5, 11, 5, 2])
    slots, active = torch.tensor([2, 0, 2, 1]), torch.tensor([True, True, False, False])

    def run(order: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        index = torch.tensor(order)
        hidden = decode_hidden(model.weights, model.cfg, input_ids[index], positions[index], slots[index],
                               active[index], k_cache, v_cache)
        return hidden[torch.argsort(index)], k_cache, v_cache

    lane_order = run([0, 1, 2, 3])
    for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
        hidden, k_cache, v_cache = run(order)
        assert torch.equal(hidden[:2], lane_order[0][:2]) and torch.isfinite(hidden).all()
        assert torch.equal(k_cache, lane_order[1]) and torch.equal(v_cache, lane_order[2])
    written = torch.zeros(caches[0].shape[:3], dtype=torch.bool)
    written[:, 2, 5] = written[:, 0, 11] = True
    for after, before in zip(lane_order[1:], caches):
        assert torch.equal((after != before).any(dim=(-1, -2)), written)


class DecodeStep(torch.nn.Module):
    """Export wrapper: weights and caches are graph inputs; the caches are mutated in place."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, weights, input_ids, positions, slots, active, k_cache, v_cache):
        hidden = decode_hidden(weights, self.cfg, input_ids, positions, slots, active, k_cache, v_cache)
        return lm_head_logits(weights, self.cfg, hidden)


class PrefillChunk(DecodeStep):
    def forward(self, weights, input_ids, chunk_start, chunk_len, slot, k_cache, v_cache):
        hidden = prefill_hidden(weights, self.cfg, input_ids, chunk_start, chunk_len, slot, k_cache, v_cache)
        return lm_head_logits(weights, self.cfg, hidden)


def assert_export_matches_eager(module: torch.nn.Module, model: Loaded, inputs: tuple) -> None:
    torch.manual_seed(5)
    k_cache, v_cache = new_caches(model, num_slots=3, max_seq_len=16, fill=torch.randn)
    program = torch.export.export(module, (model.weights, *inputs, k_cache.clone(), v_cache.clone()))
    eager_caches, exported_caches = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    eager = module(model.weights, *inputs, *eager_caches)
    exported = program.module()(model.weights, *inputs, *exported_caches)
    torch.testing.assert_close(exported, eager, **FP32_TOLERANCE)
    for ours, reference, initial in zip(exported_caches, eager_caches, (k_cache, v_cache)):
        assert not torch.equal(ours, initial)  # the mutation reached the caller's tensors
        torch.testing.assert_close(ours, reference, **FP32_TOLERANCE)
    # after functionalisation the cache writes are explicit input mutations of the graph
    mutated = {spec.target for spec in program.run_decompositions().graph_signature.output_specs
               if spec.kind == torch.export.graph_signature.OutputKind.USER_INPUT_MUTATION}
    assert mutated == {"k_cache", "v_cache"}


@pytest.mark.parametrize("name", ["qwen3_fp32_sharded", "llama_fp32_llama3_tied_bias"])
def test_export_decode_matches_eager_and_mutates_cache(loaded, name: str) -> None:
    model = loaded(name)
    inputs = (torch.tensor([3, 4, 5]), torch.tensor([2, 7, 7]), torch.tensor([0, 2, 2]),
              torch.tensor([True, True, False]))
    assert_export_matches_eager(DecodeStep(model.cfg), model, inputs)


def test_export_prefill_matches_eager_and_mutates_cache(loaded) -> None:
    model = loaded("qwen3_fp32_yarn_tied")
    inputs = (torch.arange(8) % model.cfg.vocab_size, scalar(4), scalar(5), scalar(2))
    assert_export_matches_eager(PrefillChunk(model.cfg), model, inputs)


def hf_style_config(**overrides) -> dict:
    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
              "dtype": "bfloat16", "tie_word_embeddings": True}
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


def test_config_parsing_reads_modern_and_legacy_fields() -> None:
    qwen3 = ModelConfig.from_hf_config(hf_style_config())
    assert (qwen3.family, qwen3.head_dim, qwen3.qk_norm, qwen3.rope_theta, qwen3.dtype) == (
        "qwen3", 16, True, 1e6, torch.bfloat16)
    legacy_llama = ModelConfig.from_hf_config(hf_style_config(
        architectures=["LlamaForCausalLM"], head_dim=None, rope_parameters=None, dtype=None,
        torch_dtype="float16", rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}))
    assert (legacy_llama.head_dim, legacy_llama.qk_norm, legacy_llama.rope_theta) == (8, False, 500000.0)
    assert (legacy_llama.rope_scaling.kind, legacy_llama.rope_scaling.factor) == ("linear", 2.0)
    assert legacy_llama.dtype == torch.float16
    assert kv_cache_shape(qwen3, 3, 16) == (2, 3, 16, 2, 16)
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        kv_cache_shape(qwen3, 3, 0)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": None}, "field 'hidden_size' is required"),
    ({"head_dim": None}, "field 'head_dim' is required"),
    ({"vocab_size": "96"}, "field 'vocab_size' must be int; found '96'"),
    ({"num_key_value_heads": 3}, "num_heads must be a multiple of num_kv_heads"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' must be 'silu'"),
    ({"use_sliding_window": True}, "field 'use_sliding_window' must be false"),
    ({"dtype": "float8"}, "field 'dtype' must be one of"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' cannot be exported with static shapes"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "'longrope' cannot be exported with static shapes"),
    ({"rope_parameters": {"rope_type": "mystery"}}, "rope_type' must be one of"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "(rope_parameters): field 'low_freq_factor' is required"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer RoPE is unsupported"),
])
def test_invalid_config_fields_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_hf_config(hf_style_config(**overrides))
    assert isinstance(error.value, ValueError) and message in str(error.value)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    LLAMA3_ROPE,
    YARN_ROPE,
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "rope_theta": 50000.0,
     "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
])
def test_rope_frequencies_are_bit_identical_to_transformers(rope: dict) -> None:
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
                            rope_parameters=dict(rope), architectures=["LlamaForCausalLM"])
    hf_rope = hf_config.rope_parameters
    if hf_rope["rope_type"] == "default":
        hf_inv_freq = 1.0 / (hf_rope["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
        hf_multiplier = 1.0
    else:
        hf_inv_freq, hf_multiplier = ROPE_INIT_FUNCTIONS[hf_rope["rope_type"]](hf_config)
    inv_freq, multiplier = rope_frequencies(ModelConfig.from_hf_config(hf_config.to_dict()))
    assert torch.equal(inv_freq, hf_inv_freq) and multiplier == pytest.approx(hf_multiplier, rel=1e-15)


def test_cache_with_wrong_dtype_is_rejected(loaded) -> None:
    model = loaded("qwen3_fp32_sharded")
    shape = kv_cache_shape(model.cfg, 2, 8)
    caches = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache must have shape .* and dtype torch.float32; found .* torch.bfloat16"):
        decode_hidden(model.weights, model.cfg, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                      torch.tensor([True]), *caches)
