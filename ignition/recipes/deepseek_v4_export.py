"""The ``deepseek_v4`` recipe (HF ``DeepseekV4ForCausalLM``): the shared decoder build over DeepSeek V4's forward.

The build, variants and graphs are ``llama.build_decoder``'s: chunked prefill, decode, scored prefill and mixed
graphs; its ``Decoder`` is ``deepseek_v4_graph_decoder``, which runs ``deepseek_v4_model``'s step forward over a
graph's rows. Each attention group (a prompt chunk's rows, or one decode lane) is one step of its slot, reading and
writing the slot's state in place (``deepseek_v4_model.layer_state``): it gathers the ring cells it reads and the
slot's entry tables, and copies only the rows it produces into their cells (no copy of the slot's whole state,
tests/test_decode_copies.py); a group with no valid row rewrites those cells' old values, and a prompt chunk's
padding rows write no ring cell. Groups run one after another, so lanes that share a slot (idle ones repeat an
active lane's) leave it as the active lane wrote it.

``--tensor-parallel N`` splits the query heads, the output projection's groups (``wo_a`` rows, ``wo_b`` columns),
the attention sinks, the lightning indexer's heads and every expert's width over the ranks (``recipes/sharding.py``,
``catalog.parallel.SHARD_RULES``); the one K=V head, the compressors, the router and the hyper-connections are
replicated, so every rank holds the whole state and writes the same values into it. No packed prefill is declared
(each prompt chunk runs alone). ``--onnx`` writes ONNX graphs: the indexer's stable
sort becomes one ``TopK`` (``components/onnx_standard.py``), whose specified tie-break (the lower index first)
is the tie rule.

``--speculative-tokens`` builds the verify family for a runtime drafter (``runtime/drafters.py``): a lane's
``S + 1`` rows are one step of its slot, each row attending and ranking entries as the decode step at its
position does (the tie rule makes a row's choice its own scores' alone), equal to it within FP32 rounding. A
rejected row's ring cells and entries are rewritten before any later row reads them (``catalog/cache_kinds.py``),
so a round needs no rollback. The checkpoint's multi-token-prediction layers are not exported as a draft (their
forward and greedy draft are ``deepseek_v4_mtp``'s reference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ignition.recipes.base import ExportOptions, RecipeBuild
from ignition.recipes.checkpoint import Checkpoint
from ignition.recipes.deepseek_v4 import DeepseekV4Config, load_weights
from ignition.recipes.deepseek_v4_model import attention, check_step, decoder_rows, layer_state
from ignition.recipes.layers import Rows

def deepseek_v4_graph_decoder(weights: Mapping[str, torch.Tensor], cfg: DeepseekV4Config, input_ids: torch.Tensor,
                              rows: Rows, caches: Mapping[str, torch.Tensor], parallel=None) -> torch.Tensor:
    """DeepSeek V4 over a graph's rows (``graphs.Decoder``): final-normed hidden ``[R, hidden]``.

    The rows split into ``G = len(rows.read_slots)`` groups of ``R / G`` consecutive positions of one slot.
    ``parallel``: this graph is one rank of a sharded core (``deepseek_v4_model.decoder_rows``)."""
    groups = rows.read_slots.shape[0]
    per_group = input_ids.shape[0] // groups
    step_cfg = replace(cfg, dtype=weights["embed"].dtype)  # the export dtype (--dtype)
    check_step(step_cfg, caches, 0, per_group, 0)  # static: every buffer, width, ring and table at trace time
    positions = rows.positions.clamp(min=0)  # an idle lane's position may be anything
    valid = rows.valid.view(groups, per_group)
    num_slots = caches[cfg.cache_names[0]].shape[1]
    slots = rows.read_slots.clamp(0, num_slots - 1)

    def attention_of(layer: int, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for group in range(groups):
            span = slice(group * per_group, (group + 1) * per_group)
            state = layer_state(step_cfg, caches, layer, slots[group:group + 1])
            outputs.append(attention(weights, step_cfg, layer, x[span], positions[span], state, valid[group],
                                     parallel))
        return outputs[0] if groups == 1 else torch.cat(outputs)

    return decoder_rows(weights, step_cfg, input_ids, attention_of, parallel)


def _load(checkpoint: Checkpoint, cfg: DeepseekV4Config, weight_map, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``DecoderFamily.load``: every weight (``deepseek_v4.load_weights``), the head under the graphs' name."""
    weights = load_weights(checkpoint, cfg, dtype)
    weights["lm_head"] = weights.pop("head")
    return weights


def _parse(config: Mapping, source: str) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf_config(config, source)


def build(options: ExportOptions) -> RecipeBuild:
    from ignition.recipes.llama import DecoderFamily, build_decoder

    family = DecoderFamily("deepseek_v4", _parse, {}, deepseek_v4_graph_decoder, load=_load)
    return build_decoder(options, family)


__all__ = ["deepseek_v4_graph_decoder", "build"]
