"""The qwen3_5 recipe against transformers, on an examples/make_tiny_qwen3_5.py checkpoint.

Three Gated DeltaNet linear-attention layers and one gated full-attention layer. One core (decode capacity 2,
8-row chunks, --prompt-logprobs, --mixed, --speculative-tokens 2) is exported and loaded once. transformers' eager
model is the oracle: its incremental decode (prompt forward, then one token at a time on its cache) for generated
tokens, its full forward for prompt scores. The decoder and the delta-rule forms are also checked directly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
from typer.testing import CliRunner

from ignition.catalog.buffers import PACKED_TOKENS, SEGMENT_WINDOW
from ignition.catalog.hashing import dump_json
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.recipes.checkpoint import open_checkpoint, read_config
from ignition.recipes.layers import Rows
from ignition.recipes.llama import eos_token_id
from ignition.recipes.linear_attention import chunk_gated_delta_rule, recurrent_gated_delta_rule
from ignition.recipes.qwen3_5 import FAMILY, Qwen35Config, load_qwen3_5_weights
from ignition.recipes.registry import build_recipe
from ignition.recipes.transformer import lm_head_logits
from ignition.runtime.core import load_core
from ignition.runtime.requests import Request
from ignition.runtime.engine import Engine
from ignition.validate.core import validate_core
from _direct_calls_oracle import assert_direct_calls_dispatch_as_overloads

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen3_5.py"
CHUNK, MAX_SEQ_LEN, VOCAB = 8, 48, 320
# FP32: our logits differ from transformers' by reduction order only (chunked vs recurrent rule, fused attention);
# measured <= 6e-6 on logits. A wrong decay, gate or state write moves them by 1e-2 or more.
TOL = 1e-5
NEAR = 5e-5  # logprobs this close to a neighbour may swap ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint directory, transformers model), written once by the example script."""
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    directory = module.make_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "ckpt")
    return directory, AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def core(checkpoint, tmp_path_factory):
    """(exported core, loaded core): export validates it."""
    out = tmp_path_factory.mktemp("qwen3_5-core") / "core"
    export_core(ExportOptions(recipe="qwen3_5", checkpoint=checkpoint[0], capacities=(2,), chunk_limit=CHUNK,
                              max_seq_len=MAX_SEQ_LEN, prompt_logprobs=True, mixed=True, speculative_tokens=(2,)), out)
    return out, load_core(out, device="cpu")


def incremental(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """FP64 log-softmax rows of transformers' incremental decode: the prompt forward's last row, then one row per
    fed token (``tokens[:-1]``) on its cache: ``[len(tokens), vocab]``."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        rows, cache = [out.logits[0, -1]], out.past_key_values
        for token in tokens[:-1]:
            out = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
            cache = out.past_key_values
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


def assert_generation_matches(hf, prompt: list[int], result, k: int, where: str) -> None:
    """Greedy tokens, their logprobs and the top-k against transformers' incremental decode."""
    rows = incremental(hf, prompt, result.token_ids)
    for step, (token, entry) in enumerate(zip(result.token_ids, result.entries, strict=True)):
        row, at = rows[step], f"{where} step {step}"
        best = torch.topk(row, 2).values
        if float(best[0] - best[1]) > NEAR:
            assert token == int(row.argmax()), at
        assert abs(entry.logprob - float(row[token])) <= TOL, at
        values = torch.tensor([value for _, value in entry.top], dtype=torch.float64)
        assert len(entry.top) == k, at
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(values, row[[token_id for token_id, _ in entry.top]], atol=TOL, rtol=0)


def test_core_declares_linear_and_full_state(core) -> None:
    """The layer kinds, the linear layers' two states and the full layer's KV, and the memory report per kind."""
    out, _ = core
    manifest = json.loads((out / "manifest.json").read_text())
    model = manifest["model"]
    assert model["layer_kinds"] == ["linear", "linear", "linear", "full"]
    assert (model["linear_conv_dim"], model["linear_conv_kernel"], model["linear_heads"], model["linear_key_dim"],
            model["linear_value_dim"]) == (2 * 2 * 16 + 4 * 8, 4, 4, 16, 8)
    assert {s["name"]: s["dtype"] for s in manifest["state"]}["recurrent_state"] == "float32"
    assert {s["name"]: s["shape"] for s in manifest["state"]} == {
        # the full layer's pools: 2 slots x ceil(MAX_SEQ_LEN / 16) blocks of 16 positions
        "k_cache": [1, 2 * -(-MAX_SEQ_LEN // 16), 16, 2, 16], "v_cache": [1, 2 * -(-MAX_SEQ_LEN // 16), 16, 2, 16],
        "conv_state": [3, 2, 96, 3],
        "recurrent_state": [3, 2, 4, 16, 8], "penalty_counts": [2, 2, VOCAB]}
    inspected = CliRunner().invoke(app, ["inspect-core", str(out), "--memory", "--json"])
    assert inspected.exit_code == 0, inspected.output
    memory = json.loads(inspected.output)["memory"]
    assert memory["kv_bytes_per_token"] == 2 * 2 * 16 * 4  # the one full layer's K and V
    kinds = {kind: row["state_bytes"] for kind, row in json.loads(inspected.output)["cache_kinds"].items()}
    assert kinds == {"linear": 3 * 2 * (96 * 3 + 4 * 16 * 8) * 4,
                     "full": 2 * 2 * -(-MAX_SEQ_LEN // 16) * 16 * 2 * 16 * 4}


def test_kv_bytes_per_token_counts_no_linear_state() -> None:
    """A conv state whose conv_dim equals max_seq_len is still per slot, not per token."""
    from ignition.catalog.inspect import kv_bytes_per_token
    state = [{"name": "k_cache", "dtype": "float32", "shape": [1, 12, 16, 2, 16], "role": "state"},
             {"name": "conv_state", "dtype": "float32", "shape": [3, 2, 96, 3], "role": "state"}]
    model = {"num_slots": 2, "max_seq_len": 96, "kv_blocks": 12, "block_size": 16}
    assert kv_bytes_per_token({"model": model, "state": state}) == 2 * 16 * 4


@pytest.mark.parametrize("field, value, rule", [
    ("linear_heads", 8, "GEOM-MODEL"), ("linear_conv_kernel", 5, "GEOM-MODEL"),
    ("layer_kinds", ["linear", "full", "full", "full"], "GEOM-KIND-BUFFERS"),
    ("recurrent_state", "bfloat16", "GEOM-MODEL")])
def test_validator_checks_the_linear_state(core, tmp_path, field: str, value, rule: str) -> None:
    """A manifest whose linear geometry, layer kinds or recurrent-state dtype lie about the state is refused, naming
    the rule."""
    out = tmp_path / "core"
    shutil.copytree(core[0], out)
    manifest = json.loads((out / "manifest.json").read_text())
    if field == "recurrent_state":
        next(decl for decl in manifest["state"] if decl["name"] == field)["dtype"] = value
    else:
        manifest["model"][field] = value
    (out / "manifest.json").write_bytes(dump_json(manifest))
    report = validate_core(out, check_graphs=False)
    assert any(v.rule == rule for v in report.violations), report.violations


def test_generation_and_prompt_scores_match_transformers(core, checkpoint) -> None:
    """A 19-token prompt in three chunks (8, 8, 3), then 12 greedy tokens with K=20 and 5 prompt alternatives."""
    hf, (_, loaded) = checkpoint[1], core
    prompt = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(11)).tolist()
    (result,) = Engine(loaded).generate([Request(prompt, max_tokens=12, logprobs=20, prompt_logprobs=5,
                                                 ignore_eos=True)])
    assert result.error is None and len(result.token_ids) == 12
    assert_generation_matches(hf, prompt, result, 20, "generation")
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
    entries = result.prompt_entries
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = entries[position], rows[position - 1]
        assert entry["id"] == prompt[position], position
        assert abs(entry["logprob"] - float(row[prompt[position]])) <= TOL, position
        values = torch.tensor([top["logprob"] for top in entry["top_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(values, torch.sort(row, descending=True).values[:5], atol=TOL, rtol=0)


def test_batched_mixed_and_reused_slots_match_transformers(core, checkpoint) -> None:
    """Three requests on two slots: two decode together; the third is admitted into a finished request's slot
    (its states restart at position 0) while the other decodes (a mixed round)."""
    hf, (_, loaded) = checkpoint[1], core
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (11, 5, 13)]
    requests = [Request(p, max_tokens=n, logprobs=20, ignore_eos=True) for p, n in zip(prompts, (14, 3, 6))]
    engine = Engine(loaded)
    results = engine.generate(requests)
    assert engine.stats["mixed_rounds"] > 0
    for index, (prompt, result) in enumerate(zip(prompts, results)):
        assert result.error is None and len(result.token_ids) == requests[index].max_tokens
        assert_generation_matches(hf, prompt, result, 20, f"request {index}")


def test_batch_invariant_requests_are_bit_identical_to_alone(core) -> None:
    """--batch-invariant: a request's tokens and logprobs do not depend on its co-batching, its slot or whether its
    prompt ran in a prefill or a mixed round (each lane's states are its own)."""
    loaded = core[1]
    requests = [Request(list(range(3 + 5 * i, 12 + 7 * i)), max_tokens=5 + i, logprobs=5, ignore_eos=True)
                for i in range(3)]
    together = Engine(loaded, batch_invariant=True).generate(requests)
    for request, shared in zip(requests, together):
        (alone,) = Engine(loaded, batch_invariant=True).generate([request])
        assert shared.error is None and shared.token_ids == alone.token_ids
        assert [(e.logprob, e.top) for e in shared.entries] == [(e.logprob, e.top) for e in alone.entries]


def test_speculative_verify_keeps_the_accepted_rows_state(core, checkpoint) -> None:
    """Prompt-lookup drafts through verify.s2.c2: accepted and rejected proposals, each lane's recurrent and conv
    states rolled back to its last accepted row. Greedy tokens, logprobs and K=20 alternatives equal plain decoding's
    and match transformers' incremental decode."""
    from ignition.runtime.drafters import NgramDrafter
    hf, loaded = checkpoint[1], core[1]
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [(5 * i + 1) % VOCAB for i in range(13)]]
    requests = [Request(prompt, max_tokens=16, logprobs=20, ignore_eos=True) for prompt in prompts]
    plain = Engine(loaded, mixed=False).generate(requests)
    engine = Engine(loaded, drafter=NgramDrafter(), draft_tokens=2, mixed=False)
    speculated = engine.generate(requests)
    assert 0 < engine.stats["accepted"] < engine.stats["proposed"], engine.stats  # both paths of the rollback
    for index, (prompt, ours, base) in enumerate(zip(prompts, speculated, plain)):
        assert ours.error is None and ours.token_ids == base.token_ids
        for entry, reference in zip(ours.entries, base.entries, strict=True):
            assert abs(entry.logprob - reference.logprob) <= TOL
        assert_generation_matches(hf, prompt, ours, 20, f"speculative request {index}")


def test_decoder_logits_match_transformers(checkpoint) -> None:
    """The decoder alone: chunked prefill (junk padding ids) into scrambled slots, then batched decode with an
    inactive lane whose slot holds another sequence's state; against transformers' full forward."""
    directory, hf = checkpoint
    cfg = FAMILY.parse(read_config(directory), "config.json")
    weights = load_qwen3_5_weights(open_checkpoint(directory), read_config(directory), cfg, torch.float32)
    caches = {name: torch.zeros(shape) for name, shape in cfg.cache_shapes(4, 32).items()}
    generator = torch.Generator().manual_seed(2)
    lengths, slots, steps = [13, 5], [3, 0], 4
    sequences = [torch.randint(0, VOCAB, (n + steps,), generator=generator) for n in lengths]
    with torch.no_grad():
        references = [hf(sequence[None]).logits[0] for sequence in sequences]
        for sequence, length, slot, reference in zip(sequences, lengths, slots, references):
            for start in range(0, length, CHUNK):
                chunk = sequence[start:min(start + CHUNK, length)]
                padded = torch.cat([chunk, torch.full((CHUNK - chunk.shape[0],), -7)])
                rows = Rows.prefill(CHUNK, torch.tensor([start]), torch.tensor([chunk.shape[0]]), torch.tensor([slot]))
                logits = lm_head_logits(weights, cfg, FAMILY.decoder(weights, cfg, padded, rows, caches))
                torch.testing.assert_close(logits[:chunk.shape[0]], reference[start:start + chunk.shape[0]],
                                           atol=TOL, rtol=0)
        for step in range(steps):
            positions = torch.tensor([n + step for n in lengths] + [0])
            input_ids = torch.tensor([int(s[p]) for s, p in zip(sequences, positions)] + [5])
            rows = Rows.decode(positions, torch.tensor(slots + [slots[0]]), torch.tensor([True, True, False]))
            logits = lm_head_logits(weights, cfg, FAMILY.decoder(weights, cfg, input_ids, rows, caches))
            for lane, reference in enumerate(references):
                torch.testing.assert_close(logits[lane], reference[positions[lane]], atol=TOL, rtol=0)


def test_bfloat16_decoder_is_transformers_bit_for_bit(checkpoint) -> None:
    """BF16 weights, the recurrent state in FP32 (as transformers keeps it): a prompt forward, then 20 decode steps
    on transformers' cache, against its BF16 incremental decode. Measured bit-identical on CPU; the tolerance is one
    BF16 step at |logit| < 8 (a BF16 recurrent state moved a logit by 0.125 within 28 steps)."""
    directory = checkpoint[0]
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.bfloat16).eval()
    cfg = FAMILY.parse(read_config(directory), "config.json")
    weights = load_qwen3_5_weights(open_checkpoint(directory), read_config(directory), cfg, torch.bfloat16)
    shapes = cfg.cache_shapes(2, MAX_SEQ_LEN)
    caches = {name: torch.zeros(shape, dtype=torch.float32 if name == "recurrent_state" else torch.bfloat16)
              for name, shape in shapes.items()}
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    tolerance = dict(atol=2 ** -5, rtol=0)
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
        rows = Rows.prefill(16, torch.tensor([0]), torch.tensor([12]), torch.tensor([1]))
        hidden = FAMILY.decoder(weights, cfg, torch.cat([prompt, torch.zeros(4, dtype=torch.long)]), rows, caches)
        torch.testing.assert_close(lm_head_logits(weights, cfg, hidden)[:12], out.logits[0], **tolerance)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for position in range(12, 32):
            out = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            rows = Rows.decode(torch.tensor([position]), torch.tensor([1]), torch.tensor([True]))
            hidden = FAMILY.decoder(weights, cfg, torch.tensor([token]), rows, caches)
            torch.testing.assert_close(lm_head_logits(weights, cfg, hidden)[0], out.logits[0, -1], **tolerance)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_delta_rule_forms_agree_with_transformers() -> None:
    """The chunked rule (blocks of 4 over 10 rows, from a non-zero state) against the recurrent one and against
    transformers' ``torch_chunk_gated_delta_rule``; grouped heads (2 key heads, 4 value heads)."""
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(2, 10, 2, 16, generator=generator) for _ in range(2))
    value = torch.randn(2, 10, 4, 8, generator=generator)
    decay = -torch.rand(2, 10, 4, generator=generator)
    beta = torch.rand(2, 10, 4, generator=generator)
    state = torch.randn(2, 4, 16, 8, generator=generator)
    chunked, chunk_state = chunk_gated_delta_rule(query, key, value, decay, beta, state, chunk_rows=4)
    stepped, step_state = recurrent_gated_delta_rule(query, key, value, decay, beta, state)
    theirs, their_state = torch_chunk_gated_delta_rule(query, key, value, decay, beta, initial_state=state,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    pairs = ((chunked, stepped), (chunk_state, step_state), (chunked, theirs), (chunk_state, their_state))
    for ours, reference in pairs:
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    assert float((chunk_state - state).abs().max()) > 0.1  # the rows moved the state


def test_multimodal_checkpoint_exports_its_text_model(checkpoint, tmp_path, caplog) -> None:
    """A Qwen3_5ForConditionalGeneration checkpoint: text_config and model.language_model.* are read, the vision
    tower and MTP head skipped, with one log line."""
    directory, _ = checkpoint
    text = read_config(directory)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": True,
              "text_config": {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")},
              "vision_config": {"depth": 1}}
    tensors = {name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in load_file(directory / "model.safetensors").items()}
    tensors |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps(config))
    save_file(tensors, multimodal / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="ignition.recipes.qwen3_5"):
        cfg = Qwen35Config.from_hf_config(read_config(multimodal), "config.json")
    assert sum("text model" in record.getMessage() for record in caplog.records) == 1
    assert cfg == FAMILY.parse(text, "config.json")
    assert eos_token_id(read_config(multimodal), cfg, multimodal) == text["eos_token_id"]
    ours = load_qwen3_5_weights(open_checkpoint(multimodal), read_config(multimodal), cfg, torch.float32)
    theirs = load_qwen3_5_weights(open_checkpoint(directory), text, cfg, torch.float32)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_linear_attention_core_is_refused_as_a_draft_core(core) -> None:
    """A draft core rewinds to the prefix a new context shares with the old one; a recurrent state cannot."""
    from ignition.runtime.drafters import SpeculativeError, check_draft_core
    with pytest.raises(SpeculativeError, match="linear layers keep a state that summarises"):
        check_draft_core(core[1], core[1])


@pytest.mark.parametrize("option, words", [(dict(onnx=True), "aten.linalg_solve_triangular"),
                                           (dict(tensor_parallel=2), "no sharded layout")])
def test_unbuilt_options_are_refused_by_name(checkpoint, option: dict, words: str) -> None:
    with pytest.raises(RecipeError, match=words):
        build_recipe(ExportOptions(recipe="qwen3_5", checkpoint=checkpoint[0], capacities=(2,), **option))


def test_packed_prompt_chunks_match_transformers_and_the_serial_rounds(core, checkpoint) -> None:
    """The packed prefill (``packed.t8.c2``): two prompts' chunks a submission, each lane's linear layers one group
    from its own slot's conv and recurrent states (``packed_lanes``), crossing chunk boundaries and ending at
    different rows; transformers' tokens and K=20 logprobs, and the serial rounds' values bit for bit."""
    hf, (path, loaded) = checkpoint[1], core
    catalog = json.loads((path / "catalog.json").read_text())
    (packed,) = [v for v in catalog["variants"] if v["name"].startswith("packed.")]
    assert packed["name"] == f"packed.t{CHUNK}.c2"
    assert {PACKED_TOKENS, SEGMENT_WINDOW} <= set(packed["contract"]["layout"]["windows"])  # dynamic rows
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (19, 13)]
    requests = [Request(p, max_tokens=6, logprobs=20, ignore_eos=True) for p in prompts]
    engine = Engine(loaded, mixed=False)
    results = engine.generate(requests)
    assert engine.stats["packed_rounds"] == 2  # 8 + 8 rows, then 8 + 5; the first prompt's last 3 rows alone
    serial = Engine(loaded, mixed=False, packed=False).generate(requests)
    for index, (prompt, result, alone) in enumerate(zip(prompts, results, serial)):
        assert result.error is None and result.token_ids == alone.token_ids
        assert_generation_matches(hf, prompt, result, 20, f"packed request {index}")
        assert [(e.logprob, e.top) for e in result.entries] == [(e.logprob, e.top) for e in alone.entries]


@pytest.mark.parametrize("lane_rows, other_rows, chunk_rows, segment_rows, packed_rows",
                         [(3, 20, 16, 32, 32), (50, 100, 64, 112, 160)])
def test_packed_lanes_are_their_prefill_chunk_bit_for_bit(checkpoint, lane_rows: int, other_rows: int,
                                                          chunk_rows: int, segment_rows: int, packed_rows: int) -> None:
    """A lane packed after a longer one (``packed_lanes``: all lanes' conv and rule in one call, over the segment
    window's extent, wider than the lane's own chunk extent) writes the states and hidden rows of its chunk alone,
    bit for bit, from non-zero states (the packed prefill's contract with the serial rounds)."""
    directory = checkpoint[0]
    cfg = FAMILY.parse(read_config(directory), "config.json")
    weights = load_qwen3_5_weights(open_checkpoint(directory), read_config(directory), cfg, torch.float32)
    generator = torch.Generator().manual_seed(3)
    start = {name: torch.randn(shape, generator=generator) for name, shape in cfg.cache_shapes(3, 192).items()}
    ids = torch.randint(0, VOCAB, (lane_rows,), generator=generator)
    alone = {name: state.clone() for name, state in start.items()}
    chunk = Rows.prefill(chunk_rows, torch.tensor(16), torch.tensor(lane_rows), torch.tensor([1]))
    hidden = FAMILY.decoder(weights, cfg, torch.cat([ids, ids.new_zeros(chunk_rows - lane_rows)]), chunk, alone)
    packed = {name: state.clone() for name, state in start.items()}
    packed_ids = torch.cat([torch.randint(0, VOCAB, (other_rows,), generator=generator), ids,
                            ids.new_zeros(packed_rows - other_rows - lane_rows)])
    rows = Rows.packed(packed_rows, torch.tensor([0, 16]), torch.tensor([other_rows, lane_rows]),
                       torch.tensor([2, 1]), torch.zeros(segment_rows, dtype=torch.int64))
    packed_hidden = FAMILY.decoder(weights, cfg, packed_ids, rows, packed)
    assert torch.equal(hidden[:lane_rows], packed_hidden[other_rows:other_rows + lane_rows])
    for name in ("conv_state", "recurrent_state"):
        assert torch.equal(alone[name][:, 1], packed[name][:, 1]), name
        assert not torch.equal(packed[name][:, 1], start[name][:, 1]), name  # the chunk moved the state


def test_the_graphs_call_bindings_that_dispatch_as_their_overloads(core):
    """The loader's rewrite onto torch's Python bindings (runtime/backends/direct_calls.py) keeps every operator
    call and every bit of each variant."""
    _, core = core
    Engine(core).generate([Request([3, 1, 4, 1, 5, 9, 2, 6], max_tokens=3, logprobs=2, ignore_eos=True)])
    assert assert_direct_calls_dispatch_as_overloads(core) > 0
