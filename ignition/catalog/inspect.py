"""inspect-core: a summary of a core's features, variants, buffers and launches."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ignition.catalog.buffers import PROMPT_BUFFERS
from ignition.catalog.cache_kinds import CACHE_KINDS
from ignition.catalog.contract import manifest_token_capacity
from ignition.catalog.enums import Operation
from ignition.catalog.geometry import STATE_SHAPES, usable_blocks
from ignition.catalog.model import BufferDecl

_CLASSES = {"output": "completion frames and outputs", "state": "state (KV)", "weight": "weights", "input": "inputs"}


def kv_bytes_per_token(manifest: dict) -> int | None:
    """Bytes one cached token costs: state buffers laid out [layers, slots, max_seq_len, ...] or paged
    [layers, kv_blocks, block_size, ...] (catalog/geometry.py ``PAGED_STATE``), and compressed entry tables
    [layers, slots, entries, ...] at one entry per ``rate`` positions (``ENTRY_RATES``); rings and recurrent states
    are per slot, whatever the sequence."""
    model = manifest["model"]
    slots = model.get("num_slots")
    layouts = {("num_slots", "max_seq_len"): (slots, model.get("max_seq_len")),
               ("kv_blocks", "block_size"): (model.get("kv_blocks"), model.get("block_size"))}
    # by the geometry table, not by extents: a linear layer's conv_state [layers, slots, conv_dim, ...] is per slot
    # even where conv_dim equals max_seq_len
    per_token = []
    for s in manifest["state"]:
        symbols = tuple(STATE_SHAPES.get(s["name"], ()))[1:3]
        extents = layouts.get(symbols)
        if extents is not None and all(extents) and s["shape"][1:3] == list(extents):
            per_token.append(BufferDecl.from_json(s).nbytes // (extents[0] * extents[1]))
            continue
        rate = model.get(ENTRY_RATES.get(symbols[-1] if len(symbols) == 2 else None, ""))
        if symbols[:1] == ("num_slots",) and isinstance(rate, int) and rate > 0 and s["shape"][1] == slots:
            per_token.append(BufferDecl.from_json(s).nbytes // (slots * s["shape"][2]) // rate)  # an entry per rate
    return sum(per_token) or None


ENTRY_RATES = {"csa_entries": "csa_rate", "hca_entries": "hca_rate"}
"""A compressed entry table's extent symbol -> the manifest field of positions per entry (DeepSeek V4)."""


def kv_capacity(manifest: dict) -> dict:
    """The paged pool a load of the core may hold (``model.kv_blocks``, its upper bound; ``--kv-cache-memory`` sizes
    it below) in blocks and in tokens; empty for a core without paged caches."""
    model = manifest["model"]
    if not model.get("kv_blocks") or not model.get("block_size"):
        return {}
    return {"kv_block_size": model["block_size"], "kv_blocks_max": model["kv_blocks"],
            "kv_capacity_tokens_max": usable_blocks(model["kv_blocks"]) * model["block_size"]}


def kind_memory(manifest: dict) -> dict[str, dict]:
    """Each cache kind present: its layers, the state bytes of its buffers, and the positions a slot keeps per
    layer (``max_seq_len`` for full layers, ``window_cells`` for sliding ones, none for a recurrent state)."""
    kinds = manifest["model"].get("layer_kinds") or []
    report = {}
    for kind in dict.fromkeys(kinds):
        spec = CACHE_KINDS.get(kind)
        buffers = [s for s in manifest["state"] if spec is not None and s["name"] in spec.buffers]
        positions = {"full": manifest["model"].get("max_seq_len"),
                     "sliding": manifest["model"].get("window_cells")}.get(kind)
        report[kind] = {"layers": kinds.count(kind), "state_bytes": sum(BufferDecl.from_json(s).nbytes for s in buffers),
                        "positions_per_slot": positions, "buffers": [s["name"] for s in buffers]}
    return report


def scoring_cost(report, budget: int | None) -> dict:
    """Fixed bytes the --prompt-logprobs flag adds, and the KV capacity it displaces under a budget.

    Per rank: every rank allocates the scored variants' prompt buffers and holds its own scored graphs, and the state
    the manifest declares is one rank's (KV heads split, or whole on every rank: ``catalog.parallel.split_state``), so
    ``budget`` is one device's. A sharded core reports each rank (``ranks``) and, at the top level, its tightest rank:
    the most fixed bytes and so the fewest tokens, which every rank then holds."""
    scored = [v for v in report.catalog["variants"] if v["operation"] == Operation.SCORED_PREFILL]
    buffers = sum(BufferDecl.from_json(a).nbytes for v in scored for a in v["arguments"]
                  if a["name"] in {spec.name for spec in PROMPT_BUFFERS})
    rank_files = (report.manifest.get("tensor_parallel") or {}).get("rank_files") \
        or [{"rank": 0, "graphs": {v["name"]: v["graph"] for v in scored}}]
    rank_graphs = [sum((report.path / path).stat().st_size for name, path in entry["graphs"].items()
                       if name in {v["name"] for v in scored} and (report.path / path).is_file())
                   for entry in rank_files]
    per_token = kv_bytes_per_token(report.manifest)
    ranks = [{"rank": entry["rank"], "prompt_scoring_buffer_bytes": buffers, "prompt_scoring_graph_bytes": graphs}
             | _displaced(budget, per_token, buffers + graphs) for entry, graphs in zip(rank_files, rank_graphs)]
    tightest = max(ranks, key=lambda rank: rank["prompt_scoring_graph_bytes"])
    cost = {"prompt_scoring_buffer_bytes": buffers, "prompt_scoring_graph_bytes": tightest["prompt_scoring_graph_bytes"],
            "kv_bytes_per_token": per_token} | _displaced(budget, per_token, buffers + tightest["prompt_scoring_graph_bytes"])
    if "tensor_parallel" in report.manifest:
        cost["ranks"] = ranks
    return cost


def _displaced(budget: int | None, per_token: int | None, fixed: int) -> dict:
    """The KV tokens a ``budget`` holds without and with ``fixed`` bytes taken first, and the fraction lost."""
    if budget is None or not per_token:
        return {}
    without, with_flag = budget // per_token, max(0, budget - fixed) // per_token
    return {"memory_budget_bytes": budget, "kv_tokens_without_scoring": without, "kv_tokens_with_scoring": with_flag,
            "kv_capacity_loss": round(1 - with_flag / without, 6) if without else None}


def variant_files(root, variant: dict) -> dict[str, dict]:
    """Each runtime's file for a variant: torch (.pt2), inductor (AOTInductor package), onnxruntime (.onnx)."""
    files = {"torch": variant["graph"]} | {("onnxruntime" if kind == "onnx" else kind): path
                                            for kind, path in variant.get("packages", {}).items()}
    return {runtime: {"path": path, "bytes": (root / path).stat().st_size if (root / path).is_file() else None}
            for runtime, path in files.items()}


def inspect_core(report, budget: int | None = None) -> dict:
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
            "files": variant_files(report.path, v),
        })
    weights = {a["name"]: BufferDecl.from_json(a).nbytes for v in catalog["variants"] for a in v["arguments"] if a["role"] == "weight"}
    outputs = {(v["name"], b["name"]): b["bytes"] for v in variants for b in v["buffers"] if b["role"] == "output"}
    state = sum(BufferDecl.from_json(s).nbytes for s in manifest["state"])
    return {
        "core": str(report.path),
        "digest": report.digest,  # sha256 of the canonical manifest
        "signed_by": report.signed_by,  # key id of a signature.json that verifies, else None
        "recipe": manifest["recipe"],
        "model": manifest["model"],
        "vocab_size": manifest["vocab_size"],
        "completion_token_capacity": manifest_token_capacity(manifest),
        "features": manifest["features"] | {"k": manifest["k"]},
        "targets": manifest["targets"],
        "runtimes": ["torch"] + (["onnxruntime"] if variants and all("onnxruntime" in v["files"] for v in variants) else []),
        "variants": variants,
        "memory": {"weights_bytes": sum(weights.values()), "state_bytes": state,
                   "completion_frame_bytes": sum(outputs.values())} | kv_capacity(manifest)
                  | scoring_cost(report, budget),
        "cache_kinds": kind_memory(manifest),
    }


_RANK_COLUMNS = {"rank": "rank", "prompt_scoring_buffer_bytes": "buffer bytes",
                 "prompt_scoring_graph_bytes": "graph bytes", "kv_tokens_without_scoring": "KV tokens without",
                 "kv_tokens_with_scoring": "KV tokens with", "kv_capacity_loss": "KV capacity loss"}
"""The per-rank scoring cost's columns (``scoring_cost``) and their headings."""


def render_inspection(summary: dict, console: Console, memory: bool = False) -> None:
    features = Table(title=f"core {summary['core']} ({summary['recipe']})")
    for column in ("allow_logprobs", "K", "explicit IDs", "prompt scoring", "structured output", "T", "vocab",
                   "targets"):
        features.add_column(column)
    f = summary["features"]
    features.add_row(str(f["allow_logprobs"]), str(f["k"]), str(f["explicit_ids"]), str(f["prompt_logprobs"]),
                     str(f.get("structured_output", False)), str(summary["completion_token_capacity"]), str(summary["vocab_size"]), ",".join(summary["targets"]) or "-")
    console.print(features)
    console.print(f"digest sha256:{summary['digest']}  "
                  f"{'signed by ' + summary['signed_by'] if summary['signed_by'] else 'unsigned'}", highlight=False, soft_wrap=True)
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
    runtimes = sorted({runtime for v in summary["variants"] for runtime in v["files"]}, key=["torch", "inductor", "onnxruntime"].index)
    files = Table(title=f"graph files per runtime (runtimes: {', '.join(summary['runtimes'])})")
    files.add_column("variant")
    for runtime in runtimes:
        files.add_column(runtime)
    for v in summary["variants"]:
        cells = [v["files"].get(runtime) for runtime in runtimes]
        files.add_row(v["name"], *(f"{c['path']} ({c['bytes']:,} B)" if c and c["bytes"] is not None else
                                   (c["path"] if c else "-") for c in cells))
    console.print(files)
    if memory:
        table = Table(title="physical bytes")
        table.add_column("class")
        table.add_column("bytes", justify="right")
        for name, value in summary["memory"].items():
            if name != "ranks":
                table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
        console.print(table)
        if summary["memory"].get("ranks"):
            ranks = Table(title="--prompt-logprobs cost per rank")
            columns = [c for c in _RANK_COLUMNS if c in summary["memory"]["ranks"][0]]
            for column in columns:
                ranks.add_column(_RANK_COLUMNS[column], justify="right")
            for row in summary["memory"]["ranks"]:
                ranks.add_row(*(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in columns))
            console.print(ranks)
        kinds = Table(title="state per cache kind")
        for column in ("kind", "layers", "positions per slot", "buffers", "bytes"):
            kinds.add_column(column, justify="right" if column in ("layers", "bytes") else "left")
        for kind, row in summary["cache_kinds"].items():
            kinds.add_row(kind, str(row["layers"]), str(row["positions_per_slot"] or "-"), ", ".join(row["buffers"]),
                          f"{row['state_bytes']:,}")
        console.print(kinds)
