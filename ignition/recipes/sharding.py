"""Tensor parallelism for the decoder recipes (qwen3, llama, qwen3_moe, deepseek_v3, gemma3, gpt_oss, deepseek_v4):
rank shards and collectives.

``--tensor-parallel N`` splits one checkpoint into N rank shards by the table in
``ignition.catalog.parallel.SHARD_RULES`` (Megatron layout): q/k/v/gate/up split their output
rows (GQA heads divided: query and KV heads must both divide by N), o/down split their input
columns and sum their partial outputs over the ranks, the embedding and LM head split the padded vocabulary
evenly (padded to a multiple of N with zero rows, which never enter a result). The row-parallel
sums keep the single-rank order (``catalog.parallel.ROW_REDUCTION_BLOCKS``), so for FP32 dense
models hidden states and logits are bit-identical to TP=1 whenever N divides the reduction blocks.

MoE layers (``recipes/moe.py``): the router is replicated, so every rank routes every row the same
way from the same hidden state; each expert, routed and shared, is an MLP split like the dense one.
A rank sums its experts' weighted partial outputs and the shared experts' partial output locally;
the layer then does its one reduction, as a dense MLP does (its sum is not TP=1's order: the
experts' weights apply to partial products). MLA attention (``recipes/mla.py``): q_a / kv_a and
their norms are replicated (every rank caches the same latent and rope key), q_b (or q) and kv_b
split by heads, o_proj is row-parallel. The sizes that must divide by N are ``SPLIT_FIELDS``. Each rank's graphs
run ``TensorParallel``'s collectives as traceable functional collectives on the default process
group, so every rank's ``.pt2`` holds them and binds them to the group the runtime starts.

DeepSeek V4 (``recipes/deepseek_v4_export.py``): query heads, the grouped output projection's groups, the attention
sinks and the lightning indexer's heads are split; its one K=V head, compressors, hyper-connections and router are
replicated, so every rank writes the same state. The indexer's per-rank head sums are added by ``reduce`` before
every rank ranks the entries, so all ranks keep the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ignition.catalog.parallel import (MAX_TENSOR_PARALLEL, SHARDABLE_RECIPES, SPLIT_FIELDS, SplitField,
                                       padded_vocabulary, shard_rule)
from ignition.components.vocabulary_logprobs import VocabularyShard
from ignition.recipes.base import RecipeError
from ignition.recipes.layers import pairwise_sum




def _group():
    import torch.distributed as dist

    return dist.group.WORLD  # bound when the graph is traced (fake group at export, gloo/NCCL at run time)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", _group())


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.all_gather_tensor(x.contiguous(), 0, _group())


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """One rank's view of the model: its slice of the vocabulary and the collectives its graphs run."""

    rank: int
    ranks: int
    vocab_size: int
    vocab_padded: int  # the full padded vocabulary (a multiple of ranks)

    @property
    def vocab_shard(self) -> int:
        return self.vocab_padded // self.ranks

    @property
    def vocabulary(self) -> VocabularyShard:
        return VocabularyShard(self.rank, self.ranks, self.vocab_shard, self.vocab_size, _all_gather)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of a row-parallel layer's partial outputs over the ranks, in the fixed pairwise order.

        Each rank's partial is the subtree of its run of reduction blocks (``layers.row_linear``); the
        subtotals are all-gathered and added by the same tree on every rank, so the sum is the
        single-rank one bit for bit (an all-reduce would add them in the transport's order). BF16 and
        FP16 partials are all-reduced as usual.
        """
        if partial.dtype != torch.float32:  # BF16/FP16 layers are one GEMM per rank (layers.row_linear)
            return _all_reduce(partial)
        gathered = _all_gather(partial).view(self.ranks, *partial.shape)
        return pairwise_sum(list(gathered.unbind(0)))

    def embed(self, token_ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: the owning rank's row, zeros elsewhere, summed (exact)."""
        local = token_ids - self.rank * self.vocab_shard
        owned = (local >= 0) & (local < self.vocab_shard)
        rows = F.embedding(local.clamp(0, self.vocab_shard - 1), shard)  # [R, d_model]
        return _all_reduce(torch.where(owned[:, None], rows, torch.zeros((), dtype=rows.dtype)))

    def gather_vocab(self, local_logits: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab_shard]`` on every rank -> ``[rows, vocab_padded]``: the rows sampling draws from."""
        rows = local_logits.shape[0]
        gathered = _all_gather(local_logits)  # [ranks * rows, vocab_shard]
        return gathered.view(self.ranks, rows, self.vocab_shard).permute(1, 0, 2).reshape(rows, self.vocab_padded)


def _field(cfg, path: str):
    """``cfg``'s value at a dotted ``path`` (``moe.intermediate_size``); None when the config has no such field."""
    value = cfg
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def split_fields(cfg) -> list[SplitField]:
    """The ``SPLIT_FIELDS`` this config has and uses (an all-MoE model's dense ``intermediate_size`` sizes nothing)."""
    return [split for split in SPLIT_FIELDS if _field(cfg, split.field) is not None
            and (split.applies is None or getattr(cfg, split.applies, True))]


def check_tensor_parallel(recipe: str, cfg, ranks: int) -> None:
    """Every reason ``cfg`` cannot be split over ``ranks``, as one RecipeError naming the fields."""
    if not 1 <= ranks <= MAX_TENSOR_PARALLEL:
        raise RecipeError(f"--tensor-parallel must be between 1 and {MAX_TENSOR_PARALLEL}, got {ranks}")
    if recipe not in SHARDABLE_RECIPES:
        raise RecipeError(f"--tensor-parallel {ranks}: recipe {recipe} has no sharded layout; "
                          f"tensor parallelism supports {', '.join(SHARDABLE_RECIPES)}")
    problems = [f"{split.field} = {_field(cfg, split.field)} is not divisible by {ranks} (config.json "
                f"{split.hf_field}: {split.what})" for split in split_fields(cfg) if _field(cfg, split.field) % ranks]
    if problems:
        raise RecipeError(f"--tensor-parallel {ranks}: the model cannot be split evenly over {ranks} ranks: "
                          + "; ".join(problems) + " (heads and MLP/expert widths are divided per rank)")


def shard_config(cfg, ranks: int):
    """The per-rank model config: every applicable ``SPLIT_FIELDS`` size and, where the config keeps the fixed
    reduction order, the o/down reduction blocks (``layers.row_linear``) divided by ``ranks``."""
    nested: dict[str, dict[str, int]] = {}
    for split in split_fields(cfg):
        owner, _, name = split.field.rpartition(".")
        nested.setdefault(owner, {})[name] = _field(cfg, split.field) // ranks
    top = nested.pop("", {})
    if hasattr(cfg, "row_blocks"):  # DeepSeek V4 has none: one GEMM per rank and ``TensorParallel.reduce``
        top |= {"row_blocks": max(1, cfg.row_blocks // ranks), "row_shard": ranks > 1}
    top |= {owner: dataclasses.replace(getattr(cfg, owner), **fields) for owner, fields in nested.items()}
    return dataclasses.replace(cfg, **top)


def shard_weights(weights: Mapping[str, torch.Tensor], ranks: int, vocab_padded: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's weights by ``SHARD_RULES``; vocabulary weights first padded to ``vocab_padded`` zero rows."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    for name, tensor in weights.items():
        rule = shard_rule(name)
        if rule.kind == "vocabulary" and tensor.shape[0] < vocab_padded:
            padding = tensor.new_zeros(vocab_padded - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        for rank in range(ranks):
            if rule.dim is not None:
                part = tensor.chunk(ranks, dim=rule.dim)[rank]
            elif rule.kind == "bias_once":  # added once, after the all-reduce would multiply it by N
                part = tensor if rank == 0 else torch.zeros_like(tensor)
            else:
                part = tensor
            shards[rank][name] = part.contiguous().clone()
    return shards


def shard_table(shards: list[dict[str, torch.Tensor]]) -> dict[str, dict]:
    """The manifest's shard geometry: per weight, its split kind and dim, full and per-rank shapes."""
    table = {}
    for name, part in shards[0].items():
        rule = shard_rule(name)
        full = list(part.shape)
        if rule.dim is not None:
            full[rule.dim] *= len(shards)
        table[name] = {"kind": rule.kind, "dim": rule.dim, "full": full, "shard": list(part.shape)}
    return table


def sharded_vocabulary(vocab_padded: int, ranks: int) -> int:
    return padded_vocabulary(vocab_padded, ranks)
