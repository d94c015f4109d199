"""DeepSeek V4's multi-token-prediction layer (recipes/deepseek_v4_mtp.py) on a tiny random checkpoint with one
MTP layer (examples/make_tiny_deepseek_v4.py ``mtp_layers=1``: a sliding-window block of window 8, top-k MoE).

The oracle: transformers builds no MTP layer, so the test builds DeepSeek's reference ``MTPBlock.forward`` from
the checkpoint's tensors: the block is transformers' own ``DeepseekV4DecoderLayer`` (a transformers model with
one more layer, loaded with the ``mtp.0.*`` block tensors), around it the reference's prologue
(``e_proj(enorm(embed)) + h_proj(hnorm(h))``) and its head (``hc_head``, ``norm``, the shared head) in plain torch,
run as full forwards over the whole row sequence; the target's streams come from a hook on the decoder's last
layer. FP32 throughout, compared within 1e-5.

- (b) the draft is correct: the MTP rows over a prompt, greedy proposals chained 3 steps from its own streams,
  and the rows that then consume the target's streams for the drafted positions (rewriting what the proposals
  wrote) all equal the oracle's.
- (a) greedy speculative decoding with MTP proposals gives plain decoding's tokens and logprobs (the target's
  alone). (c) Acceptance: with random weights the MTP layer never learnt to agree with the target, so its rate
  carries no meaning; the rounds here reject, and the loop is checked on that path and on a proposer that agrees.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ignition.recipes.checkpoint import CheckpointError, TensorInfo, open_checkpoint, read_config
from ignition.recipes.deepseek_v4 import DeepseekV4Config, read_checkpoint
from ignition.recipes.deepseek_v4_model import allocate_state, collapse_streams, deepseek_v4_streams
from ignition.recipes.deepseek_v4_mtp import MTP_WEIGHTS, MtpDraft, allocate_mtp_state, load_mtp_weights, mtp_step

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
make_tiny = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_tiny)

MAX_SEQ, CHUNK, PROMPT, FOLLOW, DRAFTS = 96, 16, 29, 4, 3
TOLERANCE = 1e-5


def _oracle_checkpoint(path: Path, out: Path, layers: int) -> Path:
    """``path`` with its MTP block as transformers' decoder layer ``layers`` (its own tensors left out)."""
    out.mkdir()
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers + 1, layer_types=config["layer_types"] + [make_tiny.MTP_LAYER_TYPE],
                  mlp_layer_types=config["mlp_layer_types"] + [make_tiny.MTP_MLP_TYPE], num_nextn_predict_layers=0)
    config.pop("compress_ratios")
    (out / "config.json").write_text(json.dumps(config))
    own = {f"mtp.0.{weight.name}" for weight in MTP_WEIGHTS}
    tensors = {(f"model.layers.{layers}." + name.removeprefix("mtp.0.") if name.startswith("mtp.0.") else name): t
               for name, t in load_file(path / "model.safetensors").items() if name not in own}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4_mtp")
    path = make_tiny.make_checkpoint(root / "tiny", mtp_layers=1)
    checkpoint = open_checkpoint(path)
    cfg, weights = read_checkpoint(checkpoint, read_config(path))
    weights |= load_mtp_weights(checkpoint, cfg)
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(
        _oracle_checkpoint(path, root / "oracle", cfg.num_layers), dtype=torch.float32).eval()
    prompt = torch.randint(1, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0))
    return path, cfg, weights, oracle, prompt


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (1.0 if weight is None else weight)


def _oracle_streams(oracle, cfg, ids):
    """The decoder's last-layer streams ``[L, n, hidden]`` over ``ids`` (a hook on transformers' layer)."""
    captured = []
    handle = oracle.model.layers[cfg.num_layers - 1].register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        oracle(ids[None])
    handle.remove()
    return captured[0][0]


def _oracle_mtp(oracle, cfg, weights, streams, next_ids):
    """DeepSeek's ``MTPBlock.forward`` over rows ``0 .. L-1`` as one full forward: logprobs ``[L, vocab]`` and the
    block's output streams ``[L, n, hidden]``."""
    model, eps = oracle.model, cfg.rms_norm_eps
    embedded = _rms(model.embed_tokens(next_ids), weights["mtp.0.enorm"], eps)
    x = (embedded @ weights["mtp.0.e_proj"].T)[:, None] \
        + _rms(streams, weights["mtp.0.hnorm"], eps) @ weights["mtp.0.h_proj"].T
    positions = torch.arange(next_ids.shape[0])[None]
    rope = {kind: model.rotary_emb(embedded[None], position_ids=positions, layer_type=kind)
            for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=embedded[None], attention_mask=None,
                                             cache=None, position_ids=positions)
    with torch.no_grad():
        out = model.layers[cfg.num_layers](x[None], position_embeddings=rope, position_ids=positions,
                                           attention_mask=mask, input_ids=next_ids[None], cache=None)[0]
    mixes = _rms(out.flatten(1), None, eps) @ weights["mtp.0.hc_head_fn"].T
    pre = torch.sigmoid(mixes * weights["mtp.0.hc_head_scale"] + weights["mtp.0.hc_head_base"]) + cfg.hc_eps
    hidden = _rms((pre[..., None] * out).sum(1), weights["mtp.0.final_norm"], eps)
    return (hidden @ weights["head"].T).log_softmax(-1), out


def _logprobs(weights, hidden):
    return (hidden @ weights["head"].T).float().log_softmax(-1)


def _streams(cfg, weights, ids):
    """Our target's streams over ``ids`` in ``CHUNK``-row steps."""
    state = allocate_state(cfg, 1, MAX_SEQ, CHUNK)
    return torch.cat([deepseek_v4_streams(weights, cfg, ids[start:start + CHUNK], start, 0, state)
                      for start in range(0, ids.shape[0], CHUNK)])


def _greedy(cfg, weights, prompt, new_tokens):
    """Plain greedy decoding: the prompt in chunks, then one row a step; (tokens, each token's logprobs row)."""
    state = allocate_state(cfg, 1, MAX_SEQ, CHUNK)
    for start in range(0, prompt.shape[0], CHUNK):
        streams = deepseek_v4_streams(weights, cfg, prompt[start:start + CHUNK], start, 0, state)
    rows = [_logprobs(weights, collapse_streams(weights, cfg, streams[-1:]))[0]]
    tokens = [int(rows[-1].argmax())]
    for position in range(prompt.shape[0], prompt.shape[0] + new_tokens - 1):
        streams = deepseek_v4_streams(weights, cfg, torch.tensor(tokens[-1:]), position, 0, state)
        rows.append(_logprobs(weights, collapse_streams(weights, cfg, streams))[0])
        tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


def test_mtp_rows_and_proposals_match_the_reference_forward(tiny):
    _, cfg, weights, oracle, prompt = tiny
    follow, _ = _greedy(cfg, weights, prompt, FOLLOW)
    tokens = torch.cat([prompt, torch.tensor(follow)])  # t_0 .. t_{L-1}
    ours_streams = _streams(cfg, weights, tokens[:-1])  # rows 0 .. L-2 read the token after them
    oracle_streams = _oracle_streams(oracle, cfg, tokens[:-1])
    torch.testing.assert_close(ours_streams, oracle_streams, atol=TOLERANCE, rtol=0)
    expected, _ = _oracle_mtp(oracle, cfg, weights, oracle_streams, tokens[1:])

    draft = MtpDraft(weights, cfg, MAX_SEQ, CHUNK)
    ends = [min(start + CHUNK, PROMPT) for start in range(0, PROMPT, CHUNK)]
    rows = [draft.consume(ours_streams[start:end], tokens[start + 1:end + 1])
            for start, end in zip(range(0, PROMPT, CHUNK), ends)]
    torch.testing.assert_close(_logprobs(weights, torch.cat(rows)), expected[:PROMPT], atol=TOLERANCE, rtol=0)

    proposals, hidden = draft.draft(DRAFTS)  # chained from the layer's own streams
    chain_streams, chain_ids, reference = oracle_streams[:PROMPT], tokens[1:PROMPT + 1], []
    for _ in range(DRAFTS):
        logprobs, out = _oracle_mtp(oracle, cfg, weights, chain_streams, chain_ids)
        reference.append(logprobs[-1])
        chain_streams = torch.cat([chain_streams, out[-1:]])
        chain_ids = torch.cat([chain_ids, logprobs[-1].argmax().view(1)])
    assert proposals == chain_ids[PROMPT:].tolist()
    torch.testing.assert_close(_logprobs(weights, hidden), torch.stack(reference), atol=TOLERANCE, rtol=0)

    # the target's streams for the drafted positions: the proposals' cells are rewritten before they are read
    later = draft.consume(ours_streams[PROMPT:], tokens[PROMPT + 1:])
    torch.testing.assert_close(_logprobs(weights, later), expected[PROMPT:], atol=TOLERANCE, rtol=0)


def _speculative(cfg, weights, prompt, new_tokens, draft_tokens, agreeing=None):
    """Greedy speculative decoding on the step forward: each round the target runs its last token and the
    proposals as one step, keeps the proposals its own greedy choice confirms plus its correction or bonus token,
    and the MTP layer consumes the verified rows' streams. ``agreeing``: the tokens to propose instead of the MTP
    layer's (which still drafts, writing its state). (tokens, logprobs rows, accepted, proposed, the MTP layer's
    hidden of every consumed row)."""
    state = allocate_state(cfg, 1, MAX_SEQ, CHUNK)
    draft = MtpDraft(weights, cfg, MAX_SEQ, CHUNK)
    chunks = [(start, prompt[start:start + CHUNK]) for start in range(0, prompt.shape[0], CHUNK)]
    streams = torch.cat([deepseek_v4_streams(weights, cfg, ids, start, 0, state) for start, ids in chunks])
    rows = [_logprobs(weights, collapse_streams(weights, cfg, streams[-1:]))[0]]
    tokens, accepted, proposed, consumed = [int(rows[-1].argmax())], 0, 0, []
    pending = streams, prompt[1:].tolist() + tokens  # the rows the MTP layer has not consumed, and their next ids
    while len(tokens) < new_tokens:
        for start in range(0, pending[0].shape[0], CHUNK):
            consumed.append(draft.consume(pending[0][start:start + CHUNK], pending[1][start:start + CHUNK]))
        limit = min(draft_tokens, new_tokens - len(tokens) - 1)
        proposals = draft.propose(limit) if limit else []
        if agreeing is not None:
            proposals = agreeing[len(tokens):len(tokens) + limit]
        position = prompt.shape[0] + len(tokens) - 1
        streams = deepseek_v4_streams(weights, cfg, torch.tensor(tokens[-1:] + proposals), position, 0, state)
        verified = _logprobs(weights, collapse_streams(weights, cfg, streams))
        kept = 0
        while kept < len(proposals) and int(verified[kept].argmax()) == proposals[kept]:
            kept += 1
        accepted, proposed = accepted + kept, proposed + len(proposals)
        emitted = proposals[:kept] + [int(verified[kept].argmax())]
        rows += list(verified[:kept + 1])
        tokens += emitted
        pending = streams[:kept + 1], emitted
    return tokens, torch.stack(rows), accepted, proposed, torch.cat(consumed)


NEW_TOKENS = 9


def test_mtp_speculation_gives_plain_decoding_tokens_and_logprobs(tiny):
    _, cfg, weights, _, prompt = tiny
    plain_tokens, plain_rows = _greedy(cfg, weights, prompt, NEW_TOKENS)
    tokens, rows, accepted, proposed, _ = _speculative(cfg, weights, prompt, NEW_TOKENS, DRAFTS)
    assert proposed >= NEW_TOKENS // 2 and accepted <= proposed
    assert tokens == plain_tokens
    torch.testing.assert_close(rows, plain_rows, atol=TOLERANCE, rtol=0)

    # proposals that agree (plain decoding's own tokens): every one is accepted, the MTP layer consumes several
    # verified rows at a time over cells its own proposals wrote, and reads what one straight pass over the
    # target's streams reads
    tokens, rows, accepted, proposed, consumed = _speculative(cfg, weights, prompt, NEW_TOKENS, DRAFTS, plain_tokens)
    assert tokens == plain_tokens and accepted == proposed == NEW_TOKENS - 1 - (NEW_TOKENS - 1) // (DRAFTS + 1)
    torch.testing.assert_close(rows, plain_rows, atol=TOLERANCE, rtol=0)
    sequence = torch.cat([prompt, torch.tensor(plain_tokens)])
    straight = MtpDraft(weights, cfg, MAX_SEQ, CHUNK)
    streams = _streams(cfg, weights, sequence[:consumed.shape[0]])
    count = consumed.shape[0]
    ends = [min(start + CHUNK, count) for start in range(0, count, CHUNK)]
    expected = torch.cat([straight.consume(streams[start:end], sequence[start + 1:end + 1])
                          for start, end in zip(range(0, count, CHUNK), ends)])
    torch.testing.assert_close(consumed, expected, atol=TOLERANCE, rtol=0)


def test_mtp_config_weights_and_step_refusals(tiny):
    path, cfg, weights, _, _ = tiny
    config = read_config(path)
    assert cfg.mtp_layers == 1 and cfg.mtp_kinds == ("shared_window",)
    release = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types")}
    for ratios in (config["compress_ratios"], config["compress_ratios"] + [0, 4]):  # V4-Flash-0731 lists 2 more
        parsed = DeepseekV4Config.from_hf_config({**release, "compress_ratios": ratios})
        assert (parsed.layer_kinds, parsed.mtp_kinds) == (cfg.layer_kinds, ("shared_window",))
    short = {**config, "compress_ratios": config["compress_ratios"][:cfg.num_layers]}
    bare = DeepseekV4Config.from_hf_config(short)
    assert bare.mtp_layers == 1 and bare.mtp_kinds is None
    with pytest.raises(CheckpointError, match="'layer_types' or 'compress_ratios' must list 5 entries"):
        load_mtp_weights(open_checkpoint(path), bare)
    with pytest.raises(CheckpointError, match="no multi-token-prediction layers"):
        load_mtp_weights(open_checkpoint(path), replace(cfg, mtp_layers=0, mtp_kinds=None))
    checkpoint, name = open_checkpoint(path), "mtp.0.e_proj.weight"
    info = checkpoint.info(name)
    misshapen = replace(checkpoint, tensors={**checkpoint.tensors, name: TensorInfo(info.file, info.dtype, (3, 3))})
    with pytest.raises(CheckpointError, match=r"MTP tensor 'mtp.0.e_proj.weight' must have shape \[64, 64\]; found \[3, 3\]"):
        load_mtp_weights(misshapen, cfg)
    missing = replace(checkpoint, tensors={k: v for k, v in checkpoint.tensors.items() if k != name})
    with pytest.raises(CheckpointError, match="declares 1 MTP layer.*tensor 'mtp.0.e_proj.weight' is required"):
        load_mtp_weights(missing, cfg)
    with pytest.raises(CheckpointError, match="'layer_types' must be among"):
        DeepseekV4Config.from_hf_config({**config, "compress_ratios": config["compress_ratios"][:-1] + [7]})
    state = allocate_mtp_state(cfg, 1, MAX_SEQ, CHUNK)
    with pytest.raises(ValueError, match=r"streams must be \[2 rows, 2, 64\] for 2 next ids; found \[3, 2, 64\]"):
        mtp_step(weights, cfg, torch.zeros(3, 2, 64), torch.tensor([1, 2]), 0, 0, state)
    with pytest.raises(ValueError, match="layer 1 must be below the checkpoint's 1 MTP layer"):
        mtp_step(weights, cfg, torch.zeros(2, 2, 64), torch.tensor([1, 2]), 0, 0, state, layer=1)
    with pytest.raises(ValueError, match="buffer 'swa_kv_cache' must be"):  # more rows than the ring is sized for
        mtp_step(weights, cfg, torch.zeros(CHUNK + 1, 2, 64), torch.ones(CHUNK + 1, dtype=torch.long), CHUNK, 0, state)
    with pytest.raises(ValueError, match="consume the target's streams before proposing"):
        MtpDraft(weights, cfg, MAX_SEQ, CHUNK).propose(2)
