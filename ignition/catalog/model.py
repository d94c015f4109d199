"""In-memory form of catalog entries: declared buffers and graph variants, to and from JSON."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from ignition.catalog.enums import Operation, Role, ValueSource

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "signature.json"  # detached signature over the manifest digest; never listed in it
CATALOG_FILE = "catalog.json"
KERNELS_FILE = "kernels.json"
WEIGHTS_FILE = "weights.safetensors"
GRAPHS_DIR = "graphs"


PREFILL_FAMILY = (Operation.PREFILL, Operation.SCORED_PREFILL)


def lane_count(operation: int, capacity: int) -> int:
    """Lanes per submission: a decode (or PACKED_PREFILL) variant's capacity; one request for the prefill family
    (a SCORED_PREFILL variant's capacity is its prompt-row capacity C)."""
    return 1 if operation in PREFILL_FAMILY else capacity


def reduction_logits_dtype(model_dtype: str, sharded: bool) -> str:
    """The dtype (a torch dtype name) of the logits a variant's logprob reduction reads: float32 on a single rank,
    whose graph converts BF16/FP16 logits once for sampling and the reduction alike (``recipes/graphs.py``), the
    model dtype on a rank of a sharded core, whose reduction reads its vocabulary shard as the LM head wrote it.
    The launch plan, the exporter's check of the captured graph and the loader's launcher all read it here."""
    return model_dtype if sharded else "float32"


def reduction_rows(operation: int, capacity: int, layout: dict) -> int:
    """Logit rows a variant's logprob reduction covers: one per lane, S+1 per lane for SPECULATIVE_VERIFY."""
    speculative = layout.get("speculative") or {}
    return lane_count(operation, capacity) * speculative.get("positions", 1)


def decode_slot_limit(capacity: int, decode_capacities, num_slots: int) -> int | None:
    """The ``layout["slot_limit"]`` a decode variant of ``capacity`` may declare (None: it may not): its capacity,
    when it has two lanes or more, fewer than the cache's ``num_slots`` and fewer than the widest decode variant's.

    A variant with a slot limit serves only lanes whose slots are all below it (its graph may attend over those slots
    in place); the widest decode variant never has one, so every slot can decode. The recipe declares a limit on
    grouped-query FP32 decode variants (``recipes/llama.py`` ``slot_limit``), the validator refuses any other
    (CONTRACT-SLOT-LIMIT), and the scheduler submits a round to the smallest variant that fits both its lane count and its highest slot."""
    if 1 < capacity < num_slots and capacity < max(decode_capacities):
        return capacity
    return None


def admits_slots(layout: dict, slots) -> bool:
    """Whether a variant of ``layout`` may run lanes in ``slots`` (its ``slot_limit``, ``decode_slot_limit``)."""
    limit = layout.get("slot_limit")
    return limit is None or all(slot < limit for slot in slots)


LAZY_ZERO_BYTES = 1 << 20
"""CPU buffers from this size up are zero pages mapped on demand (``zeroed_pages``) rather than written zeros."""


def zeroed_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a private anonymous mapping (page aligned; the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(list(shape))


@dataclass(frozen=True, slots=True)
class BufferDecl:
    """A declared graph argument, return value or state tensor."""

    name: str
    dtype: str  # torch dtype name, e.g. "int32"
    shape: list[int]
    role: Role = Role.INPUT

    def __post_init__(self):
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"buffer {self.name!r}: unknown dtype {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def empty(self, device=None) -> torch.Tensor:
        """The buffer, zeroed, on ``device``. On the CPU a large one is anonymous memory the kernel zeroes page
        by page as it is first touched (``zeroed_pages``): a KV cache that a load wrote with ``torch.zeros``
        cost 2.2 s of the 28-layer Qwen3-0.6B-shaped core's load (4.4 GiB), and mostly stays untouched."""
        if self.nbytes >= LAZY_ZERO_BYTES and torch.device(device if device is not None else "cpu").type == "cpu":
            return zeroed_pages(self.shape, self.torch_dtype)
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "role": self.role.name.lower()}

    @classmethod
    def from_json(cls, data: dict) -> "BufferDecl":
        return cls(name=data["name"], dtype=data["dtype"], shape=list(data["shape"]),
                   role=Role[data.get("role", "input").upper()])


@dataclass(slots=True)
class Variant:
    """One graph variant: an operation at one capacity, its arguments, returns and contract."""

    name: str
    operation: Operation
    capacity: int
    arguments: list[BufferDecl]  # graph inputs, in call order
    returns: list[BufferDecl]
    bindings: dict[str, ValueSource]  # INPUT argument name -> value source
    layout: dict  # requested output layout (see docs/api.md "Semantic contract")
    launches: list[str] = field(default_factory=list)  # prepared kernel keys
    packages: dict[str, str] = field(default_factory=dict)  # additional compiled targets, e.g. {"inductor": path}

    @property
    def graph_file(self) -> str:
        return f"{GRAPHS_DIR}/{self.name}.pt2"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "operation": int(self.operation),
            "capacity": self.capacity,
            "graph": self.graph_file,
            "arguments": [a.to_json() for a in self.arguments],
            "returns": [r.to_json() for r in self.returns],
            "contract": {"layout": self.layout, "bindings": {k: int(v) for k, v in self.bindings.items()}},
            "launches": list(self.launches),
        } | ({"packages": dict(self.packages)} if self.packages else {})
