"""CompletionOutputs: the records, the packed logprob output, request flags and explicit-ID inputs.

Recipes allocate one bundle per graph capacity with ``CompletionOutputs.allocate`` and pass
it to the shared commit; ``allocate`` always allocates the complete bundle, so every
exported core carries all five buffers and supports natural alternatives and explicit IDs.
``allocate_natural`` is the explicit opt-in (``export-core --no-logprob-ids``) for the
specification's natural-only layout: records, flags and a ``2 + 2K`` packed output, no ID inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ignition.catalog.buffers import COMPLETION_BUFFERS, ID_INPUTS, BufferSpec, resolve_shape
from ignition.catalog.contract import NATURAL_K, packed_width, resolve_completion_token_capacity
from ignition.catalog.model import BufferDecl


@dataclass(slots=True)
class CompletionOutputs:
    """The five buffers of the completion contract for one capacity (contiguous, row-major).

    A natural-only bundle (``allocate_natural``) has no ID inputs (None) and packed width 2+2K.
    """

    capacity: int
    token_capacity: int  # T, resolved
    completion_records: torch.Tensor  # int64 [2, capacity, 16+T]
    completion_logprobs: torch.Tensor  # int32 [2, capacity, T, 258] (natural-only: [2, capacity, T, 2+2K])
    logprob_requested: torch.Tensor  # int32 [capacity]
    logprob_token_ids: torch.Tensor | None  # int32 [capacity, 128]
    logprob_token_id_counts: torch.Tensor | None  # int32 [capacity]
    k: int = NATURAL_K

    @classmethod
    def allocate(cls, capacity: int, completion_token_capacity: int | None = None,
                 device: torch.device | str | None = None) -> "CompletionOutputs":
        """The complete bundle: K=20 natural alternatives and up to 128 caller-selected IDs."""
        return cls._allocate(capacity, completion_token_capacity, device, NATURAL_K, explicit_ids=True)

    @classmethod
    def allocate_natural(cls, capacity: int, k: int, completion_token_capacity: int | None = None,
                         device: torch.device | str | None = None) -> "CompletionOutputs":
        """The natural-only layout: 1 <= K <= 20 natural alternatives, no explicit-ID inputs."""
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= NATURAL_K:
            raise ValueError(f"natural-only CompletionOutputs need 1 <= K <= {NATURAL_K}, got {k!r}")
        return cls._allocate(capacity, completion_token_capacity, device, k, explicit_ids=False)

    @classmethod
    def _allocate(cls, capacity, completion_token_capacity, device, k: int, explicit_ids: bool) -> "CompletionOutputs":
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"CompletionOutputs capacity must be a positive integer, got {capacity!r}")
        token_capacity = resolve_completion_token_capacity(completion_token_capacity)
        geometry = {"capacity": capacity, "T": token_capacity, "PACKED_WIDTH": packed_width(k, explicit_ids)}
        tensors = {spec.name: None for spec in COMPLETION_BUFFERS}
        tensors |= {spec.name: torch.zeros(resolve_shape(spec, **geometry), dtype=getattr(torch, spec.dtype), device=device)
                    for spec in COMPLETION_BUFFERS if explicit_ids or spec.name not in ID_INPUTS}
        return cls(capacity=capacity, token_capacity=token_capacity, k=k, **tensors)

    @property
    def explicit_ids(self) -> bool:
        return self.logprob_token_ids is not None

    @property
    def packed_width(self) -> int:
        return packed_width(self.k, self.explicit_ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {spec.name: getattr(self, spec.name) for spec in COMPLETION_BUFFERS if getattr(self, spec.name) is not None}

    def declarations(self) -> list[BufferDecl]:
        """The bundle's buffer declarations, in the specification's order."""
        return [declare(spec, capacity=self.capacity, T=self.token_capacity, PACKED_WIDTH=self.packed_width)
                for spec in COMPLETION_BUFFERS if getattr(self, spec.name) is not None]

    def physical_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def declare(spec: BufferSpec, **geometry: int) -> BufferDecl:
    return BufferDecl(name=spec.name, dtype=spec.dtype, shape=resolve_shape(spec, **geometry), role=spec.role)
