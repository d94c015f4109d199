"""The toy recipe: a bigram language model (embedding -> lm_head) with greedy decode graphs.

Small enough to export in seconds, real enough to exercise the whole contract: padded
vocabulary lanes, ABI6 records, both frames, natural alternatives and explicit IDs.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from ignition.catalog.buffers import PROMPT_LOGPROBS, PROMPT_TARGETS
from ignition.catalog.contract import resolve_completion_token_capacity, scored_capacities
from ignition.catalog.enums import Operation
from ignition.catalog.model import Variant
from ignition.components.commit import commit_sampling_round, prompt_round_kind
from ignition.components.constraints import sampling_logits
from ignition.components.prompt_scoring import score_hidden_rows
from ignition.components.merge import merge_role_frames, prompt_lanes, role_buffers
from ignition.components.speculative import accept_draft, commit_speculative_round, verify_rows
from ignition.recipes.base import (ExportOptions, GraphBuild, RecipeBuild, RecipeError, chunk_arguments,
                                   completion_arguments, lane_arguments, mixed_capacities, mixed_family,
                                   next_tokens_return, prefill_family, verify_family, weight_arguments,
                                   with_constraints)
from ignition.recipes.tokenizer import tokenizer_dir

VOCAB_SIZE = 250
VOCAB_PADDED = 256  # padded lanes exist on purpose: they must never enter a result
HIDDEN = 32
WEIGHT_NAMES = ("embedding.weight", "lm_head.weight")


def batch_invariant_logits(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """hidden @ lm_head.T with a per-row reduction order that does not depend on the batch.

    NOTE: BLAS picks different kernels for 1 and 4 rows, which changes the last ulp; the toy
    model avoids that so tests can demand bit-identical results alone and in a batch.
    """
    return (hidden.float().unsqueeze(1) * lm_head.float().unsqueeze(0)).sum(dim=-1)


class ToyGraph(torch.nn.Module):
    """Greedy sampling from the bigram logits of ``token_ids`` (under the structured-output constraints when the
    variant declares them), then the shared commit, which reduces logprobs from the raw logits."""

    def __init__(self, vocab_size: int, k: int):
        super().__init__()
        self.vocab_size, self.k = vocab_size, k

    def commit(self, buffers, token_ids, operation, sequence_lengths, emits=None, idle_round_kind=None):
        embedding, lm_head = buffers["embedding.weight"], buffers["lm_head.weight"]
        hidden = embedding[token_ids.clamp(0, embedding.shape[0] - 1)]  # [rows, hidden]
        logits = batch_invariant_logits(hidden, lm_head)  # raw logits: [rows, vocab_padded]
        sampled = sampling_logits(buffers, logits)[:, :self.vocab_size].argmax(dim=1)  # greedy, first maximum on ties
        return (commit_sampling_round(buffers, logits, sampled, operation=operation, vocab_size=self.vocab_size,
                                      k=self.k, sequence_lengths=sequence_lengths, emits=emits,
                                      idle_round_kind=idle_round_kind),)


class ToyDecode(ToyGraph):
    def forward(self, buffers: dict[str, torch.Tensor]):
        return self.commit(buffers, buffers["input_ids"], Operation.DECODE, buffers["positions"] + 1)


class ToyPrefill(ToyGraph):
    """One request's prompt chunk: the bigram needs only the last valid row's token."""

    def forward(self, buffers: dict[str, torch.Tensor]):
        chunk = buffers["chunk_input_ids"]  # [C]
        last_row = (buffers["chunk_length"] - 1).clamp(0, chunk.shape[0] - 1)  # [1]
        return self.commit(buffers, chunk.index_select(0, last_row), Operation.PREFILL,
                           buffers["chunk_start"] + buffers["chunk_length"], emits=buffers["chunk_emits"] != 0,
                           idle_round_kind=prompt_round_kind(buffers["chunk_start"]))


class ToyScoredPrefill(ToyPrefill):
    """Prefill that also scores every prompt row (64 hidden rows projected at a time)."""

    def forward(self, buffers: dict[str, torch.Tensor]):
        embedding, lm_head = buffers["embedding.weight"], buffers["lm_head.weight"]
        chunk = buffers["chunk_input_ids"].clamp(0, embedding.shape[0] - 1)  # [C]
        score_hidden_rows(embedding[chunk], buffers[PROMPT_TARGETS], buffers[PROMPT_LOGPROBS],
                          buffers["frame_index"], lambda rows: batch_invariant_logits(rows, lm_head), self.vocab_size)
        return super().forward(buffers)


class ToyVerify(ToyGraph):
    """``verify.s{S}.c{capacity}``: greedy acceptance of each lane's proposal against the bigram logits."""

    def forward(self, buffers: dict[str, torch.Tensor]):
        embedding, lm_head = buffers["embedding.weight"], buffers["lm_head.weight"]
        tokens, _, _, draft_lengths = verify_rows(buffers)  # [capacity, P]
        hidden = embedding[tokens.reshape(-1).clamp(0, embedding.shape[0] - 1)]  # [capacity * P, hidden]
        logits = batch_invariant_logits(hidden, lm_head)  # raw logits: [capacity * P, vocab_padded]
        greedy = logits[:, :self.vocab_size].argmax(dim=1)  # the decode graphs' rule: first maximum
        accepted, counts = accept_draft(greedy, buffers["draft_token_ids"], draft_lengths)
        return (commit_speculative_round(buffers, logits, accepted, counts, vocab_size=self.vocab_size, k=self.k),)


class ToyMixed(ToyGraph):
    """``mixed.t{C}.c{capacity}``: the prompt role (lane ``mixed_prompt_lane``, the chunk inputs) and the decode role
    (every other lane) commit into private frames; the merge copies the active frame of each lane's role."""

    def forward(self, buffers: dict[str, torch.Tensor]):
        in_prompt = prompt_lanes(buffers)  # bool [capacity]
        chunk, start, length = buffers["chunk_input_ids"], buffers["chunk_start"], buffers["chunk_length"]
        last_token = chunk.index_select(0, (length - 1).clamp(0, chunk.shape[0] - 1))  # [1]
        capacity = in_prompt.shape[0]
        (prompt,) = self.commit(role_buffers(buffers, "prompt", in_prompt), last_token.expand(capacity),
                                Operation.MIXED, (start + length).expand(capacity),
                                emits=(buffers["chunk_emits"] != 0).expand(capacity),
                                idle_round_kind=prompt_round_kind(start).expand(capacity))
        (decode,) = self.commit(role_buffers(buffers, "decode", ~in_prompt), buffers["input_ids"], Operation.MIXED,
                                buffers["positions"] + 1)
        merge_role_frames(buffers, in_prompt)
        return (torch.where(in_prompt, prompt, decode),)


def load_weights(options: ExportOptions) -> dict[str, torch.Tensor]:
    if options.checkpoint is None:
        generator = torch.Generator().manual_seed(options.seed)
        return {
            "embedding.weight": torch.randn(VOCAB_PADDED, HIDDEN, generator=generator),
            "lm_head.weight": torch.randn(VOCAB_PADDED, HIDDEN, generator=generator) * 0.5,
        }
    path = options.checkpoint
    if not path.is_file():
        raise RecipeError(f"toy checkpoint {path}: expected a .safetensors file with {', '.join(WEIGHT_NAMES)}")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(WEIGHT_NAMES):
                raise RecipeError(f"toy checkpoint {path}: expected tensors {sorted(WEIGHT_NAMES)}, found {sorted(names)}")
            weights = {name: f.get_tensor(name).float().contiguous() for name in WEIGHT_NAMES}
    except RecipeError:
        raise
    except Exception as exc:  # safetensors raises several types for corrupt headers
        raise RecipeError(f"toy checkpoint {path}: not a readable safetensors file ({exc})") from None
    for name, tensor in weights.items():
        if tensor.dim() != 2 or tensor.shape[0] != VOCAB_PADDED or tensor.shape[1] != weights["embedding.weight"].shape[1]:
            raise RecipeError(f"toy checkpoint {path}: tensor {name} has shape {list(tensor.shape)}, "
                              f"expected [{VOCAB_PADDED}, hidden]")
    return weights


def prefill_graph(weights, chunk_limit: int, token_capacity: int, logprob_outputs, module,
                  scored: bool = False) -> GraphBuild:
    lanes, lane_bindings = lane_arguments(1)
    chunk, chunk_bindings = chunk_arguments(chunk_limit)
    identity, outputs, output_bindings, layout = prefill_family(chunk_limit, token_capacity, logprob_outputs, scored)
    variant = Variant(**identity, arguments=weight_arguments(weights) + lanes + chunk + outputs,
                      returns=next_tokens_return(1), bindings=lane_bindings | chunk_bindings | output_bindings,
                      layout=layout)
    return GraphBuild(variant, module)


def toy_tokenizer(directory):
    if directory is None:
        return None
    if not (directory / "tokenizer.json").is_file():
        raise RecipeError(f"tokenizer directory {directory}: expected tokenizer.json")
    return tokenizer_dir(directory, required=True, vocab_size=VOCAB_SIZE)


def build(options: ExportOptions) -> RecipeBuild:
    weights = load_weights(options)
    token_capacity = resolve_completion_token_capacity(options.completion_token_capacity)
    k = options.outputs.k if options.outputs else 0
    graphs = []
    for capacity in options.capacities:
        lanes, lane_bindings = lane_arguments(capacity)
        outputs, output_bindings, layout = completion_arguments(capacity, token_capacity, options.outputs)
        variant = Variant(
            name=f"decode.c{capacity}",
            operation=Operation.DECODE,
            capacity=capacity,
            arguments=weight_arguments(weights) + lanes + outputs,
            returns=next_tokens_return(capacity),
            bindings=lane_bindings | output_bindings,
            layout=layout,
        )
        graphs.append(GraphBuild(variant, ToyDecode(VOCAB_SIZE, k)))
    graphs.append(prefill_graph(weights, options.chunk_limit, token_capacity, options.outputs, ToyPrefill(VOCAB_SIZE, k)))
    if options.prompt_logprobs:  # appended: the ordinary catalog keeps its shapes and order
        for capacity in scored_capacities(options.chunk_limit):
            graphs.append(prefill_graph(weights, capacity, token_capacity, options.outputs, ToyScoredPrefill(VOCAB_SIZE, k),
                                        scored=True))
    for draft_tokens in options.speculative_tokens:
        for capacity in options.capacities:
            identity, lanes, lane_bindings, outputs, output_bindings, layout, returns = verify_family(
                draft_tokens, capacity, token_capacity, options.outputs)
            variant = Variant(**identity, arguments=weight_arguments(weights) + lanes + outputs, returns=returns,
                              bindings=lane_bindings | output_bindings, layout=layout)
            graphs.append(GraphBuild(variant, ToyVerify(VOCAB_SIZE, k)))
    for capacity in mixed_capacities(options):
        identity, inputs, bindings, outputs, output_bindings, layout = mixed_family(
            options.chunk_limit, capacity, token_capacity, options.outputs)
        variant = Variant(**identity, arguments=weight_arguments(weights) + inputs + outputs,
                          returns=next_tokens_return(capacity), bindings=bindings | output_bindings, layout=layout)
        graphs.append(GraphBuild(variant, ToyMixed(VOCAB_SIZE, k)))
    if options.structured_output:  # appended last: every other argument keeps its position
        for graph in graphs:
            with_constraints(graph.variant, VOCAB_PADDED)
    return RecipeBuild(
        recipe="toy",
        model={"architecture": "bigram", "hidden_size": HIDDEN, "num_layers": 0, "dtype": "float32", "layer_kinds": []},
        vocab_size=VOCAB_SIZE,
        vocab_padded=VOCAB_PADDED,
        token_capacity=token_capacity,
        k=k,
        weights=weights,
        state=[],
        graphs=graphs,
        chunk_limit=options.chunk_limit,
        tokenizer_dir=toy_tokenizer(options.tokenizer),
    )
