"""What a recipe hands the exporter: weights, state declarations and graph variants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ignition.catalog.buffers import (BUFFERS, CHUNK_INPUTS, COMPLETION_BUFFERS, CONSTRAINED_OPERATIONS,
                                     CONSTRAINT_INPUTS, DRAFT_TOKENS, ID_INPUTS, LANE_INPUTS, LOGPROBS, MIXED_BUFFERS,
                                     KEY_WINDOW, PROMPT_LANE, RECORDS, REQUESTED, ROLE_FRAMES, SAMPLING_INPUTS,
                                     PAGED_INPUTS, SPECULATIVE_INPUTS, WINDOW_PAGED_INPUTS, WINDOWS, BufferSpec)
from ignition.catalog.geometry import BLOCK_SIZE, DYNAMIC_BLOCKS, block_size_problem, max_blocks
from ignition.catalog.contract import NATURAL_K, bitmask_words, packed_width, resolve_completion_token_capacity
from ignition.catalog.enums import Operation, Role, ValueSource
from ignition.catalog.limits import check_limit
from ignition.catalog.parallel import MAX_TENSOR_PARALLEL
from ignition.catalog.model import BufferDecl, Variant, lane_count
from ignition.components.completion import CompletionOutputs, declare
from ignition.components.prompt_scoring import prompt_arguments


class RecipeError(Exception):
    """A recipe cannot build a core from the given checkpoint or options."""


@dataclass(slots=True)
class ExportOptions:
    """Everything ``export-core`` accepts, validated once."""

    recipe: str
    checkpoint: Path | None = None
    capacities: tuple[int, ...] = (1, 2, 4, 8)
    chunk_limit: int = 256
    completion_token_capacity: int | None = None
    targets: tuple[str, ...] = ()
    dtype: str | None = None
    logprobs: bool = True  # benchmark-only: False builds a records-only core (not on the CLI; see benchmarks/decode.py)
    prompt_logprobs: bool = False
    max_seq_len: int = 512
    num_slots: int | None = None
    compile: str | None = None
    onnx: bool = False  # also write graphs/<variant>.onnx for onnxruntime
    seed: int = 0
    tokenizer: Path | None = None  # a directory with tokenizer.json (+ tokenizer_config.json) to ship in the core
    k: int = NATURAL_K  # natural alternatives exported (below 20 only for natural-only cores)
    logprob_ids: bool = True  # export the explicit-ID inputs (False: a natural-only core, width 2+2K)
    tensor_parallel: int = 1  # rank shards in the core (recipes/sharding.py)
    speculative_tokens: tuple[int, ...] = ()  # S of each verify.s{S}.c{capacity} family (empty: none)
    mixed: bool = False  # mixed.t{chunk_limit}.c{capacity} variants for every decode capacity >= 2
    structured_output: bool = True  # token bitmask + logit bias inputs in every sampling variant but verify
    packed_prefill: bool = True  # packed.t{C}.c{widest capacity, at most PACKED_LANES} (llama.packed_capacity)
    capture_jobs: int | None = None  # worker processes capturing variants (None or 0: exporter/workers.capture_jobs)
    block_size: int = BLOCK_SIZE  # positions per block of the paged caches (catalog.geometry.PAGED_STATE)

    def __post_init__(self):
        if not self.capacities or any(c < 1 for c in self.capacities) or len(set(self.capacities)) != len(self.capacities):
            raise RecipeError(f"capacities must be distinct positive integers, got {list(self.capacities)}")
        self.capacities = tuple(sorted(self.capacities))
        if self.chunk_limit < 1:
            raise RecipeError(f"chunk limit must be positive, got {self.chunk_limit}")
        ranged = [("capacity", c, "--capacities") for c in self.capacities] + [
            ("chunk_limit", self.chunk_limit, "--chunk-limit"),
            ("completion_token_capacity", self.completion_token_capacity, "--completion-token-capacity"),
            ("max_seq_len", self.max_seq_len, "--max-seq-len"), ("num_slots", self.num_slots, "--num-slots"),
            ("export_seed", self.seed, "--seed"), ("capture_jobs", self.capture_jobs, "--jobs")] + [
            ("speculative_tokens", s, "--speculative-tokens") for s in self.speculative_tokens]
        for name, value, option in ranged:
            problem = None if value is None else check_limit(name, value, option)
            if problem:
                raise RecipeError(problem)
        block_problem = block_size_problem(self.block_size, WINDOWS[KEY_WINDOW].granule)
        if block_problem:
            raise RecipeError(f"--block-size: {block_problem}")
        if self.capture_jobs == 0:
            self.capture_jobs = None  # the CLI's 0: decided by the export's size
        if len(set(self.speculative_tokens)) != len(self.speculative_tokens):
            raise RecipeError(f"--speculative-tokens must be distinct, got {list(self.speculative_tokens)}")
        self.speculative_tokens = tuple(sorted(self.speculative_tokens))
        token_capacity = resolve_completion_token_capacity(self.completion_token_capacity)
        if self.speculative_tokens and self.speculative_tokens[-1] + 1 > token_capacity:
            raise RecipeError(f"--speculative-tokens {self.speculative_tokens[-1]}: a verify round emits up to S+1 = "
                              f"{self.speculative_tokens[-1] + 1} positions, more than T={token_capacity} "
                              f"(raise --completion-token-capacity)")
        if self.onnx and self.speculative_tokens:  # torch.onnx.export cannot lower the verify graphs
            raise RecipeError("--onnx cannot be combined with --speculative-tokens: the verify variants have no ONNX "
                              "export; export the speculative core without --onnx (it runs with --runtime torch)")
        if self.mixed and self.capacities[-1] < 2:
            raise RecipeError(f"--mixed needs a decode capacity of at least 2 (a prompt lane and a decode lane), "
                              f"got {list(self.capacities)}")
        if self.dtype not in (None, "bfloat16", "float16", "float32"):
            raise RecipeError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.compile not in (None, "inductor"):
            raise RecipeError(f"--compile must be 'inductor', got {self.compile!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= NATURAL_K:
            raise RecipeError(f"--logprob-k must be between 1 and {NATURAL_K}, got {self.k!r}")
        if self.logprob_ids and self.k != NATURAL_K:
            raise RecipeError(f"--logprob-k {self.k}: cores with explicit-ID inputs export K={NATURAL_K}; "
                              f"add --no-logprob-ids for a natural-only core")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or not 1 <= self.tensor_parallel <= MAX_TENSOR_PARALLEL:
            raise RecipeError(f"--tensor-parallel must be an integer between 1 and {MAX_TENSOR_PARALLEL}, "
                              f"got {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.compile:
            raise RecipeError(f"--tensor-parallel {self.tensor_parallel} cannot be combined with --compile: sharded "
                              f"cores carry portable .pt2 graphs (and prepared kernels with --targets)")
        if self.prompt_logprobs and (not self.logprobs or self.k != NATURAL_K):
            raise RecipeError(f"--prompt-logprobs requires the K={NATURAL_K} generation logprob outputs "
                              f"(found K={self.k if self.logprobs else 0})")

    @property
    def slots(self) -> int:
        return self.num_slots or max(self.capacities)

    @property
    def outputs(self) -> "LogprobOutputs | None":
        """The logprob outputs every sampling variant declares; None only for benchmark records-only builds."""
        return LogprobOutputs(self.k, self.logprob_ids) if self.logprobs else None


@dataclass(frozen=True, slots=True)
class LogprobOutputs:
    """K natural alternatives, with (the complete bundle, K=20) or without the explicit-ID inputs."""

    k: int = NATURAL_K
    explicit_ids: bool = True


@dataclass(slots=True)
class GraphBuild:
    variant: Variant
    module: torch.nn.Module  # forward(buffers: dict[str, Tensor]) -> tuple of returns


@dataclass(slots=True)
class ShardedBuild:
    """Ranks 1..N-1 of a tensor-parallel build (rank 0 is the RecipeBuild's own weights and graphs)."""

    ranks: int
    vocab_shard: int
    rank_weights: list[dict[str, torch.Tensor]]  # index r: rank r's weights (index 0 is the build's own)
    rank_modules: list[list[torch.nn.Module]]  # index r: rank r's module for each of the build's graphs, in order
    shards: dict[str, dict]  # weight name -> {kind, dim, full, shard}


@dataclass(slots=True)
class RecipeBuild:
    recipe: str
    model: dict  # summary for the manifest: architecture, sizes, dtype
    vocab_size: int
    vocab_padded: int
    token_capacity: int  # T, resolved
    k: int  # natural alternatives exported (0 without logprob outputs)
    weights: dict[str, torch.Tensor]
    state: list[BufferDecl]
    graphs: list[GraphBuild]
    eos_token_id: int | None = None
    chunk_limit: int | None = None
    tokenizer_dir: Path | None = None
    extra_files: dict[str, bytes] = field(default_factory=dict)
    parallel: ShardedBuild | None = None


def weight_arguments(weights: dict[str, torch.Tensor]) -> list[BufferDecl]:
    return [BufferDecl(name, str(t.dtype).removeprefix("torch."), list(t.shape), Role.WEIGHT) for name, t in weights.items()]


def spec_arguments(specs: tuple[BufferSpec, ...], **geometry: int) -> tuple[list[BufferDecl], dict[str, ValueSource]]:
    decls = [declare(spec, **geometry) for spec in specs]
    return decls, {spec.name: spec.source for spec in specs if spec.role is Role.INPUT}


def completion_arguments(capacity: int, token_capacity: int, outputs: LogprobOutputs | None):
    """The CompletionOutputs bundle as arguments, plus bindings and layout (records alone when ``outputs`` is None)."""
    if outputs is None:  # benchmark-only records-only build
        bundle = CompletionOutputs.allocate(capacity, token_capacity, device="meta")
        decls = [declare(BUFFERS[RECORDS], capacity=capacity, T=bundle.token_capacity)]
    elif outputs.explicit_ids:
        bundle = CompletionOutputs.allocate(capacity, token_capacity, device="meta")
        decls = bundle.declarations()
    else:
        bundle = CompletionOutputs.allocate_natural(capacity, outputs.k, token_capacity, device="meta")
        decls = bundle.declarations()
    declared = {d.name for d in decls}
    bindings = {spec.name: spec.source for spec in COMPLETION_BUFFERS if spec.role is Role.INPUT and spec.name in declared}
    layout = {"records": RECORDS, "token_capacity": bundle.token_capacity, "logprobs": None, "prompt_logprobs": None}
    if outputs is not None:
        layout["logprobs"] = {"buffer": LOGPROBS, "k": outputs.k, "width": packed_width(outputs.k, outputs.explicit_ids),
                              "explicit_ids": outputs.explicit_ids, "flags": REQUESTED,
                              "id_inputs": list(ID_INPUTS) if outputs.explicit_ids else []}
    return decls, bindings, layout


def lane_arguments(capacity: int):
    return spec_arguments(LANE_INPUTS, capacity=capacity)


def sampling_arguments(capacity: int):
    return spec_arguments(SAMPLING_INPUTS, capacity=capacity)


def chunk_arguments(chunk_limit: int):
    return spec_arguments(CHUNK_INPUTS, C=chunk_limit)


def with_constraints(variant: Variant, vocab_padded: int) -> Variant:
    """``variant`` with the structured-output inputs (``catalog.buffers.CONSTRAINT_INPUTS``) appended, when its
    operation samples one position per lane; other variants are returned unchanged."""
    if variant.operation not in CONSTRAINED_OPERATIONS:
        return variant
    lanes = lane_count(variant.operation, variant.capacity)
    decls, bindings = spec_arguments(CONSTRAINT_INPUTS, capacity=lanes, VOCAB_WORDS=bitmask_words(vocab_padded))
    variant.arguments = variant.arguments + decls
    variant.bindings = variant.bindings | bindings
    return variant


def with_block_tables(variant: Variant, num_slots: int, max_seq_len: int, block_size: int,
                      dynamic: bool = True, window: bool = False) -> Variant:
    """``variant`` with ``block_tables`` appended (``catalog.buffers.PAGED_INPUTS``): every variant of a core whose
    caches include the pools of blocks takes every slot's table, ``[num_slots, ceil(max_seq_len / block_size)]``;
    ``window``: the core has sliding-window pools too, whose tables follow (``WINDOW_PAGED_INPUTS``).
    ``dynamic``: its graph takes a pool of any block count up to the declared one (``layout["dynamic_blocks"]``,
    exporter/tracing.py); compiled packages fix it."""
    decls, bindings = spec_arguments(PAGED_INPUTS + (WINDOW_PAGED_INPUTS if window else ()), num_slots=num_slots,
                                     max_blocks=max_blocks(max_seq_len, block_size))
    variant.arguments = variant.arguments + decls
    variant.bindings = variant.bindings | bindings
    if dynamic:
        variant.layout[DYNAMIC_BLOCKS] = True
    return variant


def next_tokens_return(capacity: int) -> list[BufferDecl]:
    """The one return value of every sampling graph: each lane's emitted token, -1 where none."""
    return [BufferDecl("next_tokens", "int64", [capacity], Role.OUTPUT)]


def prefill_family(chunk_limit: int, token_capacity: int, logprob_outputs: LogprobOutputs | None, scored: bool):
    """Identity and outputs of a prefill-family variant.

    ``prefill.t{C}`` is PREFILL with one lane; ``scored.t{C}`` is SCORED_PREFILL of row capacity C
    and adds the prompt-scoring buffers. Returns (Variant identity kwargs, outputs, bindings, layout).
    """
    outputs, bindings, layout = completion_arguments(1, token_capacity, logprob_outputs)
    if scored:
        prompt, prompt_bindings, layout["prompt_logprobs"] = prompt_arguments(chunk_limit)
        outputs, bindings = outputs + prompt, bindings | prompt_bindings
    identity = {"name": f"{'scored' if scored else 'prefill'}.t{chunk_limit}",
                "operation": Operation.SCORED_PREFILL if scored else Operation.PREFILL,
                "capacity": chunk_limit if scored else 1}
    return identity, outputs, bindings, layout


def verify_family(draft_tokens: int, capacity: int, token_capacity: int, logprob_outputs: LogprobOutputs | None):
    """Identity, extra inputs, bindings, outputs and layout of ``verify.s{S}.c{capacity}`` (SPECULATIVE_VERIFY).

    Returns (identity kwargs, lane + draft inputs, their bindings, completion outputs, output bindings,
    layout, returns). The one return is each lane's emitted tokens, ``int64 [capacity, S+1]``, -1 past the prefix.
    """
    lanes, lane_bindings = spec_arguments(LANE_INPUTS, capacity=capacity)
    drafts, draft_bindings = spec_arguments(SPECULATIVE_INPUTS, capacity=capacity, S=draft_tokens)
    outputs, output_bindings, layout = completion_arguments(capacity, token_capacity, logprob_outputs)
    layout["speculative"] = {"draft_tokens": draft_tokens, "positions": draft_tokens + 1, "drafts": DRAFT_TOKENS}
    identity = {"name": f"verify.s{draft_tokens}.c{capacity}", "operation": Operation.SPECULATIVE_VERIFY,
                "capacity": capacity}
    returns = [BufferDecl("next_tokens", "int64", [capacity, draft_tokens + 1], Role.OUTPUT)]
    return identity, lanes + drafts, lane_bindings | draft_bindings, outputs, output_bindings, layout, returns


def mixed_capacities(options: ExportOptions) -> list[int]:
    """Capacities of the mixed variants: every decode capacity that holds a prompt lane and a decode lane."""
    return [c for c in options.capacities if c >= 2] if options.mixed else []


def mixed_family(chunk_limit: int, capacity: int, token_capacity: int, logprob_outputs: LogprobOutputs | None):
    """Identity, lane + chunk + prompt-lane inputs, bindings, outputs (shared bundle, then the role frames),
    output bindings and layout of ``mixed.t{C}.c{capacity}`` (MIXED)."""
    lanes, lane_bindings = spec_arguments(LANE_INPUTS, capacity=capacity)
    chunk, chunk_bindings = spec_arguments(CHUNK_INPUTS, C=chunk_limit)
    outputs, output_bindings, layout = completion_arguments(capacity, token_capacity, logprob_outputs)
    shared = {d.name: d for d in outputs}
    roles = []  # each role's private frames: the shared bundle's shapes
    for records, logprobs in ROLE_FRAMES.values():
        roles.append(BufferDecl(records, shared[RECORDS].dtype, list(shared[RECORDS].shape), Role.OUTPUT))
        if LOGPROBS in shared:
            roles.append(BufferDecl(logprobs, shared[LOGPROBS].dtype, list(shared[LOGPROBS].shape), Role.OUTPUT))
    prompt_lane, prompt_lane_bindings = spec_arguments(MIXED_BUFFERS[:1])
    layout["mixed"] = {"prompt_lane": PROMPT_LANE, "merge": "active_frame",
                       "roles": {role: {"records": records, "logprobs": logprobs if LOGPROBS in shared else None}
                                 for role, (records, logprobs) in ROLE_FRAMES.items()}}
    identity = {"name": f"mixed.t{chunk_limit}.c{capacity}", "operation": Operation.MIXED, "capacity": capacity}
    return (identity, lanes + chunk + prompt_lane, lane_bindings | chunk_bindings | prompt_lane_bindings,
            outputs + roles, output_bindings, layout)
