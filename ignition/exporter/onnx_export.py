"""``export-core --onnx``: each variant also as ``graphs/<variant>.onnx`` (opset 18) for onnxruntime.

A variant's ``.pt2`` program writes its outputs and state in place; ONNX graphs are functional.
So the ONNX graph takes every declared argument except the weights as an input of the same name,
and returns ``next_tokens`` followed by the new value of every buffer it writes (outputs, then
state, in argument order), named ``<buffer>.out``. A runtime binds each ``<buffer>.out`` to the
memory of input ``<buffer>`` (onnxruntime IOBinding), so the update happens in place.

Steps per variant:

1. the captured program's opaque reduction nodes (and stable sorts) are replaced by their
   standard-operator formulations (``ignition.components.onnx_standard``);
2. a wrapper clones the written buffers and returns them; ``torch.export`` traces it and
   ``torch.onnx.export(dynamo=True)`` translates it to opset 18 (unoptimized: onnxruntime
   optimizes at session creation);
3. weights become initializers whose data is *external*: ``location`` ``weights.safetensors``
   with the offset and length of that tensor's bytes inside the core's one safetensors file (the
   safetensors data section is raw little-endian row-major, as ONNX's external data is);
4. the model is stripped of doc strings and metadata (stack traces name source paths) and
   serialized deterministically, so a re-export is byte-identical.

External-data locations are relative to the **core root**, not to ``graphs/``: onnx and onnxruntime
both refuse a location containing ``..``. Loaders pass the core root as the external-data folder
(onnxruntime: ``session.model_external_initializers_file_folder_path``) or supply the tensors from
memory; the weights stay stored once (0 extra bytes).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import onnx
import torch

from ignition.catalog.enums import Role
from ignition.catalog.model import BufferDecl
from ignition.catalog.onnx_layout import (NEXT_TOKENS, ONNX_DTYPES, ONNX_OPSET, onnx_path, output_name,
                                          safetensors_offsets, weights_as_inputs, written_buffers)
from ignition.components.onnx_standard import STANDARD_FORMULATIONS
from ignition.exporter.tracing import example_buffers


class OnnxExportError(ValueError):
    """A variant could not be written as ONNX; the message names it and the cause."""


class _Functional(torch.nn.Module):
    """Calls the (rewritten) program on clones of the written buffers and returns them."""

    def __init__(self, program_module: torch.nn.Module, written: list[str]):
        super().__init__()
        self.program, self.written = program_module, written

    def forward(self, buffers: dict[str, torch.Tensor]):
        buffers = {name: t.clone() if name in self.written else t for name, t in buffers.items()}
        (tokens,) = self.program(buffers)
        return (tokens, *(buffers[name] for name in self.written))


def _standard_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The program's module with every node torch.onnx cannot translate calling its standard formulation."""
    module = program.module()
    for node in module.graph.nodes:
        if node.op == "call_function" and str(node.target) in STANDARD_FORMULATIONS:
            node.target = STANDARD_FORMULATIONS[str(node.target)]
    module.recompile()
    return module


def _external_weight(decl: BufferDecl, offsets: dict[str, tuple[int, int]], weights_file: str) -> onnx.TensorProto:
    """An initializer whose bytes are the weight's own bytes inside the core's safetensors file."""
    tensor = onnx.TensorProto(name=decl.name, dims=decl.shape, data_type=ONNX_DTYPES[decl.dtype],
                              data_location=onnx.TensorProto.EXTERNAL)
    offset, length = offsets[decl.name]
    for key, value in (("location", weights_file), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _strip(model) -> None:
    """Remove doc strings and metadata (stack traces with source paths) everywhere."""
    model.doc_string = ""
    del model.metadata_props[:]

    def graph_strip(graph):
        graph.doc_string = ""
        del graph.metadata_props[:]
        for collection in (graph.input, graph.output, graph.value_info):
            for value in collection:
                value.doc_string = ""
                del value.metadata_props[:]
        for tensor in graph.initializer:
            tensor.doc_string = ""
            del tensor.metadata_props[:]
        for node in graph.node:
            node.doc_string = ""
            del node.metadata_props[:]
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    graph_strip(attribute.g)
                for sub in attribute.graphs:
                    graph_strip(sub)

    graph_strip(model.graph)
    for function in model.functions:
        function.doc_string = ""
        del function.metadata_props[:]
        for node in function.node:
            node.doc_string = ""
            del node.metadata_props[:]


def export_onnx(program: torch.export.ExportedProgram, arguments: list[BufferDecl], example: dict[str, torch.Tensor],
                weight_offsets: dict[str, tuple[int, int]], weights_file: str, path: Path, where: str) -> None:
    """Write ``program`` (the variant's captured program) as a deterministic ONNX file at ``path``."""
    written = written_buffers(arguments)
    module = _Functional(_standard_module(program), written)
    # Both loggers print on every export: torch.onnx about optional torchvision ops, onnx_ir about
    # empty-list attributes (which it types as INTS, the type the ops declare).
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch's own pytree
            functional = torch.export.export(module, (example,), strict=False)
            # NOTE: optimize=False: onnxscript's rewriter tripled the export time of a decoder variant, and
            # onnxruntime folds constants and fuses at session creation anyway.
            onnx_program = torch.onnx.export(functional, (), dynamo=True, opset_version=ONNX_OPSET, optimize=False,
                                             verbose=False)
    except Exception as exc:  # the exporter raises many types
        raise OnnxExportError(f"{where}: torch.onnx.export failed: {type(exc).__name__}: {str(exc)[:800]}") from exc
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    graph = onnx_program.model.graph
    if len(graph.inputs) != len(arguments) or len(graph.outputs) != 1 + len(written):
        raise OnnxExportError(f"{where}: expected {len(arguments)} inputs and {1 + len(written)} outputs, "
                              f"torch.onnx produced {len(graph.inputs)} and {len(graph.outputs)}")
    for value, decl in zip(graph.inputs, arguments):
        value.name = decl.name
    names = [NEXT_TOKENS] + [output_name(name) for name in written]
    for value, name in zip(graph.outputs, names):
        if value in graph.inputs:
            raise OnnxExportError(f"{where}: output {name} is an unchanged input; the graph never writes it")
        value.name = name
    model = onnx_program.model_proto
    weights = {a.name: a for a in arguments if a.role is Role.WEIGHT}
    kept = [value for value in model.graph.input if value.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(_external_weight(decl, weight_offsets, weights_file) for decl in weights.values())
    _strip(model)
    onnx.checker.check_model(weights_as_inputs(model), full_check=False)  # validate-core runs the full check
    Path(path).write_bytes(model.SerializeToString(deterministic=True))


def check_exportable(build) -> None:
    """Refuse, before any capture, a build whose ONNX graphs onnxruntime could not run."""
    if build.model["dtype"] == "bfloat16":
        raise OnnxExportError("--onnx: the model's weights are bfloat16, which onnxruntime's CPU provider cannot "
                              "multiply (it has no bfloat16 MatMul); export with --dtype float32 or float16")


def export_variants(build, programs: dict[str, torch.export.ExportedProgram], staging: Path, weights_file: str,
                    progress=lambda stage, item: None) -> dict[str, float]:
    """Write every variant of ``build`` as ONNX beside its ``.pt2`` and name it in ``packages.onnx``.

    ``weights_file`` must already be written in ``staging``. Returns wall seconds per variant.
    """
    offsets = safetensors_offsets(staging / weights_file)
    timings = {}
    for graph in build.graphs:
        started = time.perf_counter()
        variant = graph.variant
        progress("onnx", variant.name)
        export_onnx(programs[variant.name], variant.arguments, example_buffers(graph, build.weights), offsets,
                    weights_file, staging / onnx_path(variant.name), f"variant {variant.name}")
        variant.packages["onnx"] = onnx_path(variant.name)
        timings[f"onnx:{variant.name}"] = time.perf_counter() - started
    return timings
