"""The Hugging Face decoder recipes: a checkpoint -> prefill and decode variants.

``qwen3``, ``llama`` and ``qwen3_moe`` are built here; ``deepseek_v3`` registers its own
``DecoderFamily`` (config parser, weight-name table, MLA decoder) and shares this build.
Reads ``config.json`` and the (single or sharded) safetensors weights, checks every tensor
against the layout the config implies, and declares one chunked prefill variant
``prefill.t{chunk_limit}`` (capacity 1) plus one ``decode.c{capacity}`` variant per decode
capacity, the optional families, and the packed prefill ``packed.t{chunk_limit}.c{capacity}``
(``packed_capacity``). Weights are stored once; with tied embeddings the graphs bind the lm_head to ``embed``.
The vocabulary is the checkpoint's own (``vocab_padded == vocab_size``): HF checkpoints already
pad their embedding rows, and a second padding would store a new copy of a tied head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ignition.catalog.buffers import (MIN_WINDOW, CHUNK_TOKENS, LANE_INPUTS, PACKED_INPUTS, PACKED_LANES, PACKED_TOKENS,
                                     SEGMENT_WINDOW, SHORTEST_WINDOWED, WINDOW_INPUTS, WINDOWS)
from ignition.catalog.contract import resolve_completion_token_capacity, scored_capacities
from ignition.catalog.enums import Operation
from ignition.catalog.geometry import WINDOW_PAGED_STATE, kv_blocks_bound, window_blocks_bound
from ignition.catalog.model import BufferDecl, Variant, decode_slot_limit
from ignition.recipes.base import (ExportOptions, GraphBuild, LogprobOutputs, RecipeBuild, RecipeError, ShardedBuild,
                                   chunk_arguments, completion_arguments, mixed_capacities, mixed_family,
                                   next_tokens_return, prefill_family, sampling_arguments, spec_arguments,
                                   verify_family, weight_arguments, with_block_tables, with_constraints)
from ignition.recipes.checkpoint import (ARCHITECTURES, CONFIG_FILE, Checkpoint, CheckpointError, family_of,
                                         open_checkpoint, read_config)
from ignition.recipes.config import WEIGHT_MAP, ModelConfig
from ignition.recipes.graphs import (Decoder, DecodeGraph, MixedGraph, PackedPrefillGraph, PrefillGraph,
                                     ScoredPrefillGraph, VerifyGraph, paged, state_declarations)
from ignition.recipes.tokenizer import tokenizer_dir
from ignition.recipes.transformer import gqa_decoder
from ignition.recipes.weights import WeightSpec, load_weights


@dataclass(frozen=True, slots=True)
class DecoderFamily:
    """What differs between the HF decoder recipes; the build, the variants and the graphs are shared."""

    family: str  # the checkpoint.ARCHITECTURES family the recipe accepts
    parse: Callable[[Mapping[str, Any], str], Any]  # (config.json, source) -> config with cache_shapes, summary
    weight_map: Mapping[str, WeightSpec]  # HF tensor name -> ours
    decoder: Decoder  # (weights, cfg, input_ids, rows, caches) -> hidden
    windowed: bool = False  # the attention reads only the key window ``key_window`` (recipes/attention.py)
    dynamic_chunks: bool = False  # prefill rows are a window too (not for MoE: its capacity ladder fixes the rows)
    packed: bool = False  # packed.t{C}.c{capacity}: several prompts' chunks per submission (GQA; without dynamic
    # chunks the packed rows are static and only the segment window narrows)
    # (checkpoint, config.json, weight_map) -> the tensors to export and the map under their stored names (a
    # multimodal checkpoint's text model); None: the checkpoint and map as they are
    text_weights: Callable[[Checkpoint, Mapping[str, Any], Mapping[str, WeightSpec]], tuple] | None = None
    checkpoint: Callable[[Path], Checkpoint] = open_checkpoint  # opens the weights (gpt_oss: MXFP4 dequantized)
    # (checkpoint, config, weight_map, dtype) -> the weights under the graphs' names (deepseek_v4: its own table)
    load: Callable[[Checkpoint, Any, Mapping[str, WeightSpec], torch.dtype], dict] = load_weights


_GQA = dict(parse=ModelConfig.from_hf_config, weight_map=WEIGHT_MAP, decoder=gqa_decoder, windowed=True)
FAMILIES: dict[str, DecoderFamily] = {name: DecoderFamily(name, **_GQA, dynamic_chunks=name != "qwen3_moe",
                                                    packed=name != "qwen3_moe")
                                      for name in ("qwen3", "llama", "qwen3_moe")}
"""Recipe name -> its family; the recipe name is also the family (HF architecture) it accepts."""

PREFILL_LANE_INPUTS = tuple(spec for spec in LANE_INPUTS if spec.name not in ("input_ids", "positions"))
"""Prefill lanes take their tokens and positions from the chunk inputs (chunk_input_ids, chunk_start)."""


def build(options: ExportOptions) -> RecipeBuild:
    family = FAMILIES.get(options.recipe)
    if family is None:
        raise RecipeError(f"recipe {options.recipe!r} is not a decoder recipe; expected one of {sorted(FAMILIES)}")
    return build_decoder(options, family)


def build_decoder(options: ExportOptions, family: DecoderFamily) -> RecipeBuild:
    if options.checkpoint is None:
        raise RecipeError(f"recipe {options.recipe}: a Hugging Face checkpoint directory is required")
    directory = Path(options.checkpoint)
    config = read_config(directory)
    _check_family(options.recipe, family, config, directory)
    cfg = family.parse(config, str(directory / CONFIG_FILE))
    _check_geometry(options, cfg)
    if hasattr(cfg, "with_steps"):  # sliding layers: a ring of their window plus one step's rows (cache_kinds)
        cfg = cfg.with_steps(step_rows(options), options.max_seq_len)
    dtype = getattr(torch, options.dtype) if options.dtype else cfg.dtype
    checkpoint, weight_map = family.checkpoint(directory), family.weight_map
    if family.text_weights is not None:
        checkpoint, weight_map = family.text_weights(checkpoint, config, weight_map)
    weights = family.load(checkpoint, cfg, weight_map, dtype)
    if cfg.tie_word_embeddings:
        del weights["lm_head"]  # stored once, as "embed"; the graphs read it for both roles
    token_capacity = resolve_completion_token_capacity(options.completion_token_capacity)
    k = options.outputs.k if options.outputs else 0
    vocab_padded = cfg.vocab_size
    packed = packed_capacity(options, family)
    parallel, graph_cfg, modules = None, cfg, _graph_modules(options, cfg, k, family.decoder, None, packed)
    if options.tensor_parallel > 1:  # rank 0's shards become the build's own weights and graphs
        parallel, graph_cfg, weights = _shard(options, cfg, k, family.decoder, weights)
        vocab_padded, modules = parallel.vocab_shard * parallel.ranks, parallel.rank_modules[0]
    state = state_declarations(graph_cfg, dtype, options.slots, options.max_seq_len, vocab_padded, options.block_size)
    fixed = weight_arguments(weights) + state
    variants = [prefill_variant(fixed, options.chunk_limit, token_capacity, options.outputs)]
    variants += [decode_variant(fixed, capacity, token_capacity, options.outputs,
                                slot_limit(options, capacity, family.decoder, dtype))
                 for capacity in options.capacities]
    if options.prompt_logprobs:  # appended: the ordinary catalog keeps its shapes and order
        variants += [prefill_variant(fixed, capacity, token_capacity, options.outputs, scored=True)
                     for capacity in scored_capacities(options.chunk_limit)]
    variants += [verify_variant(fixed, draft_tokens, capacity, token_capacity, options.outputs)
                 for draft_tokens in options.speculative_tokens for capacity in options.capacities]
    variants += [mixed_variant(fixed, options.chunk_limit, capacity, token_capacity, options.outputs)
                 for capacity in mixed_capacities(options)]
    if packed:
        variants.append(packed_variant(fixed, options.chunk_limit, packed, token_capacity, options.outputs))
    if family.windowed:
        # NOTE: AOTInductor cannot compile these dynamic extents yet (a CPU kernel meets a symbolic size), so a
        # core with compiled packages declares no windows and its graphs always read the full extents
        variants = [with_windows(variant, options.max_seq_len, vocab_padded, dynamic=options.compile is None,
                                 chunks=family.dynamic_chunks) for variant in variants]
    if options.structured_output:  # appended last: every other argument keeps its position
        variants = [with_constraints(variant, vocab_padded) for variant in variants]
    pages = {}
    if paged(graph_cfg):  # the pools of blocks: every variant reads and writes them through the slots' tables
        bound = kv_blocks_bound(options.slots, options.max_seq_len, options.block_size)
        window = any(name in WINDOW_PAGED_STATE for name in graph_cfg.cache_names)  # sliding layers' own tables
        variants = [with_block_tables(variant, options.slots, options.max_seq_len, options.block_size,
                                      dynamic=options.compile is None and bound > MIN_WINDOW, window=window)
                    for variant in variants]
        pages = {"block_size": options.block_size, "kv_blocks": bound}
        if window:
            pages["window_kv_blocks"] = window_blocks_bound(options.slots, graph_cfg.window_cells, options.max_seq_len,
                                                            options.block_size)
    graphs = [GraphBuild(variant, module) for variant, module in zip(variants, modules, strict=True)]
    return RecipeBuild(
        recipe=options.recipe,
        model={"architecture": config["architectures"][0], "dtype": str(dtype).removeprefix("torch."),
               **cfg.summary(), "max_seq_len": options.max_seq_len, "num_slots": options.slots, **pages},
        vocab_size=cfg.vocab_size,
        vocab_padded=vocab_padded,
        token_capacity=token_capacity,
        k=k,
        weights=weights,
        state=state,
        graphs=graphs,
        eos_token_id=eos_token_id(config, cfg, directory),
        chunk_limit=options.chunk_limit,
        tokenizer_dir=tokenizer_dir(Path(options.tokenizer) if options.tokenizer else directory,
                                    required=options.tokenizer is not None, vocab_size=cfg.vocab_size),
        parallel=parallel,
    )


def _graph_modules(options: ExportOptions, cfg, k: int, decoder: Decoder, parallel,
                   packed: int | None = None) -> list[torch.nn.Module]:
    """One module per variant, in catalog order: prefill, each decode capacity, the scored prefills, then the
    verify families, the mixed variants (single-rank only: ``_shard`` refuses them with tensor parallelism) and
    the packed prefill (``packed``: its lanes; single-rank only, see ``packed_capacity``)."""
    modules = [PrefillGraph(cfg, cfg.vocab_size, k, decoder, parallel)]
    modules += [DecodeGraph(cfg, cfg.vocab_size, k, decoder, parallel) for _ in options.capacities]
    if options.prompt_logprobs:
        modules += [ScoredPrefillGraph(cfg, cfg.vocab_size, k, decoder, parallel)
                    for _ in scored_capacities(options.chunk_limit)]
    modules += [VerifyGraph(cfg, cfg.vocab_size, k, decoder) for _ in options.speculative_tokens
                for _ in options.capacities]
    modules += [MixedGraph(cfg, cfg.vocab_size, k, decoder) for _ in mixed_capacities(options)]
    modules += [PackedPrefillGraph(cfg, cfg.vocab_size, k, decoder)] if packed else []
    return modules


def packed_capacity(options: ExportOptions, family: DecoderFamily) -> int | None:
    """Lanes of the ``packed.t{C}.c{capacity}`` variant: the widest decode capacity up to ``PACKED_LANES``, or
    None for no variant.

    A default-catalog variant wherever it pays: the family packs (its decoder takes packed rows), the widest
    capacity holds two lanes, and the graphs keep their dynamic extents (no ``--compile``, whose graphs declare
    no windows, no ``--onnx``, whose graphs run at the full extents: a packed graph would always run every
    lane's C rows) on a single rank (``--tensor-parallel`` cores schedule prompt chunks one at a time)."""
    widest = options.capacities[-1]
    eligible = options.compile is None and not options.onnx and options.tensor_parallel == 1
    return min(widest, PACKED_LANES) if options.packed_prefill and family.packed and widest >= 2 and eligible else None


def _shard(options: ExportOptions, cfg, k: int, decoder: Decoder, weights: dict[str, torch.Tensor]):
    """(ShardedBuild, the per-rank config, rank 0's weights) for ``--tensor-parallel N``."""
    from ignition.recipes.sharding import (TensorParallel, check_tensor_parallel, shard_config, shard_table,
                                           shard_weights, sharded_vocabulary)

    ranks = options.tensor_parallel
    if options.speculative_tokens or options.mixed:
        raise RecipeError("--speculative-tokens and --mixed are single-rank variants; export them without "
                          f"--tensor-parallel (got --tensor-parallel {ranks})")
    check_tensor_parallel(options.recipe, cfg, ranks)
    vocab_padded = sharded_vocabulary(cfg.vocab_size, ranks)
    rank_weights = shard_weights(weights, ranks, vocab_padded)
    rank_cfg = shard_config(cfg, ranks)
    modules = [_graph_modules(options, rank_cfg, k, decoder, TensorParallel(rank, ranks, cfg.vocab_size, vocab_padded))
               for rank in range(ranks)]
    return (ShardedBuild(ranks, vocab_padded // ranks, rank_weights, modules, shard_table(rank_weights)),
            rank_cfg, rank_weights[0])


def with_windows(variant: Variant, max_seq_len: int, vocab_padded: int, dynamic: bool = True,
                 chunks: bool = True) -> Variant:
    """``variant`` with the window inputs appended: the key window (its attention reads keys ``[0, W)`` only) and
    the sample window (a round of greedy lanes sorts a short prefix of the row instead of the vocabulary) and, in the
    prefill and mixed graphs, a dynamic chunk extent (a short prompt runs as few rows as it has; the packed
    prefill's packed rows and segment window likewise): all named in ``layout["windows"]``
    (``catalog.buffers.WINDOWS``). Scored prefill keeps its row capacity; without ``chunks`` (MoE families) the
    prefill, mixed and packed graphs keep their row capacity (the packed one still narrows its segment window)."""
    window, bindings = spec_arguments(WINDOW_INPUTS, max_seq_len=max_seq_len, vocab_padded=vocab_padded)
    variant.arguments = variant.arguments + window
    variant.bindings = variant.bindings | bindings
    extents = {a.name: a.shape[WINDOWS[a.name].dim] for a in variant.arguments if a.name in WINDOWS}
    if not chunks or variant.operation not in (Operation.PREFILL, Operation.MIXED):
        extents.pop(CHUNK_TOKENS, None)
    if not chunks:  # the packed rows are the graph's rows too (an MoE ladder sizes its rungs by them)
        extents.pop(PACKED_TOKENS, None)
    variant.layout["windows"] = [name for name, extent in extents.items() if dynamic and extent >= SHORTEST_WINDOWED]
    return variant


def slot_limit(options: ExportOptions, capacity: int, decoder: Decoder, dtype: torch.dtype) -> int | None:
    """A decode variant's slot limit (``catalog.model.decode_slot_limit``), declared on grouped-query attention's
    FP32 decode variants (``layout["slot_limit"]``); BF16/FP16 and MLA variants declare none. The graphs read every
    lane's window through its block table (``recipes/attention.py``), so the limit does not change what they
    compute: it restricts the slots the runtime may submit to the variant."""
    if decoder is not gqa_decoder or dtype != torch.float32:
        return None
    return decode_slot_limit(capacity, options.capacities, options.slots)


def decode_variant(fixed: list[BufferDecl], capacity: int, token_capacity: int,
                   logprob_outputs: LogprobOutputs | None, slot_limit: int | None = None) -> Variant:
    """``decode.c{capacity}``: weights, state, lane inputs, sampling inputs, completion bundle; ``slot_limit``: its
    lanes' slots are all below it (``layout["slot_limit"]``)."""
    lanes, lane_bindings = spec_arguments(LANE_INPUTS, capacity=capacity)
    sampling, sampling_bindings = sampling_arguments(capacity)
    outputs, output_bindings, layout = completion_arguments(capacity, token_capacity, logprob_outputs)
    if slot_limit is not None:
        layout["slot_limit"] = slot_limit
    return Variant(name=f"decode.c{capacity}", operation=Operation.DECODE, capacity=capacity,
                   arguments=fixed + lanes + sampling + outputs, returns=next_tokens_return(capacity),
                   bindings=lane_bindings | sampling_bindings | output_bindings, layout=layout)


def verify_variant(fixed: list[BufferDecl], draft_tokens: int, capacity: int, token_capacity: int,
                   logprob_outputs: LogprobOutputs | None) -> Variant:
    """``verify.s{S}.c{capacity}``: weights, state, lane and draft inputs, sampling inputs, completion bundle."""
    identity, lanes, lane_bindings, outputs, output_bindings, layout, returns = verify_family(
        draft_tokens, capacity, token_capacity, logprob_outputs)
    sampling, sampling_bindings = sampling_arguments(capacity)
    return Variant(**identity, arguments=fixed + lanes + sampling + outputs, returns=returns,
                   bindings=lane_bindings | sampling_bindings | output_bindings, layout=layout)


def mixed_variant(fixed: list[BufferDecl], chunk_limit: int, capacity: int, token_capacity: int,
                  logprob_outputs: LogprobOutputs | None) -> Variant:
    """``mixed.t{C}.c{capacity}``: weights, state, lane, chunk and prompt-lane inputs, sampling inputs, the shared
    bundle and both roles' private frames."""
    identity, inputs, bindings, outputs, output_bindings, layout = mixed_family(
        chunk_limit, capacity, token_capacity, logprob_outputs)
    sampling, sampling_bindings = sampling_arguments(capacity)
    return Variant(**identity, arguments=fixed + inputs + sampling + outputs, returns=next_tokens_return(capacity),
                   bindings=bindings | sampling_bindings | output_bindings, layout=layout)


def packed_variant(fixed: list[BufferDecl], chunk_limit: int, capacity: int, token_capacity: int,
                   logprob_outputs: LogprobOutputs | None) -> Variant:
    """``packed.t{C}.c{capacity}`` (PACKED_PREFILL): weights, state, lane inputs without ``input_ids``/``positions``,
    the packed inputs (``capacity * C`` rows, each lane's segment at most C), sampling inputs, the bundle."""
    lanes, lane_bindings = spec_arguments(PREFILL_LANE_INPUTS, capacity=capacity)
    packed, packed_bindings = spec_arguments(PACKED_INPUTS, capacity=capacity, C=chunk_limit)
    sampling, sampling_bindings = sampling_arguments(capacity)
    outputs, output_bindings, layout = completion_arguments(capacity, token_capacity, logprob_outputs)
    layout["packed"] = {"tokens": PACKED_TOKENS, "segment_rows": chunk_limit, "segment_window": SEGMENT_WINDOW}
    return Variant(name=f"packed.t{chunk_limit}.c{capacity}", operation=Operation.PACKED_PREFILL, capacity=capacity,
                   arguments=fixed + lanes + packed + sampling + outputs, returns=next_tokens_return(capacity),
                   bindings=lane_bindings | packed_bindings | sampling_bindings | output_bindings, layout=layout)


def prefill_variant(fixed: list[BufferDecl], chunk_limit: int, token_capacity: int,
                    logprob_outputs: LogprobOutputs | None, scored: bool = False) -> Variant:
    """``prefill.t{C}``: weights, state, lane inputs (capacity 1), chunk inputs, sampling inputs, bundle.

    ``scored``: ``scored.t{C}`` (SCORED_PREFILL, capacity C) adds the prompt-scoring buffers.
    """
    lanes, lane_bindings = spec_arguments(PREFILL_LANE_INPUTS, capacity=1)
    chunk, chunk_bindings = chunk_arguments(chunk_limit)
    sampling, sampling_bindings = sampling_arguments(1)
    identity, outputs, output_bindings, layout = prefill_family(chunk_limit, token_capacity, logprob_outputs, scored)
    return Variant(**identity,
                   arguments=fixed + lanes + chunk + sampling + outputs, returns=next_tokens_return(1),
                   bindings=lane_bindings | chunk_bindings | sampling_bindings | output_bindings, layout=layout)


def _check_family(recipe: str, family: DecoderFamily, config: dict, directory: Path) -> None:
    found = family_of(config, str(directory / CONFIG_FILE))
    if found != family.family:
        wanted = [name for name, name_family in ARCHITECTURES.items() if name_family == family.family]
        raise RecipeError(f"{directory / CONFIG_FILE}: recipe {recipe} expects architectures[0] in {wanted}, "
                          f"found {config['architectures'][0]!r} (use --recipe {found})")


def step_rows(options: ExportOptions) -> int:
    """The most rows one slot writes in a step: a prompt chunk (packed and mixed chunks are no longer) or a verify
    round's S + 1 positions (``validate/cache_kinds.step_rows`` reads the same from a core)."""
    return max(options.chunk_limit, max(options.speculative_tokens, default=0) + 1)


def _check_geometry(options: ExportOptions, cfg) -> None:
    if options.max_seq_len > cfg.max_position_embeddings:
        raise RecipeError(f"--max-seq-len {options.max_seq_len} exceeds the checkpoint's max_position_embeddings "
                          f"{cfg.max_position_embeddings}")
    if options.chunk_limit > options.max_seq_len:
        raise RecipeError(f"--chunk-limit {options.chunk_limit} exceeds --max-seq-len {options.max_seq_len}")
    if max(options.capacities) > options.slots:
        raise RecipeError(f"decode capacity {max(options.capacities)} exceeds num_slots {options.slots}: "
                          f"active lanes must use distinct slots")


def eos_token_id(config: dict, cfg, directory: Path) -> int | None:
    """``config.json`` eos_token_id (the first one when it lists several; a multimodal checkpoint's may be in its
    ``text_config``), checked against the vocabulary."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("eos_token_id", text.get("eos_token_id"))
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.vocab_size:
        raise CheckpointError(f"{directory / CONFIG_FILE}: field 'eos_token_id' must be a token id in "
                              f"[0, {cfg.vocab_size}); found {config.get('eos_token_id')!r}")
    return value

