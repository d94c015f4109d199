"""How a variant looks as an ONNX graph: file names, input and output names, external weights.

Written once here and read by the exporter, the validator and the onnxruntime backend.

* ``graphs/<variant>.onnx``, opset ``ONNX_OPSET``;
* inputs: every declared argument except the weights, under its declared name, dtype and shape;
* outputs: ``next_tokens``, then ``<buffer>.out`` for every output and state buffer the variant
  writes, in argument order (the runtime binds ``<buffer>.out`` to input ``<buffer>``'s memory);
* weights: initializers with external data in the core's one ``weights.safetensors``; locations
  are relative to the core root (onnx and onnxruntime refuse ``..``), at the tensor's own offset.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ignition.catalog.enums import Role
from ignition.catalog.model import GRAPHS_DIR, BufferDecl

ONNX_OPSET = 18
ONNX_SUFFIX = ".onnx"
NEXT_TOKENS = "next_tokens"
OUT_SUFFIX = ".out"
WRITTEN_ROLES = (Role.OUTPUT, Role.STATE)
ONNX_DTYPES = {"float32": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 6, "int64": 7, "bool": 9, "float16": 10,
               "float64": 11, "bfloat16": 16}
"""Declared dtype name -> ONNX TensorProto.DataType code."""


def onnx_path(variant: str) -> str:
    """``graphs/decode.c1.onnx`` for variant ``decode.c1``."""
    return f"{GRAPHS_DIR}/{variant}{ONNX_SUFFIX}"


def output_name(buffer: str) -> str:
    """The graph output carrying the new value of written buffer ``buffer``."""
    return f"{buffer}{OUT_SUFFIX}"


def written_buffers(arguments: list[BufferDecl]) -> list[str]:
    """Buffers an ONNX graph returns (and a runtime binds in place), in argument order."""
    return [a.name for a in arguments if a.role in WRITTEN_ROLES]


def expected_inputs(arguments: list[BufferDecl]) -> list[BufferDecl]:
    return [a for a in arguments if a.role is not Role.WEIGHT]


def expected_outputs(arguments: list[BufferDecl], returns: list[BufferDecl]) -> list[BufferDecl]:
    """``next_tokens`` (the variant's return) then ``<buffer>.out`` for each written buffer."""
    written = [BufferDecl(output_name(a.name), a.dtype, a.shape, a.role) for a in arguments if a.role in WRITTEN_ROLES]
    return [BufferDecl(NEXT_TOKENS, r.dtype, r.shape, r.role) for r in returns] + written


def safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute byte offset, byte length) of each tensor's data in a safetensors file."""
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        return offsets_of_header(f.read(header_bytes))


def offsets_of_header(header_json: bytes) -> dict[str, tuple[int, int]]:
    """``safetensors_offsets`` of a file whose JSON header is ``header_json`` (the bytes after its 8-byte length)."""
    header = json.loads(header_json)
    base = 8 + len(header_json)
    return {name: (base + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"}


def external_data(tensor) -> dict[str, str]:
    """The external-data entries (location, offset, length, ...) of an ONNX TensorProto."""
    return {entry.key: entry.value for entry in tensor.external_data}


def weights_as_inputs(model):
    """A copy of ``model`` whose external-data initializers are typed graph inputs instead.

    onnx.checker resolves external data against the model file's folder (``graphs/``), where the
    core's weights are not; this copy lets the checker check everything else, while the
    validator checks each external reference against the safetensors header itself.
    """
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    external = [t for t in copy.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in copy.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    copy.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    return copy
