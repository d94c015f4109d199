"""Moving exported programs onto the device chosen at load, and proving that nothing stayed behind.

Graphs are captured on the CPU, and ``torch.export`` burns the capture device into them: factory ops
(``arange``, ``zeros``, ``full``, ...) carry ``device=cpu``, ``_assert_tensor_metadata`` nodes check it, and
routed-expert ``cond`` branches are graph modules of their own. ``move_program`` re-materializes a program
for the target device: torch.export's ``move_to_device_pass`` (parameters, constants, node metadata, ``device``
keyword arguments), then ``retarget_graphs``, which rewrites every device-typed argument that remains in every
graph module, cond branches included (positional ones by the op's schema), and regenerates each module's
code. ``foreign_devices`` then scans the result, every graph module's nodes (arguments, keyword arguments,
tensor metadata) and generated Python code, parameters, buffers and constants, for any other device: a
program that still names one is refused at load, before it could fail ("Expected: cuda, Got: cpu") on the
first request.
"""

from __future__ import annotations

import re

import torch
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

CAPTURE_DEVICE = torch.device("cpu")  # where export-core traces every graph
_DEVICE_NAME = re.compile(r"cpu|meta|cuda(?::\d+)?")
_DEVICE_NAMES = re.compile(r"device\(type='(\w+)'(?:, index=(\d+))?\)|['\"](cpu|meta|cuda(?::\d+)?)['\"]")


def _device_arguments(node) -> set[str]:
    """Names of the node's schema arguments typed ``Device`` or ``Device?``."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    names = set()
    for argument in schema.arguments:
        kind = argument.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.DeviceObjType):
            names.add(argument.name)
    return names


def _is_device(value) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return False


def _names_device(value) -> bool:
    """A torch.device, or a string that reads as one of the devices a program can name."""
    return isinstance(value, torch.device) or isinstance(value, str) and _DEVICE_NAME.fullmatch(value) is not None


def graph_modules(root: torch.nn.Module):
    """(qualified name, module) of ``root`` and every graph module under it (cond and map branches too)."""
    for name, module in root.named_modules(remove_duplicate=False):
        if isinstance(module, torch.fx.GraphModule):
            yield name or "<root>", module


def retarget_graphs(root: torch.nn.Module, device: torch.device) -> None:
    """Rewrite every device an op of any graph module under ``root`` names (by the op's schema: positional and
    keyword ``Device`` arguments; any ``torch.device`` value) to ``device``, move tensor metadata, and
    regenerate each module's code so the Python that runs says what the graph says."""
    target = str(device)

    def retarget(value):
        return target if isinstance(value, torch.device) and value != device else value

    for _, module in graph_modules(root):
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            typed = _device_arguments(node)
            schema = getattr(node.target, "_schema", None)
            positional = [a.name for a in schema.arguments if not a.kwarg_only] if schema is not None else []
            args = [target if i < len(positional) and positional[i] in typed and _is_device(v)
                    and torch.device(v) != device else map_aggregate(v, retarget) for i, v in enumerate(node.args)]
            kwargs = {k: target if (k in typed or k == "device") and _is_device(v) and torch.device(v) != device
                      else map_aggregate(v, retarget) for k, v in node.kwargs.items()}
            node.args, node.kwargs = tuple(args), kwargs
            if "val" in node.meta:
                node.meta["val"] = pytree.tree_map_only(
                    torch.Tensor, lambda t: t if t.device == device else t.to(device), node.meta["val"])
        module.recompile()


def foreign_devices(program, device: torch.device) -> list[str]:
    """Where ``program`` (an ExportedProgram or a module) still names a device other than ``device``: any graph
    module's node arguments and tensor metadata, its generated code, its parameters, buffers and constants."""
    found = []
    root = program if isinstance(program, torch.nn.Module) else program.graph_module
    for name, module in graph_modules(root):
        where = "" if name == "<root>" else f"{name}: "
        for node in module.graph.nodes:
            values = []
            map_aggregate((node.args, node.kwargs), lambda v: values.append(v) or v)
            for value in values:
                if _names_device(value) and torch.device(value) != device:
                    found.append(f"{where}node {node.name} ({node.target}) names {value}")
            for tensor in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(tensor, torch.Tensor) and tensor.device != device:
                    found.append(f"{where}node {node.name} produces a tensor on {tensor.device}")
        for match in _DEVICE_NAMES.finditer(module.code):
            kind, index, literal = match.groups()
            named = torch.device(literal) if literal else torch.device(kind, int(index) if index else None)
            if named != device:
                found.append(f"{where}generated code names {match.group(0)}")
        for tensor_name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(
                recurse=False)):
            if tensor.device != device:
                found.append(f"{where}{tensor_name} is on {tensor.device}")
    if isinstance(program, torch.export.ExportedProgram):
        for name, tensor in list(program.state_dict.items()) + list(program.constants.items()):
            if isinstance(tensor, torch.Tensor) and tensor.device != device:
                found.append(f"{name} is on {tensor.device}")
    return found


def move_program(program, device: torch.device):
    """The program (an ``ExportedProgram``, or the runtime reader's ``StaticProgram``, whose weights are all
    arguments) re-materialized on ``device`` (moved in place), or ValueError naming what stayed behind. A program
    for the capture device is returned as it is."""
    if device == CAPTURE_DEVICE:
        return program
    if isinstance(program, torch.export.ExportedProgram):
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, str(device))
    else:
        program.graph_module.to(device)  # its lifted tensor constants (the weights are arguments)
    retarget_graphs(program.graph_module, device)
    leftovers = foreign_devices(program, device)
    if leftovers:
        raise ValueError(f"after moving to {device}, the program still refers to other devices: "
                         + "; ".join(leftovers[:5]) + (f" (and {len(leftovers) - 5} more)" if len(leftovers) > 5 else ""))
    return program
