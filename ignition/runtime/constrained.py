"""The engine's side of a request's constraints (structured output and the sampling controls): whether a request is
constrained, the background fill of its grammar's next bitmask row, and its grammar's advance over emitted tokens.

The rows themselves are written by ``bindings.fill_constraints`` from each lane's ``LaneConstraints``
(ignition/runtime/constraints.py); a constrained request never rides a speculative verify round (its graphs take no
mask), so the scheduler asks ``applies`` before it asks the drafter.
"""

from __future__ import annotations

from ignition.runtime.grammar import GrammarViolation
from ignition.runtime.requests import RequestState

Finish = tuple[str, str | None, str | None]
"""How a request ends: (finish reason, error message, the request field the error is due to)."""


class Constraints:
    """Constraint steps over the engine's request states; ``eos``: the core's EOS id, which a complete grammar forces
    next (None when the core declares none)."""

    def __init__(self, eos: int | None):
        self.eos = eos

    @staticmethod
    def applies(state: RequestState) -> bool:
        """Whether ``state``'s request carries any constraint."""
        constraints = state.request.constraints
        return constraints is not None and bool(constraints.fields)

    @staticmethod
    def prefetch(state: RequestState) -> None:
        """Start filling the grammar's next bitmask row in the background (``GrammarMatcher.prefetch``)."""
        constraints = state.request.constraints
        if constraints is not None and constraints.grammar is not None:
            constraints.grammar.prefetch()

    def advance(self, state: RequestState, token: int) -> Finish | None:
        """Advance ``state``'s grammar over an emitted token (forced ones too); how that ends the request, if it does:
        "error" on a token the grammar refuses, "stop" when the grammar is complete.

        A complete grammar allows only EOS next, so vLLM samples that EOS in one more step and counts it
        (``check_stop``, vllm/v1/core/sched/utils.py); the request ends here instead, one step earlier, with
        ``grammar_ended`` set and that EOS as its ``stop_token``, so the server counts and lists it as if it had been
        sampled (the same output, usage and ``token_ids``). With fewer than ``min_tokens`` tokens that EOS would be
        masked: the request fails as the next fill would (``ConstraintConflict``). With ``ignore_eos`` it simply
        ends "stop"."""
        constraints = state.request.constraints
        grammar = constraints.grammar if constraints is not None else None
        if grammar is None:
            return None
        try:
            grammar.accept(token)
        except GrammarViolation as exc:  # e.g. bytes the grammar needs that no token of this tokenizer produces
            return "error", str(exc), grammar.spec.param
        if not grammar.stopped:
            return None
        if not state.request.ignore_eos:  # (with ignore_eos vLLM would emit that EOS until max_tokens)
            if len(state.generated) < constraints.min_tokens:
                return "error", (f"the {grammar.spec.param} constraint is complete after {len(state.generated)} "
                                 f"tokens, before min_tokens = {constraints.min_tokens}: nothing is allowed next"), \
                    "min_tokens"
            state.grammar_ended = True
            if self.eos is not None:
                state.stop_token, state.stop_by_eos = self.eos, True
        return "stop", None, None


__all__ = ["Constraints", "Finish"]
