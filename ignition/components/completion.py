"""CompletionOutputs: the records, the packed logprob output, request flags and explicit-ID inputs.

Recipes allocate one bundle per graph capacity with ``CompletionOutputs.allocate`` and pass
it to the shared commit; ``allocate`` always allocates the complete bundle, so every
exported core carries all five buffers and supports natural alternatives and explicit IDs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignition.catalog.buffers import COMPLETION_BUFFERS, BufferSpec, resolve_shape
from ignition.catalog.contract import resolve_completion_token_capacity
from ignition.catalog.model import BufferDecl


@dataclass(slots=True)
class CompletionOutputs:
    """The five buffers of the completion contract for one capacity (contiguous, row-major)."""

    capacity: int
    token_capacity: int  # T, resolved
    completion_records: torch.Tensor  # int64 [2, capacity, 16+T]
    completion_logprobs: torch.Tensor  # int32 [2, capacity, T, 258]
    logprob_requested: torch.Tensor  # int32 [capacity]
    logprob_token_ids: torch.Tensor  # int32 [capacity, 128]
    logprob_token_id_counts: torch.Tensor  # int32 [capacity]

    @classmethod
    def allocate(cls, capacity: int, completion_token_capacity: int | None = None,
                 device: torch.device | str | None = None) -> "CompletionOutputs":
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"CompletionOutputs capacity must be a positive integer, got {capacity!r}")
        token_capacity = resolve_completion_token_capacity(completion_token_capacity)
        tensors = {
            spec.name: torch.zeros(resolve_shape(spec, capacity=capacity, T=token_capacity),
                                   dtype=getattr(torch, spec.dtype), device=device)
            for spec in COMPLETION_BUFFERS
        }
        return cls(capacity=capacity, token_capacity=token_capacity, **tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {spec.name: getattr(self, spec.name) for spec in COMPLETION_BUFFERS}

    def declarations(self) -> list[BufferDecl]:
        """The bundle's buffer declarations, in the specification's order."""
        return [declare(spec, capacity=self.capacity, T=self.token_capacity) for spec in COMPLETION_BUFFERS]

    def physical_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def declare(spec: BufferSpec, **geometry: int) -> BufferDecl:
    return BufferDecl(name=spec.name, dtype=spec.dtype, shape=resolve_shape(spec, **geometry), role=spec.role)
