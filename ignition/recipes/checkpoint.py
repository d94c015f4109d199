"""Reading a Hugging Face checkpoint directory: ``config.json`` plus safetensors weights.

Opening a checkpoint reads only the safetensors headers (names, dtypes, shapes); tensor data
is read on :meth:`Checkpoint.load`, so opening a multi-gigabyte checkpoint is cheap.
Every failure is a :class:`CheckpointError` whose message names the file, the tensor or
field, the rule that was broken, what was expected and what was found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ignition.catalog.limits import config_problem

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# HF `architectures[0]` -> Ignition model family.
ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model (recipes/gemma3.py)
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model (recipes/qwen3_5.py)
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}

# Non-persistent buffers that some exporters still write; never part of the expected layout.
IGNORED_TENSOR_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)

# safetensors header dtype tag -> torch dtype.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint directory or its config cannot be used.

    Derives from ``ValueError`` so configuration parsing can raise it for invalid fields.
    """


def read_config(path: str | Path) -> dict[str, Any]:
    """Return the parsed ``config.json`` of checkpoint directory ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path}: a checkpoint directory must contain {CONFIG_FILE}; "
            f"expected a file, found nothing"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{config_path}: must be valid UTF-8 JSON; expected a JSON object, found a parse error ({exc})"
        ) from exc
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_path}: top level must be a JSON object; found {type(config).__name__}"
        )
    problem = config_problem(config, str(config_path))  # before any recipe sizes anything by it
    if problem:
        raise CheckpointError(problem)
    return config


_REQUIRED = object()


def read_field(config: Mapping[str, Any], key: str, kind: type, source: str, default: Any = _REQUIRED) -> Any:
    """``config[key]`` checked to be ``kind`` (int excludes bool; float accepts int); ``default`` if absent."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source}: field {key!r} is required; expected {kind.__name__}, found nothing")
        return default
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
        raise CheckpointError(f"{source}: field {key!r} must be {kind.__name__}; found {value!r}")
    return kind(value)


def family_of(config: Mapping[str, Any], source: str = CONFIG_FILE) -> str:
    """Map ``config["architectures"][0]`` to a family name via :data:`ARCHITECTURES`."""
    architectures = config.get("architectures")
    supported = ", ".join(sorted(ARCHITECTURES))
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise CheckpointError(
            f"{source}: field 'architectures' must be a non-empty list of names; "
            f"expected one of [{supported}], found {architectures!r}"
        )
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: field 'architectures[0]' names an unsupported architecture; "
            f"expected one of [{supported}], found {architecture!r}"
        )
    return ARCHITECTURES[architecture]


def is_ignored_tensor(name: str) -> bool:
    """True for buffers such as ``rotary_emb.inv_freq`` that carry no weights."""
    return name.endswith(IGNORED_TENSOR_SUFFIXES)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives and what its header says."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if any(not isinstance(dim, int) or dim < 0 for dim in self.shape):
            raise CheckpointError(f"{self.file}: tensor shape must be non-negative ints, found {self.shape}")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Tensor names of a checkpoint directory mapped to their file, dtype and shape."""

    directory: Path
    tensors: Mapping[str, TensorInfo]

    def __post_init__(self) -> None:
        if not isinstance(self.directory, Path):
            raise CheckpointError(f"Checkpoint.directory must be a Path, found {type(self.directory).__name__}")

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self.tensors)

    def files(self) -> list[str]:
        """Names of the safetensors files holding the tensors, sorted."""
        return sorted({info.file.name for info in self.tensors.values()})

    def info(self, name: str) -> TensorInfo:
        """Header entry of tensor ``name``."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(
                f"{self.directory}: tensor {name!r} was requested but is not in any of {self.files()}"
            )
        return info

    def load(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` from disk (in its stored dtype)."""
        info = self.info(name)
        try:
            with safe_open(str(info.file), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type; never leak it raw
            raise CheckpointError(
                f"{info.file}: reading tensor {name!r} must succeed; found an unreadable file ({exc})"
            ) from exc
        if tuple(tensor.shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} data must match its header; "
                f"expected shape {list(info.shape)}, found {list(tensor.shape)}"
            )
        return tensor

    def validate(
        self,
        expected: Mapping[str, Sequence[int]],
        *,
        optional: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Check the tensors against ``expected`` (name -> shape) and raise one error listing every problem.

        ``optional`` names may be absent; when present their shape is checked. Tensors matching
        :data:`IGNORED_TENSOR_SUFFIXES` are skipped; any other tensor not named is unexpected.
        """
        optional = optional or {}
        problems: list[str] = []
        for name, shape in expected.items():
            info = self.tensors.get(name)
            if info is None:
                problems.append(
                    f"missing tensor {name!r}: the config requires it; expected shape {list(shape)}, "
                    f"found no such tensor in {self.files()}"
                )
            elif info.shape != tuple(shape):
                problems.append(_shape_problem(name, info, shape))
        for name, info in sorted(self.tensors.items()):
            if name in expected or is_ignored_tensor(name):
                continue
            if name in optional:
                if info.shape != tuple(optional[name]):
                    problems.append(_shape_problem(name, info, optional[name]))
                continue
            problems.append(
                f"{info.file.name}: unexpected tensor {name!r}: the config does not use it; "
                f"expected no such tensor, found shape {list(info.shape)}"
            )
        if problems:
            listing = "\n  - ".join(problems)
            raise CheckpointError(
                f"{self.directory}: checkpoint does not match the layout implied by {CONFIG_FILE} "
                f"({len(problems)} problem(s)):\n  - {listing}"
            )


def _shape_problem(name: str, info: TensorInfo, shape: Sequence[int]) -> str:
    return (
        f"{info.file.name}: tensor {name!r} has the wrong shape: "
        f"expected {list(shape)}, found {list(info.shape)}"
    )


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read the safetensors headers of checkpoint directory ``path``.

    Uses ``model.safetensors`` if present, else the shards named by ``model.safetensors.index.json``.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint must be a directory; found nothing there")
    single_file = directory / SINGLE_FILE
    index_file = directory / INDEX_FILE
    if single_file.is_file():
        return Checkpoint(directory, _read_header(single_file))
    if index_file.is_file():
        return Checkpoint(directory, _read_index(directory, index_file))
    found = sorted(entry.name for entry in directory.iterdir())
    raise CheckpointError(
        f"{directory}: checkpoint weights must be in {SINGLE_FILE} or {INDEX_FILE}; found only {found}"
    )


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Names, dtypes and shapes of one safetensors file, without reading tensor data."""
    tensors: dict[str, TensorInfo] = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                dtype_tag = tensor_slice.get_dtype()
                if dtype_tag not in SAFETENSORS_DTYPES:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has an unsupported dtype; "
                        f"expected one of {sorted(SAFETENSORS_DTYPES)}, found {dtype_tag!r}"
                    )
                shape = tuple(int(dim) for dim in tensor_slice.get_shape())
                tensors[name] = TensorInfo(file, SAFETENSORS_DTYPES[dtype_tag], shape)
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or corrupt file: safetensors raises SafetensorError
        raise CheckpointError(
            f"{file}: must be a complete safetensors file; found a truncated or corrupt file ({exc})"
        ) from exc
    return tensors


def _read_index(directory: Path, index_file: Path) -> dict[str, TensorInfo]:
    """Headers of every shard named by a sharded checkpoint's index file."""
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{index_file}: must be valid JSON; found a parse error ({exc})"
        ) from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()
    ):
        raise CheckpointError(
            f"{index_file}: field 'weight_map' must map tensor names to shard file names; "
            f"found {type(weight_map).__name__}"
        )
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_shard.setdefault(shard, []).append(name)

    missing = [shard for shard in names_by_shard if Path(shard).name != shard or not (directory / shard).is_file()]
    if missing:
        details = "; ".join(
            f"shard {shard!r} (holds {len(names_by_shard[shard])} tensors, e.g. {names_by_shard[shard][0]!r})"
            for shard in sorted(missing)
        )
        raise CheckpointError(
            f"{index_file}: every shard named in 'weight_map' must be a file in {directory}; missing: {details}"
        )

    tensors: dict[str, TensorInfo] = {}
    for shard, names in sorted(names_by_shard.items()):
        header = _read_header(directory / shard)
        absent = [name for name in names if name not in header]
        if absent:
            raise CheckpointError(
                f"{index_file}: 'weight_map' places tensors in {shard!r} that the shard does not contain; "
                f"expected {absent[:5]}{' ...' if len(absent) > 5 else ''}, found {len(header)} other tensors"
            )
        tensors.update((name, header[name]) for name in names)
    return tensors
