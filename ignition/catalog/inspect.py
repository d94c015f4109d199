"""inspect-core: a summary of a core's features, variants, buffers and launches."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ignition.catalog.enums import Operation
from ignition.catalog.model import BufferDecl

_CLASSES = {"output": "completion frames and outputs", "state": "state (KV)", "weight": "weights", "input": "inputs"}


def inspect_core(report) -> dict:
    manifest, catalog = report.manifest, report.catalog
    variants = []
    for v in catalog["variants"]:
        decls = [BufferDecl.from_json(a) for a in v["arguments"]]
        variants.append({
            "name": v["name"],
            "operation": Operation(v["operation"]).name if v["operation"] in Operation._value2member_map_ else v["operation"],
            "capacity": v["capacity"],
            "buffers": [{"name": d.name, "dtype": d.dtype, "shape": d.shape, "role": d.role.name.lower(), "bytes": d.nbytes}
                        for d in decls if d.role.name != "WEIGHT"],
            "launches": v["launches"],
        })
    weights = {a["name"]: BufferDecl.from_json(a).nbytes for v in catalog["variants"] for a in v["arguments"] if a["role"] == "weight"}
    outputs = {(v["name"], b["name"]): b["bytes"] for v in variants for b in v["buffers"] if b["role"] == "output"}
    state = sum(BufferDecl.from_json(s).nbytes for s in manifest["state"])
    return {
        "core": str(report.path),
        "recipe": manifest["recipe"],
        "model": manifest["model"],
        "vocab_size": manifest["vocab_size"],
        "completion_token_capacity": manifest["completion_token_capacity"],
        "features": manifest["features"] | {"k": manifest["k"]},
        "targets": manifest["targets"],
        "variants": variants,
        "memory": {"weights_bytes": sum(weights.values()), "state_bytes": state,
                   "completion_frame_bytes": sum(outputs.values())},
    }


def render_inspection(summary: dict, console: Console, memory: bool = False) -> None:
    features = Table(title=f"core {summary['core']} ({summary['recipe']})")
    for column in ("allow_logprobs", "K", "explicit IDs", "prompt scoring", "T", "vocab", "targets"):
        features.add_column(column)
    f = summary["features"]
    features.add_row(str(f["allow_logprobs"]), str(f["k"]), str(f["explicit_ids"]), str(f["prompt_logprobs"]),
                     str(summary["completion_token_capacity"]), str(summary["vocab_size"]), ",".join(summary["targets"]) or "-")
    console.print(features)
    variants = Table(title="variants")
    for column in ("variant", "operation", "capacity", "buffer", "dtype", "shape", "role", "bytes"):
        variants.add_column(column, justify="right" if column in ("capacity", "bytes") else "left")
    for v in summary["variants"]:
        for i, b in enumerate(v["buffers"]):
            head = (v["name"], v["operation"], str(v["capacity"])) if i == 0 else ("", "", "")
            variants.add_row(*head, b["name"], b["dtype"], str(b["shape"]), b["role"], f"{b['bytes']:,}")
    console.print(variants)
    launches = Table(title="prepared launches per variant")
    launches.add_column("variant")
    launches.add_column("launches")
    for v in summary["variants"]:
        launches.add_row(v["name"], ", ".join(v["launches"]) or "-")
    console.print(launches)
    if memory:
        table = Table(title="physical bytes")
        table.add_column("class")
        table.add_column("bytes", justify="right")
        for name, value in summary["memory"].items():
            table.add_row(name.removesuffix("_bytes"), f"{value:,}")
        console.print(table)
