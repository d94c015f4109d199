"""The qwen3_moe and deepseek_v3 recipes against transformers, on examples/make_tiny_moe.py checkpoints.

One core per family (decode capacity 2, 8-row chunks, --prompt-logprobs) is exported and loaded
once and driven the way ``ignition run --logprobs 20 --prompt-logprobs 5 --json`` drives it (the
loader's engine, then ``run_json``), and with two requests batched in one decode variant.
transformers (eager attention, eager experts) is the oracle, teacher-forced over the generated
text. The decoder functions are also checked directly on logits.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from ignition.cli import app
from ignition.catalog.hashing import dump_json
from ignition.recipes.checkpoint import open_checkpoint, read_config
from ignition.recipes.deepseek_v3 import FAMILY as DEEPSEEK_V3
from ignition.recipes.layers import Rows
from ignition.recipes.llama import FAMILIES
from ignition.recipes.rope import rope_frequencies
from ignition.recipes.transformer import lm_head_logits
from ignition.recipes.weights import load_weights
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.present import run_json
from ignition.validate.core import validate_core
from ignition.runtime.requests import Request, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_moe.py"
RECIPES = ("qwen3_moe", "deepseek_v3")
DECODER_FAMILIES = {"qwen3_moe": FAMILIES["qwen3_moe"], "deepseek_v3": DEEPSEEK_V3}
CHUNK, MAX_SEQ_LEN = 8, 64
# fp32: our logits differ from transformers' by matmul reduction order only (MLA also by its absorbed
# form); measured <= 4e-6 on logits of magnitude ~4 (qwen3_moe 1e-6). 1e-4 leaves a 25x margin, while
# a routing or RoPE bug moves logits by 1e-2 or more. Values within NEAR of a neighbour may swap ranks.
TOL, NEAR = 1e-4, 5e-5
# bf16: every intermediate is rounded where transformers rounds it (MLA in transformers' expanded
# form); measured bit-identical on CPU. Allow 2 bf16 ulps at |logit| < 8 for other matmul kernels.
BF16_TOL = 2 * 2**-5
# cache bytes per token, fp32: qwen3_moe K and V [3 layers, 2 kv heads, 16]; MLA latent 16 + rope key 8 per layer
KV_BYTES_PER_TOKEN = {"qwen3_moe": 2 * 3 * 2 * 16 * 4, "deepseek_v3": 3 * (16 + 8) * 4}
STATE = {"qwen3_moe": {"k_cache": [3, 2 * MAX_SEQ_LEN // 16, 16, 2, 16],  # pools: 2 slots of 16-position blocks
                       "v_cache": [3, 2 * MAX_SEQ_LEN // 16, 16, 2, 16]},
         "deepseek_v3": {"latent_cache": [3, 2 * MAX_SEQ_LEN // 16, 16, 16],  # MLA's pools: the latent, the rope key
                         "rope_key_cache": [3, 2 * MAX_SEQ_LEN // 16, 16, 8]}}


def load_example():
    spec = importlib.util.spec_from_file_location("make_tiny_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_reload(directory: Path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, moe_cores):
    """recipe -> (checkpoint directory, transformers model), written once by the example script: the FP32 ones are
    those tests/conftest.py's ``moe_cores`` exported (read only); the ``(recipe, "bfloat16")`` keys hold bf16
    checkpoints."""
    root, example = tmp_path_factory.mktemp("moe"), load_example()
    made = {}
    for recipe in RECIPES:
        directory = moe_cores[recipe][0]
        made[recipe] = (directory, hf_reload(directory))
        directory = example.make_checkpoint(root / f"{recipe}-bf16", recipe, torch.bfloat16)
        made[recipe, "bfloat16"] = (directory, hf_reload(directory, torch.bfloat16))
    return made


@pytest.fixture(scope="module")
def cores(moe_cores):
    """recipe -> (exported core, loaded core): tests/conftest.py's ``moe_cores`` (decode capacity 2, ``CHUNK``-row
    chunks, ``MAX_SEQ_LEN`` positions, prompt scoring; the export validates it) of ``checkpoints``' FP32 checkpoint,
    loaded once."""
    made = {}

    def get(recipe: str):
        if recipe not in made:
            out = moe_cores[recipe][1]
            assert json.loads((out / "manifest.json").read_text())["chunk_limit"] == CHUNK  # MAX_SEQ_LEN: STATE
            made[recipe] = (out, load_core(out, device="cpu"))
        return made[recipe]

    return get


def oracle(hf, sequence: list[int]) -> torch.Tensor:
    """FP64 log_softmax of transformers' logits over ``sequence``: ``[len, vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([sequence])).logits[0].double(), dim=-1)


def assert_ranked_ids(ids: list[int], row: torch.Tensor, where: str) -> None:
    """``ids`` are the best of ``row`` in order (value desc, id asc), except where a neighbour is within NEAR."""
    order = sorted(range(row.shape[0]), key=lambda token: (-float(row[token]), token))
    for rank, token in enumerate(ids):
        neighbours = [float(row[order[i]]) for i in (rank - 1, rank + 1) if 0 <= i < len(order)]
        if all(abs(float(row[order[rank]]) - value) > NEAR for value in neighbours):
            assert token == order[rank], f"{where}: alternative {rank} is {token}, expected {order[rank]}"


def assert_generation_matches(hf, prompt: list[int], tokens: list[int], logprobs: list[float],
                              tops: list[list[tuple[int, float]]], k: int, where: str) -> None:
    """Greedy tokens, their logprobs and the top-k against transformers, teacher-forced."""
    rows = oracle(hf, prompt + tokens)
    assert len(tokens) == len(logprobs) == len(tops)
    for step, (token, logprob, top) in enumerate(zip(tokens, logprobs, tops)):
        row, at = rows[len(prompt) + step - 1], f"{where} step {step}"
        best = torch.topk(row, 2).values
        if float(best[0] - best[1]) > NEAR:
            assert token == int(row.argmax()), at
        assert abs(logprob - float(row[token])) <= TOL, at
        assert len(top) == k, at
        values = torch.tensor([value for _, value in top], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(values, row[[token_id for token_id, _ in top]], atol=TOL, rtol=0)
        assert_ranked_ids([token_id for token_id, _ in top], row, at)


def assert_prompt_entries_match(hf, prompt: list[int], entries: list, k: int, where: str) -> None:
    """Each prompt position's logprob, rank and top-k against transformers' scores of the prompt."""
    rows = oracle(hf, prompt)
    assert len(entries) == len(prompt) and entries[0] is None, where
    for position in range(1, len(prompt)):
        entry, row, token, at = entries[position], rows[position - 1], prompt[position], f"{where} row {position}"
        assert entry["id"] == token and abs(entry["logprob"] - float(row[token])) <= TOL, at
        strictly_greater = int((row > row[token] + NEAR).sum())
        near = int(((row - row[token]).abs() <= NEAR).sum()) - 1
        assert strictly_greater + 1 <= entry["rank"] <= strictly_greater + 1 + near, at
        top = [(t["id"], t["logprob"]) for t in entry["top_logprobs"]]
        assert len(top) == k, at
        values = torch.tensor([value for _, value in top], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:k], atol=TOL, rtol=0)
        assert_ranked_ids([token_id for token_id, _ in top], row, at)


@pytest.mark.parametrize("recipe", RECIPES)
def test_core_declares_its_cache_and_stores_experts_once(cores, checkpoints, recipe: str) -> None:
    """The export validated the whole core (graphs included); here: state, memory report and weights."""
    core, _ = cores(recipe)
    assert validate_core(core, check_graphs=False).ok
    manifest = json.loads((core / "manifest.json").read_text())
    assert {s["name"]: s["shape"] for s in manifest["state"]} == STATE[recipe] | {"penalty_counts": [2, 2, 320]}
    assert manifest["features"]["prompt_logprobs"] and manifest["capacities"] == [2]
    inspected = CliRunner().invoke(app, ["inspect-core", str(core), "--memory", "--json"])
    assert inspected.exit_code == 0, inspected.output
    memory = json.loads(inspected.output)["memory"]
    assert memory["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN[recipe]
    assert memory["kv_capacity_tokens_max"] == (2 * MAX_SEQ_LEN // 16 - 1) * 16  # every block but the null one
    with safe_open(str(core / "weights.safetensors"), framework="pt") as stored, \
            safe_open(str(checkpoints[recipe][0] / "model.safetensors"), framework="pt") as original:
        assert len(set(stored.keys())) == len(set(original.keys()))  # every tensor once, experts as stored
        assert sum(".experts." in name for name in stored.keys()) == 2 * 8 * 3  # 2 MoE layers x 8 experts x 3


def test_validator_checks_the_latent_cache_against_the_manifest(cores, tmp_path) -> None:
    """The MLA caches are declared through the geometry table: a manifest that lies about them is refused."""
    core = tmp_path / "core"
    shutil.copytree(cores("deepseek_v3")[0], core)
    manifest = json.loads((core / "manifest.json").read_text())
    assert (manifest["model"]["kv_lora_rank"], manifest["model"]["qk_rope_head_dim"]) == (16, 8)
    manifest["model"]["kv_lora_rank"] = 32
    (core / "manifest.json").write_bytes(dump_json(manifest))
    report = validate_core(core, check_graphs=False)
    assert any(v.rule == "GEOM-MODEL" and "latent_cache" in v.where for v in report.violations), report.violations
    manifest["model"]["kv_lora_rank"], manifest["model"]["kv_blocks"] = 16, 9  # the pools hold 8 blocks
    (core / "manifest.json").write_bytes(dump_json(manifest))
    lies = {v.where for v in validate_core(core, check_graphs=False).violations if v.rule == "GEOM-KV-BLOCKS"}
    assert {"latent_cache", "rope_key_cache"} <= {name for name in ("latent_cache", "rope_key_cache")
                                                  if any(name in where for where in lies)}, lies


@pytest.mark.parametrize("recipe", RECIPES)
def test_run_json_matches_transformers_teacher_forced(cores, checkpoints, recipe: str) -> None:
    """What ``ignition run --logprobs 20 --prompt-logprobs 5 --json`` prints: greedy text, logprobs, top-20,
    prompt scores and ranks."""
    hf, (_, loaded) = checkpoints[recipe][1], cores(recipe)
    prompt = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(11)).tolist()  # 3 chunks
    (result,) = Engine(loaded).generate([Request(prompt, max_tokens=6, logprobs=20, prompt_logprobs=5,
                                                 ignore_eos=True)])
    out = json.loads(json.dumps(run_json(result, loaded.tokenizer)))
    assert "error" not in out
    tokens = [t["id"] for t in out["tokens"]]
    assert out["prompt_ids"] == prompt and len(tokens) == 6
    assert_generation_matches(hf, prompt, tokens, [t["logprob"] for t in out["tokens"]],
                              [[(a["id"], a["logprob"]) for a in t["top_logprobs"]] for t in out["tokens"]],
                              20, recipe)
    assert_prompt_entries_match(hf, prompt, out["prompt_logprobs"], 5, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_batched_decode_matches_transformers(cores, checkpoints, recipe: str) -> None:
    """Two requests share decode.c2 (routing and attention per lane), then one runs with a padded lane."""
    hf = checkpoints[recipe][1]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (length,), generator=generator).tolist() for length in (11, 5)]
    requests = [Request(prompt, max_tokens=steps, logprobs=20, ignore_eos=True) for prompt, steps in zip(prompts, (7, 3))]
    results = Engine(cores(recipe)[1]).generate(requests)
    for index, (prompt, result) in enumerate(zip(prompts, results)):
        assert result.error is None and len(result.token_ids) == requests[index].max_tokens
        assert_generation_matches(hf, prompt, result.token_ids, [e.logprob for e in result.entries],
                                  [e.top for e in result.entries], 20, f"{recipe} request {index}")


def test_deepseek_v3_reuses_prefixes_from_its_mla_pools(cores) -> None:
    """MLA's latent and rope key are pools of blocks (catalog/geometry.py ``PAGED_STATE``), so deepseek_v3 serves
    prefix hits: a cached request (with penalties, whose prompt counts the hit seeds) gets the tokens and logprobs it
    gets with prefix caching off, and a scored request beside it the same prompt logprobs, bit for bit."""
    from ignition.runtime.paging import prefix_reuse_refusal

    loaded = cores("deepseek_v3")[1]
    assert prefix_reuse_refusal(loaded) is None
    assert (loaded.kv_pool.num_blocks, loaded.kv_pool.block_size, loaded.kv_pool.capacity_tokens) == (8, 16, 112)
    shared = [(5 * j + 3) % 300 + 1 for j in range(37)]  # two full blocks of 16 and 5 tokens
    requests = [Request(shared, max_tokens=5, logprobs=2, ignore_eos=True),
                Request(shared + [9, 10, 11], max_tokens=5, logprobs=2, ignore_eos=True,
                sampling=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)),
                Request(shared + [7, 8], max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True)]
    cold_engine, warm_engine = Engine(loaded, prefix_caching=False), Engine(loaded)
    cold = [cold_engine.generate([r])[0] for r in requests]
    warm = [warm_engine.generate([r])[0] for r in requests]
    assert warm_engine.kv_cache_stats()["prefix_cache_hits"] == 2 * 16  # the second's; the scored one never looks
    for got, want in zip(warm, cold, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
        for a, b in zip(got.entries, want.entries, strict=True):
            assert a.id == b.id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) <= 2e-5  # FP32: the cached latents come from another chunk split
        assert got.prompt_entries == want.prompt_entries


def reference_cases(recipe: str, checkpoints, dtype: str = "float32"):
    directory, hf = checkpoints[recipe if dtype == "float32" else (recipe, dtype)]
    family = DECODER_FAMILIES[recipe]
    cfg = family.parse(read_config(directory), "config.json")
    return family, cfg, load_weights(open_checkpoint(directory), cfg, family.weight_map), hf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_decoder_logits_match_transformers(checkpoints, recipe: str, dtype: str) -> None:
    """Chunked prefill (junk padding ids) into scrambled slots, then batched decode with an inactive lane."""
    family, cfg, weights, hf = reference_cases(recipe, checkpoints, dtype)
    tolerance = dict(atol=TOL if dtype == "float32" else BF16_TOL, rtol=0)
    caches = {name: torch.zeros(shape, dtype=cfg.dtype) for name, shape in cfg.cache_shapes(4, 32).items()}
    generator = torch.Generator().manual_seed(2)
    lengths, slots, steps = [13, 5], [3, 0], 4
    sequences = [torch.randint(0, cfg.vocab_size, (n + steps,), generator=generator) for n in lengths]
    with torch.no_grad():
        references = [hf(sequence[None]).logits[0] for sequence in sequences]
        for sequence, length, slot, reference in zip(sequences, lengths, slots, references):
            for start in range(0, length, CHUNK):
                chunk = sequence[start:min(start + CHUNK, length)]
                padded = torch.cat([chunk, torch.full((CHUNK - chunk.shape[0],), -7)])
                rows = Rows.prefill(CHUNK, torch.tensor([start]), torch.tensor([chunk.shape[0]]), torch.tensor([slot]))
                logits = lm_head_logits(weights, cfg, family.decoder(weights, cfg, padded, rows, caches))
                torch.testing.assert_close(logits[:chunk.shape[0]], reference[start:start + chunk.shape[0]],
                                           **tolerance)
        for step in range(steps):
            positions = torch.tensor([n + step for n in lengths] + [lengths[0] + step])
            input_ids = torch.tensor([int(s[p]) for s, p in zip(sequences, positions)] + [5])
            rows = Rows.decode(positions, torch.tensor(slots + [slots[0]]), torch.tensor([True, True, False]))
            logits = lm_head_logits(weights, cfg, family.decoder(weights, cfg, input_ids, rows, caches))
            for lane, reference in enumerate(references):
                torch.testing.assert_close(logits[lane], reference[positions[lane]], **tolerance)


def test_deepseek_rope_and_attention_scale_match_transformers(checkpoints) -> None:
    """yarn with mscale != mscale_all_dim: cos/sin multiplier and the softmax scale both differ from 1."""
    _, cfg, _, hf = reference_cases("deepseek_v3", checkpoints)
    inv_freq, multiplier = rope_frequencies(cfg)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq)
    assert multiplier == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12) and multiplier != 1.0
    assert cfg.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert cfg.attention_scale != cfg.qk_head_dim ** -0.5
    assert cfg.moe_layers == (1, 2) and cfg.dense_mlp_layers == (0,)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_program_reader_reads_routed_experts_cond_branches(cores, recipe: str) -> None:
    """validate/program_reader.py on graphs with torch.cond branches (one graph module per branch): the same
    modules, nodes and runs as torch.export.load (tests/_program_oracle.py)."""
    from _program_oracle import assert_core_read_alike

    core, _ = cores(recipe)
    programs = assert_core_read_alike(core)
    assert sum(len(list(p.graph_module.named_children())) for p in programs.values()) >= 2
