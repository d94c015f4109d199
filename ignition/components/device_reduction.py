"""Which implementation of the logprob reductions runs on an accelerator.

The CPU runs the pure-torch references (``logprobs.py``; for a vocabulary shard the three stage
ops of ``vocabulary_logprobs.py``). On CUDA the ops launch kernels prepared ahead of time, through
the launcher of the core whose graph is running: each loaded core owns its launcher
(``ignition.runtime.launchers.reduction``), built from its kernel table, and binds it for the duration of
each of its graph runs (``bind_launcher``; a CUDA-graph capture records the launches it issued, so a
replay needs no binding). The op looks up the launcher bound to its tensors' device on this thread,
so two cores on one GPU (a draft core, a core with and one without logprobs) each launch their own
kernels. ``PreparedReduction`` is ``ignition::reduce_logprobs``; a ``PreparedVocabulary``'s
``statistics``, ``candidates`` and ``merge`` methods are the three generation stage ops, and those of
its ``scoring`` the three prompt-scoring stage ops. Nothing here imports Triton, so a serving
process never compiles. Just-in-time Triton is a developer opt-in (``IGNITION_TRITON_JIT=1``) for
running the ops outside a loaded core.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ignition.catalog.contract import PROMPT_ROW_WIDTH
from ignition.catalog.parallel import EXCHANGE_WORDS, SCORING_EXCHANGE_WORDS
from ignition.components.logprobs import check_reduction_args, reduce_logprobs_op
from ignition.components.vocabulary_logprobs import SCORING_STAGE_OPS, STAGE_OPS

JIT_ENV = "IGNITION_TRITON_JIT"
"""Set to 1 to let the CUDA op JIT-compile Triton when no prepared launcher is bound."""

_bound: ContextVar[tuple[tuple[torch.device, Callable], ...]] = ContextVar("ignition_bound_launchers", default=())


@contextmanager
def bind_launcher(device: torch.device, launcher: Callable):
    """Route the ops on ``device`` to ``launcher`` (same arguments as the op) in this thread while the block runs;
    the innermost binding of a device wins, and leaving the block restores the previous one."""
    token = _bound.set(_bound.get() + ((torch.device(device), launcher),))
    try:
        yield launcher
    finally:
        _bound.reset(token)


def bound_launcher(device: torch.device) -> Callable | None:
    """The launcher bound to ``device`` in this thread, or None."""
    for bound_device, launcher in reversed(_bound.get()):
        if bound_device == device:
            return launcher
    return None


def jit_opted_in() -> bool:
    return os.environ.get(JIT_ENV) == "1"


def _no_launcher(op: str, device: torch.device, load_hint: str) -> RuntimeError:
    return RuntimeError(f"ignition::{op} on {device}: no prepared kernels are loaded for this device. {load_hint} "
                        f"so its prepared cubins launch (a core binds them while its graphs run), or set {JIT_ENV}=1 "
                        f"to JIT-compile Triton (development only: serving never compiles)")


def _reduce_on_device(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k):
    launcher = bound_launcher(logits.device)
    if launcher is None:
        if not jit_opted_in():
            raise _no_launcher("reduce_logprobs", logits.device,
                               f"Run it through a core loaded with load_core(path, device='{logits.device}')")
        from ignition.components.triton_logprobs import reduce_logprobs_triton
        launcher = reduce_logprobs_triton
    check_reduction_args(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)
    launcher(logits, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, k)


reduce_logprobs_op.register_kernel("cuda")(_reduce_on_device)


# ---- the vocabulary-sharded stage ops ----------------------------------------------------------
_jit_launchers: dict[tuple[torch.device, str], object] = {}


def _jit_vocabulary():
    from ignition.components.triton_vocabulary import TritonVocabulary
    return TritonVocabulary()


def _jit_scoring():
    from ignition.components.triton_scoring import TritonScoring
    return TritonScoring()


_JIT_CLASSES = {"vocabulary": _jit_vocabulary, "scoring": _jit_scoring}
"""The JIT stage-op classes (``IGNITION_TRITON_JIT=1``), each built on first use."""


def _sharded_launcher(device: torch.device, op: str, jit_class: str, part: str | None = None):
    """The bound sharded launcher (``PreparedVocabulary``, or its attribute ``part``: ``scoring``), or with
    JIT opted in one ``_JIT_CLASSES[jit_class]`` per device (Triton is imported then, not before)."""
    launcher = bound_launcher(device)
    if launcher is None:
        if not jit_opted_in():
            raise _no_launcher(op, device, "Run it through the sharded core loaded with --device cuda")
        if (device, jit_class) not in _jit_launchers:
            _jit_launchers[(device, jit_class)] = _JIT_CLASSES[jit_class]()
        return _jit_launchers[(device, jit_class)]
    if not hasattr(launcher, part or "merge"):
        raise RuntimeError(f"ignition::{op} on {device}: the loaded core's prepared kernels are single-rank "
                           f"(ignition::reduce_logprobs); a sharded graph needs a core exported with --tensor-parallel")
    return getattr(launcher, part) if part else launcher


def _vocabulary_launcher(device: torch.device, op: str):
    """The generation stages of the bound sharded launcher (``PreparedVocabulary``), or JIT ones."""
    return _sharded_launcher(device, op, "vocabulary")


def check_stage_args(op: str, rows: int, words: int = EXCHANGE_WORDS, **tensors) -> None:
    """Layout checks of the sharded stage ops on CUDA (the launches index with unit strides); raises ValueError.

    ``words``: the exchanges' width (EXCHANGE_WORDS for generation, SCORING_EXCHANGE_WORDS for prompt scoring)."""
    problems = []
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if name == "logits" and tensor.stride(-1) != 1:
            problems.append(f"logits must have unit vocabulary stride, got strides {tensor.stride()}")
        elif name != "logits" and not tensor.is_contiguous():
            problems.append(f"{name} must be contiguous, got strides {tensor.stride()}")
        if name in ("statistics", "candidates") and (tensor.dim() != 2 or tensor.shape[1] != words
                                                     or tensor.shape[0] % rows):
            problems.append(f"{name} must be [ranks * {rows}, {words}], got {list(tensor.shape)}")
        if words == SCORING_EXCHANGE_WORDS and name in ("statistics", "candidates") and tensor.dtype != torch.int32:
            problems.append(f"{name} must be int32, got {tensor.dtype}")
        if name == "out" and words == SCORING_EXCHANGE_WORDS and (tensor.dtype != torch.int32
                                                                  or tensor.shape[-1] != PROMPT_ROW_WIDTH):
            problems.append(f"out must be int32 [..., {PROMPT_ROW_WIDTH}], got {tensor.dtype} {list(tensor.shape)}")
        if name == "out_rows" and (tensor.dtype != torch.int64 or list(tensor.shape) != [rows]):
            problems.append(f"out_rows must be int64 [{rows}], got {tensor.dtype} {list(tensor.shape)}")
        if name in ("requested", "token_id_counts", "targets") and (tensor.dtype != torch.int32
                                                                    or list(tensor.shape) != [rows]):
            problems.append(f"{name} must be int32 [{rows}], got {tensor.dtype} {list(tensor.shape)}")
    if problems:
        raise ValueError(f"ignition::{op}: " + "; ".join(problems))


def _statistics_on_device(logits, requested, vocab_start, vocab_size):
    check_stage_args("vocab_shard_statistics", logits.shape[0], logits=logits, requested=requested)
    return _vocabulary_launcher(logits.device, "vocab_shard_statistics").statistics(logits, requested, vocab_start,
                                                                                    vocab_size)


def _candidates_on_device(logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size):
    check_stage_args("vocab_shard_candidates", logits.shape[0], logits=logits, statistics=statistics,
                     requested=requested, token_ids=token_ids, token_id_counts=token_id_counts)
    return _vocabulary_launcher(logits.device, "vocab_shard_candidates").candidates(
        logits, statistics, chosen, requested, token_ids, token_id_counts, vocab_start, vocab_size)


def _merge_on_device(statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size,
                     vocab_shard, k):
    check_stage_args("merge_vocabulary_logprobs", chosen.shape[0], statistics=statistics, candidates=candidates,
                     requested=requested, out=out, out_rows=out_rows, token_ids=token_ids,
                     token_id_counts=token_id_counts)
    _vocabulary_launcher(chosen.device, "merge_vocabulary_logprobs").merge(
        statistics, candidates, chosen, requested, out, out_rows, token_ids, token_id_counts, vocab_size, vocab_shard, k)


STAGE_OPS["statistics"].register_kernel("cuda")(_statistics_on_device)
STAGE_OPS["candidates"].register_kernel("cuda")(_candidates_on_device)
STAGE_OPS["merge"].register_kernel("cuda")(_merge_on_device)


# ---- the vocabulary-sharded prompt-scoring stage ops ----------------------------------------------
def _scoring_launcher(device: torch.device, op: str):
    """The scoring stages of the bound sharded launcher (``PreparedVocabulary.scoring``), or JIT ones."""
    return _sharded_launcher(device, op, "scoring", "scoring")


def _score_statistics_on_device(logits, targets, vocab_start, vocab_size):
    check_stage_args("score_shard_statistics", logits.shape[0], SCORING_EXCHANGE_WORDS, logits=logits, targets=targets)
    return _scoring_launcher(logits.device, "score_shard_statistics").statistics(logits, targets, vocab_start,
                                                                                 vocab_size)


def _score_candidates_on_device(logits, statistics, targets, vocab_start, vocab_size):
    check_stage_args("score_shard_candidates", logits.shape[0], SCORING_EXCHANGE_WORDS, logits=logits,
                     statistics=statistics, targets=targets)
    return _scoring_launcher(logits.device, "score_shard_candidates").candidates(logits, statistics, targets,
                                                                                 vocab_start, vocab_size)


def _merge_scores_on_device(statistics, candidates, targets, out, out_rows, vocab_size, vocab_shard):
    check_stage_args("merge_prompt_scores", targets.shape[0], SCORING_EXCHANGE_WORDS, statistics=statistics,
                     candidates=candidates, targets=targets, out=out, out_rows=out_rows)
    _scoring_launcher(targets.device, "merge_prompt_scores").merge(statistics, candidates, targets, out, out_rows,
                                                                   vocab_size, vocab_shard)


SCORING_STAGE_OPS["statistics"].register_kernel("cuda")(_score_statistics_on_device)
SCORING_STAGE_OPS["candidates"].register_kernel("cuda")(_score_candidates_on_device)
SCORING_STAGE_OPS["merge"].register_kernel("cuda")(_merge_scores_on_device)
