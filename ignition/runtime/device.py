"""Moving exported programs onto the device LoadOptions chose (ignition/runtime/options.py).

Graphs are captured on the CPU. ``move_program`` uses torch.export's own
``move_to_device_pass`` (parameters, constants, every node's burnt-in ``device`` argument and
metadata) and then checks that nothing in the program still names another device, so a
program either replays entirely on the device or is refused at load.
"""

from __future__ import annotations

import torch

def foreign_devices(program, device: torch.device) -> list[str]:
    """Where a program still names a device other than ``device``: nodes, parameters, constants."""
    found = []

    def other(value) -> bool:
        return isinstance(value, torch.device) and value != device or \
            isinstance(value, str) and value in ("cpu", "cuda", "meta") and torch.device(value) != device

    for node in program.graph.nodes:
        for value in list(node.args) + list(node.kwargs.values()):
            if other(value):
                found.append(f"node {node.name} ({node.target}) names {value}")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device != device:
            found.append(f"node {node.name} produces a tensor on {val.device}")
    for name, tensor in list(program.state_dict.items()) + list(program.constants.items()):
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            found.append(f"{name} is on {tensor.device}")
    return found


def move_program(program, device: torch.device):
    """The exported program on ``device`` (moved in place), or ValueError naming what stayed behind."""
    if device.type == "cpu":
        return program
    from torch.export.passes import move_to_device_pass

    program = move_to_device_pass(program, str(device))
    leftovers = foreign_devices(program, device)
    if leftovers:
        raise ValueError(f"after moving to {device}, the program still refers to other devices: "
                         + "; ".join(leftovers[:5]) + (f" (and {len(leftovers) - 5} more)" if len(leftovers) > 5 else ""))
    return program
