"""A typed, read-only view of a validated manifest: parsed once, asked everywhere.

The manifest JSON stays the artifact (its schema is ignition/schemas/manifest.schema.json and the
validator checks every rule on it); this view is what code reads after validation, so that a fact
derived from several fields is derived in exactly one place: whether a core is sharded (``Manifest.sharded``), a
rank's files. K, the natural alternatives a request may ask for (0 without logprob outputs), is ``Manifest.k``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType

from ignition.catalog.contract import manifest_token_capacity


@dataclass(frozen=True, slots=True)
class Features:
    allow_logprobs: bool
    explicit_ids: bool
    prompt_logprobs: bool
    structured_output: bool = False  # the token bitmask and logit-bias inputs; omitted by older cores

    @classmethod
    def from_json(cls, features: dict) -> "Features":
        return cls(bool(features["allow_logprobs"]), bool(features["explicit_ids"]), bool(features["prompt_logprobs"]),
                   bool(features.get("structured_output", False)))

    def as_json(self) -> dict:
        """The manifest's ``features`` object, every flag present (an older core's omitted ones at their default)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RankFiles:
    weights: str
    graphs: MappingProxyType  # variant name -> this rank's graph file


@dataclass(frozen=True, slots=True)
class ParallelSection:
    ranks: int
    vocab_shard: int
    group: str
    rank_files: tuple[RankFiles, ...]

    @classmethod
    def from_json(cls, section: dict) -> "ParallelSection":
        files = tuple(RankFiles(entry["weights"], MappingProxyType(dict(entry.get("graphs", {}))))
                      for entry in section["rank_files"])
        return cls(int(section["ranks"]), int(section["vocab_shard"]), str(section["group"]), files)


@dataclass(frozen=True, slots=True)
class ModelShape:
    architecture: str
    dtype: str  # the weights' dtype name: float32, bfloat16 or float16
    num_layers: int
    max_seq_len: int | None
    num_slots: int | None
    layer_kinds: tuple[str, ...] = ()  # each layer's cache kind (catalog/cache_kinds.py), in layer order
    sliding_window: int | None = None  # sliding layers' window W
    window_cells: int | None = None  # positions a sliding step reads (catalog/cache_kinds.py ``window_cells``)
    softmax_short_row: int | None = None  # BF16/FP16: the softmax row length traced for (catalog/softmax_order.py)
    block_size: int | None = None  # positions per block of the paged caches (catalog/geometry.py PAGED_STATE)
    kv_blocks: int | None = None  # the paged caches' declared block count, the pool's upper bound
    window_kv_blocks: int | None = None  # the sliding pools' declared block count (catalog/geometry.py WINDOW_PAGED_STATE)


@dataclass(frozen=True, slots=True)
class Manifest:
    """The facts of a validated manifest (``Manifest.from_json(report.manifest)``)."""

    recipe: str
    vocab_size: int
    vocab_padded: int
    k: int  # K: natural alternatives per position a request may ask for (0: the core reports no logprobs)
    eos_token_id: int | None
    weights: str
    features: Features
    model: ModelShape
    parallel: ParallelSection | None
    token_capacity: int  # T, resolved (catalog.contract.manifest_token_capacity)
    catalog: str  # the catalog file
    tokenizer: str | None  # the tokenizer directory, or None
    files: MappingProxyType  # every listed file -> its sha256
    state: tuple  # the state buffer declarations (buffer.schema.json objects), in manifest order

    @classmethod
    def from_json(cls, manifest: dict) -> "Manifest":
        model = manifest["model"]
        section = manifest.get("tensor_parallel")
        return cls(recipe=manifest["recipe"], vocab_size=int(manifest["vocab_size"]),
                   vocab_padded=int(manifest["vocab_padded"]), k=int(manifest["k"]),
                   eos_token_id=manifest.get("eos_token_id"), weights=manifest["weights"],
                   features=Features.from_json(manifest["features"]),
                   model=ModelShape(model.get("architecture", ""), model["dtype"],
                                    int(model.get("num_layers", 0)),
                                    model.get("max_seq_len"), model.get("num_slots"),
                                    tuple(model.get("layer_kinds", ())), model.get("sliding_window"),
                                    model.get("window_cells"), model.get("softmax_short_row"),
                                    model.get("block_size"), model.get("kv_blocks"),
                                    model.get("window_kv_blocks")),
                   parallel=ParallelSection.from_json(section) if section else None,
                   token_capacity=manifest_token_capacity(manifest), catalog=manifest["catalog"],
                   tokenizer=manifest.get("tokenizer"), files=MappingProxyType(dict(manifest["files"])),
                   state=tuple(MappingProxyType(dict(d)) for d in manifest["state"]))

    @property
    def sharded(self) -> bool:
        """Whether the core holds tensor-parallel rank shards (the one place this is asked)."""
        return self.parallel is not None

    @property
    def ranks(self) -> int:
        return self.parallel.ranks if self.parallel is not None else 1

    @property
    def tokenizer_file(self) -> str | None:
        """The tokenizer.json the core ships (None without a tokenizer)."""
        return f"{self.tokenizer.rstrip('/')}/tokenizer.json" if self.tokenizer else None

    def rank_weights(self, rank: int) -> str:
        """The weights file rank ``rank`` loads."""
        return self.parallel.rank_files[rank].weights if self.parallel is not None else self.weights


__all__ = ["Manifest", "Features", "ParallelSection", "RankFiles", "ModelShape"]
