"""DeepSeek V4's multi-token-prediction (MTP) layers: their config, weight table and forward, and the greedy
draft they propose for speculative decoding.

transformers builds no MTP layer (it drops the ``mtp.*`` tensors on load); DeepSeek's release reference
(``inference/model.py`` ``MTPBlock``) runs MTP layer ``k`` as the decoder's block number ``num_layers + k``. For
the row at position ``i`` it reads the target's last-layer streams ``h_i [hc_mult, hidden]`` (before the head's
collapse) and the embedding of the token at ``i + 1``::

    x = e_proj(enorm(embed(t[i+1]))) + h_proj(hnorm(h_i))    # the embedding's row added to every stream
    x = Block(x)                                              # attention of its own kind and state, then MoE
    logits = head(norm(hc_head(x)))                           # its own hc_head and norm, the decoder's head

and its logits predict the token at ``i + 2``; ``embed`` and ``head`` are the decoder's. The layer's attention
kind is its entry past the decoder's layers in the config's per-layer list (``layer_types``, or the release's
``compress_ratios``: DeepSeek-V4-Flash lists 44 ratios for 43 layers, its MTP layer's 0, a sliding window). Its
MoE routes by top-k with its correction bias (the reference hashes only layers below ``num_hash_layers``).

A draft (``MtpDraft``, the MTP proposer rule of vLLM and SGLang): the layer first consumes every position the
target has verified since its last call (the target's streams and the tokens that follow), so its state holds
the target's streams at every position a later row reads; its last row proposes ``d_1``, and each further token
feeds the layer's own output streams and the token it just proposed at the next position. A state cell a
proposal wrote is rewritten by the target's streams for that position before any later row reads it (the rings
and tables are indexed by position, ``deepseek_v4_attention``), so a rejected proposal needs no rollback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from ignition.recipes.checkpoint import Checkpoint, CheckpointError
from ignition.recipes.deepseek_v4 import LAYER_WEIGHTS, DeepseekV4Config, LayerWeight, extents, holds
from ignition.recipes.deepseek_v4_attention import rms_norm
from ignition.recipes.deepseek_v4_model import (allocate_state, attention, block, check_step, collapse_streams,
                                                layer_state)

MTP_PREFIX = "mtp.{k}."
"""Checkpoint prefix of MTP layer ``k``'s tensors (DeepSeek's release names; transformers writes none)."""

MTP_WEIGHTS: tuple[LayerWeight, ...] = (
    LayerWeight("e_proj.weight", "e_proj", ("hidden_size", "hidden_size")),
    LayerWeight("h_proj.weight", "h_proj", ("hidden_size", "hidden_size")),
    LayerWeight("enorm.weight", "enorm", ("hidden_size",)),
    LayerWeight("hnorm.weight", "hnorm", ("hidden_size",)),
    LayerWeight("norm.weight", "final_norm", ("hidden_size",)),
    LayerWeight("hc_head_fn", "hc_head_fn", ("hc_mult", "hc_width")),
    LayerWeight("hc_head_base", "hc_head_base", ("hc_mult",)),
    LayerWeight("hc_head_scale", "hc_head_scale", ("one",)),
)
"""An MTP layer's own tensors besides its block's (the block's are ``LAYER_WEIGHTS``, under the same prefix): ours
are ``mtp.{k}.<ours>``, the block's ``layers.{num_layers + k}.<ours>``."""


def mtp_kinds(cfg: DeepseekV4Config) -> tuple[str, ...]:
    """The MTP layers' cache kinds; a ``CheckpointError`` naming the field when the config declares none or does
    not list their types."""
    if cfg.mtp_layers == 0:
        raise CheckpointError("deepseek_v4: the checkpoint has no multi-token-prediction layers (config.json: "
                              "num_nextn_predict_layers is 0 or absent)")
    if cfg.mtp_kinds is None:
        raise CheckpointError(
            f"deepseek_v4: the {cfg.mtp_layers} multi-token-prediction layer(s) (num_nextn_predict_layers) need their "
            f"attention type: config.json's 'layer_types' or 'compress_ratios' must list "
            f"{cfg.num_layers + cfg.mtp_layers} entries ({cfg.num_layers} decoder layers, then the MTP layers'); it lists fewer")
    return cfg.mtp_kinds


def extended(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """``cfg`` with the MTP layers appended as blocks ``num_layers ..`` (what ``attention`` and ``moe`` index)."""
    kinds = mtp_kinds(cfg)
    return replace(cfg, num_layers=cfg.num_layers + len(kinds), layer_kinds=cfg.layer_kinds + kinds)


def state_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """``cfg`` as if its layers were the MTP layers alone: the state ``allocate_state`` gives them."""
    kinds = mtp_kinds(cfg)
    return replace(cfg, num_layers=len(kinds), layer_kinds=kinds, hash_layers=())


def mtp_weight_layout(cfg: DeepseekV4Config) -> dict[str, tuple[str, tuple[int, ...], torch.dtype | None]]:
    """Checkpoint name -> (our name, shape, kept dtype) of every MTP tensor (``deepseek_v4.weight_layout``'s form)."""
    sizes, wide = extents(cfg), extended(cfg)
    layout = {}
    for k in range(cfg.mtp_layers):
        prefix, number = MTP_PREFIX.format(k=k), cfg.num_layers + k
        for weight in MTP_WEIGHTS:
            layout[prefix + weight.name] = (f"mtp.{k}.{weight.ours}", tuple(sizes[e] for e in weight.shape),
                                            weight.dtype)
        for weight in LAYER_WEIGHTS:
            if not holds(wide, weight.layers, number):
                continue
            for expert in range(cfg.moe.num_experts) if "{expert}" in weight.name else (0,):
                layout[prefix + weight.name.format(expert=expert)] = (
                    f"layers.{number}." + weight.ours.format(expert=expert),
                    tuple(sizes[e] for e in weight.shape), weight.dtype)
    return layout


def load_mtp_weights(checkpoint: Checkpoint, cfg: DeepseekV4Config, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
    """Every MTP tensor under our names, in ``dtype`` (the config's by default) where the table keeps none; a
    missing or misshapen one is named (``CheckpointError``)."""
    layout = mtp_weight_layout(cfg)
    missing = [name for name in layout if name not in checkpoint]
    if missing:
        raise CheckpointError(f"{checkpoint.directory}: config.json declares {cfg.mtp_layers} MTP layer(s), so tensor "
                              f"{missing[0]!r} is required ({len(missing)} of {len(layout)} MTP tensors missing; "
                              f"found none such in {checkpoint.files()})")
    wrong = [(name, shape) for name, (_, shape, _) in layout.items() if checkpoint.info(name).shape != shape]
    if wrong:
        name, shape = wrong[0]
        raise CheckpointError(f"{checkpoint.directory}: MTP tensor {name!r} must have shape {list(shape)}; found "
                              f"{list(checkpoint.info(name).shape)}")
    return {ours: checkpoint.load(name).to(kept or dtype or cfg.dtype) for name, (ours, _, kept) in layout.items()}


def allocate_mtp_state(cfg: DeepseekV4Config, num_slots: int, max_seq_len: int, step_rows: int,
                       device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The MTP layers' own zeroed state buffers (``deepseek_v4_model.allocate_state`` of their kinds)."""
    return allocate_state(state_config(cfg), num_slots, max_seq_len, step_rows, device)


def mtp_step(weights: Mapping[str, torch.Tensor], cfg: DeepseekV4Config, streams: torch.Tensor,
             next_ids: torch.Tensor, start: int, slot: int, state: Mapping[str, torch.Tensor], layer: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer ``layer`` over ``R`` consecutive rows of slot ``slot`` at positions ``start ..``: ``streams [R,
    hc_mult, hidden]`` (the target's last-layer streams at those positions, or the layer's own output for a
    drafted row) and ``next_ids [R]`` (the tokens at positions ``start + 1 ..``). Returns (the hidden its head
    projects ``[R, hidden]``: logits for positions ``start + 2 ..``, its output streams ``[R, hc_mult, hidden]``)."""
    if not 0 <= layer < cfg.mtp_layers:
        raise ValueError(f"deepseek_v4 MTP: layer {layer} must be below the checkpoint's {cfg.mtp_layers} MTP layer(s)")
    rows, eps = next_ids.shape[0], cfg.rms_norm_eps
    if streams.shape != (rows, cfg.hc_mult, cfg.hidden_size):
        raise ValueError(f"deepseek_v4 MTP: streams must be [{rows} rows, {cfg.hc_mult}, {cfg.hidden_size}] for "
                         f"{rows} next ids; found {list(streams.shape)}")
    state_cfg, wide = state_config(cfg), extended(cfg)
    check_step(state_cfg, state, start, rows, slot)
    prefix, number = f"mtp.{layer}.", cfg.num_layers + layer
    token_ids = next_ids.clamp(0, cfg.vocab_size - 1)
    embedded = rms_norm(F.embedding(token_ids, weights["embed"]), weights[prefix + "enorm"], eps)  # [R, hidden]
    x = F.linear(embedded, weights[prefix + "e_proj"]).unsqueeze(1) \
        + F.linear(rms_norm(streams, weights[prefix + "hnorm"], eps), weights[prefix + "h_proj"])  # [R, n, hidden]
    positions = start + torch.arange(rows, device=next_ids.device)
    own = layer_state(state_cfg, state, layer, slot)
    out = block(weights, wide, number, x, token_ids,
                lambda n, h: attention(weights, wide, n, h, positions, own))
    return collapse_streams(weights, cfg, out, prefix), out


class MtpDraft:
    """Greedy MTP proposals for one sequence (slot 0 of its own state) from MTP layer 0 (every released V4
    checkpoint has one), the target's streams fed in as the target verifies positions: ``consume`` every verified
    position once, in order, then ``propose``."""

    def __init__(self, weights: Mapping[str, torch.Tensor], cfg: DeepseekV4Config, max_seq_len: int, step_rows: int,
                 head: str = "head"):
        self.weights, self.cfg, self.head = weights, cfg, weights[head]
        self.state = allocate_mtp_state(cfg, 1, max_seq_len, step_rows)
        self.consumed = 0  # positions whose target streams the layer has read
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last consumed row's (hidden, streams)

    def consume(self, streams: torch.Tensor, next_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The target's streams ``[R, n, hidden]`` at the next ``R`` unconsumed positions and the tokens after
        them; the layer's head hidden of those rows ``[R, hidden]``."""
        ids = torch.as_tensor(next_ids, dtype=torch.long)
        hidden, out = mtp_step(self.weights, self.cfg, streams, ids, self.consumed, 0, self.state)
        self.consumed += ids.shape[0]
        self.last = hidden[-1:], out[-1:]
        return hidden

    def propose(self, count: int) -> list[int]:
        """``count`` greedy tokens for the positions after the last consumed row's next token."""
        return self.draft(count)[0]

    def draft(self, count: int) -> tuple[list[int], torch.Tensor]:
        """``propose``'s tokens and the head hidden each was chosen from ``[count, hidden]``."""
        if self.last is None:
            raise ValueError("deepseek_v4 MTP draft: consume the target's streams before proposing")
        hidden, streams = self.last
        proposals: list[int] = []
        rows = []
        for step in range(count):
            if step:
                hidden, streams = mtp_step(self.weights, self.cfg, streams, torch.tensor([proposals[-1]]),
                                           self.consumed - 1 + step, 0, self.state)
            rows.append(hidden[-1])
            proposals.append(int((hidden[-1] @ self.head.T).argmax()))
        return proposals, torch.stack(rows) if rows else hidden[:0]


__all__ = ["MTP_PREFIX", "MTP_WEIGHTS", "mtp_kinds", "extended", "state_config", "mtp_weight_layout",
           "load_mtp_weights", "allocate_mtp_state", "mtp_step", "MtpDraft"]
