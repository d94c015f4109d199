"""``--compile inductor``: ahead-of-time compile an exported graph variant with AOTInductor.

The package (``.pt2`` in AOTInductor's package format) is stored beside the variant's
``torch.export`` program; it is an additional target, never a replacement. Opaque ops such as
``ignition::reduce_logprobs`` stay calls into their registered kernels (AOTInductor's proxy
executor), so the process that loads a package must import the module registering them first:
``ignition.components.logprobs`` (the graphs' own imports do this).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

PACKAGE_SUFFIX = ".aoti.pt2"


class CompileError(Exception):
    """AOTInductor could not compile a variant; the message names the variant and the cause."""


def package_path(graph_file: Path) -> Path:
    """``graphs/decode.c1.pt2`` -> ``graphs/decode.c1.aoti.pt2``."""
    return graph_file.with_name(graph_file.name.removesuffix(".pt2") + PACKAGE_SUFFIX)


def placeholder_inputs(program: torch.export.ExportedProgram) -> tuple[tuple, dict]:
    """Zero tensors with the dtype and shape of every user input, in the program's input tree.

    The exporter strips example inputs (they would embed the weights); AOTInductor needs them only
    for dtypes, shapes and strides, never for values.
    """
    user_inputs = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    metas = {node.name: node.meta["val"] for node in program.graph.nodes if node.op == "placeholder"}

    def extent(size) -> int:  # a windowed input's symbolic extent: its largest value, the declared one
        return size if isinstance(size, int) else int(program.range_constraints[size.node.expr].upper)
    leaves = [torch.zeros([extent(size) for size in metas[name].shape], dtype=metas[name].dtype) for name in user_inputs]
    return pytree.tree_unflatten(leaves, program.call_spec.in_spec)


def compile_inductor(program: torch.export.ExportedProgram, path: Path) -> None:
    """Compile ``program`` with AOTInductor into the package file ``path``.

    Needs a C++ compiler on the exporting machine (CPU packages) and the device toolchain for GPU
    programs. Raises CompileError naming ``path`` when no compiler is found or compilation fails.
    """
    path = Path(path)
    if not any(shutil.which(compiler) for compiler in ("c++", "g++", "clang++")):
        raise CompileError(f"{path}: --compile inductor needs a C++ compiler (c++, g++ or clang++) on PATH; found none")
    saved = program.example_inputs
    try:
        from torch._inductor import aoti_compile_and_package
        if saved is None:
            program.example_inputs = placeholder_inputs(program)
        written = aoti_compile_and_package(program, package_path=str(path))
    except Exception as exc:  # inductor raises many types (BackendCompilerFailed, CalledProcessError, ...)
        raise CompileError(f"{path}: AOTInductor compilation failed: {type(exc).__name__}: {str(exc)[:500]}") from exc
    finally:
        program.example_inputs = saved
    if Path(written) != path or not path.is_file():
        raise CompileError(f"{path}: AOTInductor reported {written}, expected the package at {path}")


