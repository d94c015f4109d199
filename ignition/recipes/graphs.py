"""Prefill and decode graph modules of the decoder recipes (Qwen3, Llama, Qwen3-MoE, DeepSeek-V3).

Each module's ``forward(buffers)`` reads only the dict of declared arguments and returns
``(next_tokens int64[capacity],)``. The model itself is a ``Decoder`` function of the recipe's
family (GQA or MLA) over the config's cache buffers. One sampling round, in order:

1. the decoder writes the KV cache cells (K/V, or MLA's latent and rope key) of valid rows;
2. the lm_head gives the *raw* logits (model dtype), never modified afterwards;
3. ``sample`` draws from a float32 copy with the structured-output constraints (bitmask, logit bias:
   ``components/constraints.py``, when the variant declares them) and the slot's penalty state;
4. ``commit_sampling_round`` writes the ABI6 records and reduces logprobs from the raw logits;
5. emitted tokens are counted into the slot's penalty state.

Penalty state is one runtime-owned ``int32 [num_slots, 2, vocab_padded]`` tensor: plane
``PROMPT_PLANE`` counts prompt tokens (repetition penalty), plane ``OUTPUT_PLANE`` counts
emitted tokens (all three penalties). A prefill chunk at ``chunk_start == 0`` resets its slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ignition.catalog.buffers import (BLOCK_TABLES, DRAFT_TOKENS, KEY_WINDOW, PACKED_TOKENS, PROMPT_LOGPROBS, PROMPT_TARGETS,
                                     SAMPLE_WINDOW, SEGMENT_EMITS, SEGMENT_LENGTHS, SEGMENT_STARTS, SEGMENT_WINDOW,
                                     TRANSFORM_WINDOW, WINDOW_BLOCK_TABLES)
from ignition.catalog.enums import Operation, Role
from ignition.catalog.geometry import FP32_STATE, OUTPUT_PLANE, PAGED_STATE, PENALTY_COUNTS, PROMPT_PLANE, state_shape
from ignition.catalog.model import BufferDecl
from ignition.components.commit import commit_sampling_round, prompt_round_kind
from ignition.components.constraints import sampling_logits
from ignition.components.merge import merge_role_frames, prompt_lanes, role_buffers
from ignition.components.prompt_scoring import score_hidden_rows
from ignition.components.vocabulary_logprobs import score_hidden_rows_sharded
from ignition.components.sampling import (SamplingTensors, filtered_distribution, narrows, sample,
                                          update_output_counts, window_columns)
from ignition.components.speculative import (accept_draft, commit_speculative_round, draft_output_counts, row_sampling,
                                             verify_rows)
from ignition.recipes.layers import Rows
from ignition.recipes.linear_attention import ACCEPTED_STATES
from ignition.recipes.transformer import gqa_decoder, lm_head_logits, sampled_row_logits

Decoder = Callable[[Mapping[str, torch.Tensor], Any, torch.Tensor, Rows, Mapping[str, torch.Tensor]], torch.Tensor]
"""``(weights, cfg, input_ids [R], rows, caches by name) -> final-normed hidden [R, d_model]``."""


def penalty_history(penalty: torch.Tensor, slots: torch.Tensor, transform: torch.Tensor | None) -> torch.Tensor:
    """The penalty counts of the lanes' ``slots`` (clamped): ``int32 [capacity, 2, T]``, the columns the
    ``transform_window`` bounds (every column without one): only the penalties' columns are copied."""
    if not narrows(transform, penalty.shape[2]):
        return penalty.index_select(0, slots)
    columns = window_columns(transform, penalty.shape[2])  # [T]
    planes = torch.arange(penalty.shape[1], device=penalty.device)
    return penalty[slots.view(-1, 1, 1), planes.view(1, -1, 1), columns.view(1, 1, -1)]  # one gather of the cells


def paged(cfg) -> bool:
    """Whether the config's caches include the pools of blocks (``catalog.geometry.PAGED_STATE``)."""
    return any(name in PAGED_STATE for name in cfg.cache_names)


def state_declarations(cfg, dtype: torch.dtype, num_slots: int, max_seq_len: int,
                       vocab_padded: int, block_size: int | None = None) -> list[BufferDecl]:
    """The runtime-owned state every decoder variant reads and updates, in argument order: the config's
    caches (``[layers, num_slots, max_seq_len, ...]``, the pools ``[layers, kv_blocks, block_size, ...]`` at the
    declared upper bound, in the model dtype; ``FP32_STATE`` in FP32), then the penalty counts."""
    cache_dtype = str(dtype).removeprefix("torch.")
    shapes = cfg.cache_shapes(num_slots, max_seq_len, block_size) if paged(cfg) else \
        cfg.cache_shapes(num_slots, max_seq_len)
    caches = [BufferDecl(name, "float32" if name in FP32_STATE else cache_dtype, list(shape), Role.STATE)
              for name, shape in shapes.items()]
    penalty = state_shape(PENALTY_COUNTS, num_slots=num_slots, vocab_padded=vocab_padded)
    return caches + [BufferDecl(PENALTY_COUNTS, "int32", penalty, Role.STATE)]


class _DecoderGraph(torch.nn.Module):
    """What prefill and decode share: weight naming, the decoder call and steps 3-5 of a sampling round."""

    def __init__(self, cfg, vocab_size: int, k: int, decoder: Decoder = gqa_decoder, parallel=None):
        """``parallel``: a ``recipes.sharding.TensorParallel`` when this graph is one rank of a sharded core."""
        super().__init__()
        self.cfg, self.vocab_size, self.k, self.decoder, self.parallel = cfg, vocab_size, k, decoder, parallel

    def hidden(self, weights: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
               input_ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Step 1: run the decoder over the state caches; final-normed hidden ``[R, d_model]``."""
        caches = {name: buffers[name] for name in self.cfg.cache_names}
        if self.parallel is not None:
            return self.decoder(weights, self.cfg, input_ids, rows, caches, parallel=self.parallel)
        return self.decoder(weights, self.cfg, input_ids, rows, caches)

    def weights(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weight arguments under the decoder's names; a tied lm_head is the embedding itself."""
        weights = dict(buffers)
        if self.cfg.tie_word_embeddings:
            weights["lm_head"] = buffers["embed"]
        return weights

    def sample_and_commit(self, buffers: Mapping[str, torch.Tensor], raw_logits: torch.Tensor,
                          slots: torch.Tensor, operation: Operation, sequence_lengths: torch.Tensor,
                          emits: torch.Tensor | None = None, idle_round_kind=None) -> torch.Tensor:
        """Steps 3-5 for ``raw_logits [capacity, vocab_padded]`` of lanes in ``slots int64[capacity]``."""
        penalty = buffers[PENALTY_COUNTS]  # int32 [S, 2, V]
        safe_slots = slots.clamp(0, penalty.shape[0] - 1)
        history = penalty_history(penalty, safe_slots, buffers.get(TRANSFORM_WINDOW))  # [capacity, 2, T]
        # NOTE: sampling's penalties, top-k/top-p and Philox draw need each sampled row's whole vocabulary, so a
        # sharded graph gathers those rows; the logprob reduction below keeps the shard (two compact exchanges).
        if self.parallel is None and raw_logits.dtype != torch.float32:
            # one float32 row for sampling and the logprob reduction: sampling converts BF16/FP16 rows anyway
            # (``transformed_row``) and puts the raw values back before ``sample`` returns, so the reduction reads the
            # same numbers (the conversion is exact) without converting them chunk by chunk, and its maxima and
            # minimum run over float32 (torch's CPU reductions over BF16 convert lane by lane); FP32 graphs unchanged
            raw_logits = raw_logits.to(torch.float32)
        full_logits = raw_logits if self.parallel is None else self.parallel.gather_vocab(raw_logits)
        sampled = sample(full_logits, history[:, OUTPUT_PLANE], history[:, PROMPT_PLANE] > 0,
                         SamplingTensors.from_buffers(buffers), self.vocab_size, buffers.get(SAMPLE_WINDOW),
                         buffers.get(TRANSFORM_WINDOW), lambda part, columns: sampling_logits(buffers, part, columns))
        tokens = commit_sampling_round(buffers, raw_logits, sampled, operation=operation, vocab_size=self.vocab_size,
                                       k=self.k, sequence_lengths=sequence_lengths, emits=emits,
                                       idle_round_kind=idle_round_kind,
                                       vocabulary=None if self.parallel is None else self.parallel.vocabulary)
        # tokens is -1 for lanes that emitted nothing; forced tokens are output tokens and count.
        update_output_counts(penalty.select(1, OUTPUT_PLANE), safe_slots, tokens, tokens >= 0)
        return tokens


class DecodeGraph(_DecoderGraph):
    """One token per active lane: ``decode.c{capacity}``."""

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        weights = self.weights(buffers)
        positions, slots = buffers["positions"], buffers["slot_ids"]  # int64 [capacity]
        active = buffers["active_lanes"] != 0
        rows = Rows.decode(positions, slots, active, buffers.get(KEY_WINDOW), buffers.get(BLOCK_TABLES),
                           buffers.get(WINDOW_BLOCK_TABLES))
        hidden = self.hidden(weights, buffers, buffers["input_ids"], rows)  # [capacity, d_model]
        raw_logits = lm_head_logits(weights, self.cfg, hidden)  # [capacity, vocab_padded]
        return (self.sample_and_commit(buffers, raw_logits, slots, Operation.DECODE, positions + 1),)


class PrefillGraph(_DecoderGraph):
    """One request's prompt chunk of up to C rows: ``prefill.t{C}`` (capacity 1).

    Valid rows (``< chunk_length``, lane active) write the cache at ``chunk_start + row``. A chunk at
    ``chunk_start == 0`` resets the slot's penalty state; every chunk counts its prompt tokens.
    With ``chunk_emits != 0`` the last valid row's raw logits sample the first generated token
    (round kind SAMPLING); otherwise the active lane gets a records-only ADMISSION record (the chunk at
    ``chunk_start == 0``) or PROMPT record (a later chunk), without a token or payload.
    """

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return self.prefill_chunk(buffers, score=False)

    def prefill_chunk(self, buffers: dict[str, torch.Tensor], score: bool) -> tuple[torch.Tensor]:
        weights = self.weights(buffers)
        chunk_ids = buffers["chunk_input_ids"]  # int64 [C]
        chunk_start, chunk_length = buffers["chunk_start"], buffers["chunk_length"]  # int64 [1]
        slot = buffers["slot_ids"]  # int64 [1]
        active = buffers["active_lanes"] != 0  # bool [1]
        valid_length = torch.where(active, chunk_length, 0)  # an inactive lane writes nothing
        hidden = self.hidden(weights, buffers, chunk_ids, Rows.prefill(
            chunk_ids.shape[0], chunk_start, valid_length, slot, buffers.get(KEY_WINDOW),
            buffers.get(BLOCK_TABLES), buffers.get(WINDOW_BLOCK_TABLES)))  # [C, d_model]
        if score and self.parallel is not None:  # the same, over this rank's vocabulary shard
            score_hidden_rows_sharded(self.parallel.vocabulary, hidden, buffers[PROMPT_TARGETS],
                                      buffers[PROMPT_LOGPROBS], buffers["frame_index"],
                                      lambda rows: lm_head_logits(weights, self.cfg, rows))
        elif score:  # every row scores its next prompt token, projecting 64 hidden rows at a time
            score_hidden_rows(hidden, buffers[PROMPT_TARGETS], buffers[PROMPT_LOGPROBS], buffers["frame_index"],
                              lambda rows: lm_head_logits(weights, self.cfg, rows), self.vocab_size)
        last_row = (chunk_length - 1).clamp(0, chunk_ids.shape[0] - 1)  # [1]
        raw_logits = sampled_row_logits(weights, self.cfg, hidden, last_row)  # [1, vocab_padded]
        self.count_prompt_tokens(buffers[PENALTY_COUNTS], slot, chunk_ids, valid_length,
                                 reset=active & (chunk_start == 0))
        tokens = self.sample_and_commit(buffers, raw_logits, slot, Operation.PREFILL, chunk_start + chunk_length,
                                        emits=buffers["chunk_emits"] != 0,
                                        idle_round_kind=prompt_round_kind(chunk_start))
        return (tokens,)

    @staticmethod
    def count_prompt_tokens(penalty: torch.Tensor, slot: torch.Tensor, chunk_ids: torch.Tensor,
                            valid_length: torch.Tensor, reset: torch.Tensor) -> None:
        """Reset the slot's planes when ``reset``; add the chunk's valid tokens to its prompt plane."""
        num_slots, _, width = penalty.shape
        safe_slot = slot.clamp(0, num_slots - 1)  # [1]
        history = torch.where(reset.view(1, 1, 1), 0, penalty.index_select(0, safe_slot))  # [1, 2, V]
        valid = torch.arange(chunk_ids.shape[0], device=chunk_ids.device) < valid_length  # [C]
        hits = torch.zeros(width, dtype=penalty.dtype, device=penalty.device).index_add(
            0, chunk_ids.clamp(0, width - 1), valid.to(penalty.dtype))  # [V]
        history[:, PROMPT_PLANE] += hits  # history is a fresh tensor (torch.where), not a view of the state
        penalty.index_put_((safe_slot,), history)


class ScoredPrefillGraph(PrefillGraph):
    """``scored.t{C}`` (SCORED_PREFILL): prefill that also writes ``prompt_logprobs[frame, :C]``.

    It advances exactly the same KV and penalty state as ``PrefillGraph`` and may sample the
    final chunk's next token through the completion contract.
    """

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return self.prefill_chunk(buffers, score=True)


class PackedPrefillGraph(PrefillGraph):
    """``packed.t{C}.c{capacity}`` (PACKED_PREFILL): the next prompt chunk of up to ``capacity`` requests at once.

    Lane b's chunk (its segment, at most C rows) is ``segment_lengths[b]`` rows of ``packed_input_ids`` after the
    chunks of lanes ``< b``, at positions ``segment_starts[b]..`` of its slot. Each lane's round is the one
    ``prefill.t{C}`` runs for that chunk, with the same FP32 ops per row: every row writes its cache cell,
    attends over its own slot's window only (``recipes/packed_attention.py``), the lm_head
    projects each lane's last valid row as prefill projects its one (``sampled_row_logits``), the slot's penalty state
    is reset at ``segment_starts == 0`` and counts the chunk's tokens, and the lane samples (SAMPLING) when
    ``segment_emits != 0`` or writes its ADMISSION or PROMPT record. Records carry operation PREFILL.
    """

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        weights = self.weights(buffers)
        packed = buffers[PACKED_TOKENS]  # int64 [R]
        starts, slots = buffers[SEGMENT_STARTS], buffers["slot_ids"]  # int64 [capacity]
        active = buffers["active_lanes"] != 0
        lengths = torch.where(active, buffers[SEGMENT_LENGTHS], 0)  # an inactive lane has no rows
        rows = Rows.packed(packed.shape[0], starts, lengths, slots, buffers[SEGMENT_WINDOW], buffers.get(KEY_WINDOW),
                           buffers.get(BLOCK_TABLES), buffers.get(WINDOW_BLOCK_TABLES))
        hidden = self.hidden(weights, buffers, packed, rows)  # [R, d_model]
        last_rows = (rows.segments.offsets + lengths - 1).clamp(0, packed.shape[0] - 1)  # [capacity]
        # NOTE: the lanes' rows projected as prefill projects its one row (``sampled_row_logits``: the same product
        # shape), so each lane's logits and logprobs are the serial path's bits
        raw_logits = sampled_row_logits(weights, self.cfg, hidden, last_rows)  # [capacity, vocab_padded]
        self.count_segment_tokens(buffers[PENALTY_COUNTS], slots, packed, rows, active, reset=active & (starts == 0))
        tokens = self.sample_and_commit(buffers, raw_logits, slots, Operation.PREFILL, starts + buffers[SEGMENT_LENGTHS],
                                        emits=buffers[SEGMENT_EMITS] != 0, idle_round_kind=prompt_round_kind(starts))
        return (tokens,)

    @staticmethod
    def count_segment_tokens(penalty: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor, rows: Rows,
                             active: torch.Tensor, reset: torch.Tensor) -> None:
        """Per active lane: reset its slot's planes when ``reset``, add its segment's valid tokens to the prompt plane.

        One ``index_put_`` writes every lane's planes; an inactive lane repeats the first active lane's write (same
        slot, same values), so duplicate targets always carry identical values."""
        num_slots, _, width = penalty.shape
        lanes = slots.shape[0]
        safe_slots = slots.clamp(0, num_slots - 1)  # [capacity]
        history = torch.where(reset.view(-1, 1, 1), 0, penalty.index_select(0, safe_slots))  # [capacity, 2, V]
        hits = torch.zeros(lanes, width, dtype=penalty.dtype, device=penalty.device).index_put_(
            (rows.segments.row_lanes, packed.clamp(0, width - 1)), rows.valid.to(penalty.dtype), accumulate=True)
        history[:, PROMPT_PLANE] += hits  # history is a fresh tensor (torch.where), not a view of the state
        first_active = torch.argmax(active.to(torch.int32))
        source = torch.where(active, torch.arange(lanes, device=slots.device), first_active)  # [capacity]
        penalty.index_put_((safe_slots.index_select(0, source),), history.index_select(0, source))


class VerifyGraph(_DecoderGraph):
    """``verify.s{S}.c{capacity}`` (SPECULATIVE_VERIFY): the target scores S+1 positions per lane.

    Every valid row writes its cache cell (rows past a lane's proposal write nothing); cells of rejected
    drafts stay behind the lane's new length and are overwritten before any row can attend to them.
    Row j samples with the penalty counts the lane would have after emitting ``d[0..j-1]``.
    See ``ignition.components.speculative`` for acceptance, the commit and the speculative writer.
    """

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        weights = self.weights(buffers)
        tokens, positions, valid, draft_lengths = verify_rows(buffers)  # [capacity, P] x3, [capacity]
        capacity, width = tokens.shape
        slots = buffers["slot_ids"]  # int64 [capacity]
        rows = Rows(positions=positions.reshape(-1), write_slots=slots.repeat_interleave(width),
                    valid=valid.reshape(-1), read_slots=slots, key_window=buffers.get(KEY_WINDOW),
                    row_forwards=True, block_tables=buffers.get(BLOCK_TABLES),
                    window_tables=buffers.get(WINDOW_BLOCK_TABLES))  # one attention group of P rows per lane, each row a decode step's
        hidden = self.hidden(weights, buffers, tokens.reshape(-1), rows)  # [capacity * P, d_model]
        raw_logits = lm_head_logits(weights, self.cfg, hidden)  # [capacity * P, vocab_padded]
        penalty = buffers[PENALTY_COUNTS]  # int32 [S, 2, V]
        safe_slots = slots.clamp(0, penalty.shape[0] - 1)
        history = penalty_history(penalty, safe_slots, buffers.get(TRANSFORM_WINDOW))  # [capacity, 2, T]
        params = row_sampling(SamplingTensors.from_buffers(buffers), width)
        greedy, sorted_ids, probs = filtered_distribution(
            raw_logits, draft_output_counts(history[:, OUTPUT_PLANE], tokens),
            (history[:, PROMPT_PLANE] > 0).repeat_interleave(width, dim=0), params, self.vocab_size,
            buffers.get(SAMPLE_WINDOW), buffers.get(TRANSFORM_WINDOW))
        accepted, counts = accept_draft(greedy, buffers[DRAFT_TOKENS], draft_lengths, params, sorted_ids, probs)
        emitted = commit_speculative_round(buffers, raw_logits, accepted, counts, vocab_size=self.vocab_size, k=self.k)
        for keep in rows.plans.get(ACCEPTED_STATES, ()):  # a recurrent layer keeps the state of each lane's last
            keep((emitted >= 0).sum(1))  # accepted row (recipes/linear_attention.py), rejected rows' dropped
        flat = emitted.reshape(-1)  # forced tokens are output tokens and count, like a decode round's
        update_output_counts(penalty.select(1, OUTPUT_PLANE), safe_slots.repeat_interleave(width), flat, flat >= 0)
        return (emitted,)


class MixedGraph(PrefillGraph):
    """``mixed.t{C}.c{capacity}`` (MIXED): one prompt chunk and decode lanes in one graph.

    The prompt role is lane ``mixed_prompt_lane``: its chunk (the chunk inputs) runs exactly as ``prefill.t{C}``
    runs it, over the lane's slot; the decode role is every other active lane, run as ``decode.c{capacity}``
    runs them. Each role samples and commits into its private frames; ``merge_role_frames`` then copies the
    active frame of each lane's role into the shared bundle (components/merge.py).
    """

    def forward(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        weights = self.weights(buffers)
        in_prompt = prompt_lanes(buffers)  # bool [capacity]
        capacity = in_prompt.shape[0]
        active = buffers["active_lanes"] != 0
        slots = buffers["slot_ids"]  # int64 [capacity]
        lane = buffers["mixed_prompt_lane"].clamp(0, capacity - 1)  # [1]
        slot = slots.index_select(0, lane)  # [1]: the prompt lane's slot
        prompt_active = (buffers["mixed_prompt_lane"] >= 0) & active.index_select(0, lane)  # [1]
        chunk_ids, start, length = buffers["chunk_input_ids"], buffers["chunk_start"], buffers["chunk_length"]
        valid_length = torch.where(prompt_active, length, 0)
        hidden = self.hidden(weights, buffers, chunk_ids, Rows.prefill(chunk_ids.shape[0], start, valid_length, slot,
                                                                      buffers.get(KEY_WINDOW),
                                                                      buffers.get(BLOCK_TABLES),
                                                                      buffers.get(WINDOW_BLOCK_TABLES)))
        last_row = (length - 1).clamp(0, chunk_ids.shape[0] - 1)  # [1]
        prompt_logits = sampled_row_logits(weights, self.cfg, hidden, last_row)  # [1, vocab_padded], as prefill's
        self.count_prompt_tokens(buffers[PENALTY_COUNTS], slot, chunk_ids, valid_length,
                                 reset=prompt_active & (start == 0))
        decode_lanes = active & ~in_prompt
        decode_hidden = self.hidden(weights, buffers, buffers["input_ids"],
                                    Rows.decode(buffers["positions"], slots, decode_lanes,
                                                buffers.get(KEY_WINDOW),
                                                block_tables=buffers.get(BLOCK_TABLES),
                                                window_tables=buffers.get(WINDOW_BLOCK_TABLES)))  # [capacity, d_model]
        decode_logits = lm_head_logits(weights, self.cfg, decode_hidden)  # [capacity, vocab_padded]
        prompt = self.sample_and_commit(role_buffers(buffers, "prompt", in_prompt),
                                        prompt_logits.expand(capacity, -1), slots, Operation.MIXED,
                                        (start + length).expand(capacity),
                                        emits=(buffers["chunk_emits"] != 0).expand(capacity),
                                        idle_round_kind=prompt_round_kind(start).expand(capacity))
        decode = self.sample_and_commit(role_buffers(buffers, "decode", ~in_prompt), decode_logits, slots,
                                        Operation.MIXED, buffers["positions"] + 1)
        merge_role_frames(buffers, in_prompt)
        return (torch.where(in_prompt, prompt, decode),)
