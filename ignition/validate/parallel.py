"""Tensor-parallel rules: rank count, shard geometry, exchange sizes, the same variants on every rank.

A sharded core's manifest has a ``tensor_parallel`` section (written by
ignition/exporter/sharded.py). Its numbers are trusted only where tensors and graphs confirm
them: the weights files' headers give the shard shapes, each rank's ``.pt2`` gives its
signature (the declared arguments, identical on every rank), the group size of every
collective it runs, and the word count of every exchange the sharded reduction hands to an
all-gather. Each rank's weights are bound to that rank (TP-RANK-BIND): its entry's index and
sha256, unlike any other rank's, and a rank r >= 1 file's own header metadata naming rank r.
"""

from __future__ import annotations

import copy
from pathlib import Path

from safetensors import safe_open

from ignition.catalog.parallel import (EXCHANGES, KV_HEADS_SYMBOL, RANK_METADATA, RANKS_DIR, RANKS_METADATA,
                                       SPLIT_FIELDS, padded_vocabulary, split_state)
from ignition.validate.files import check_weights, safe_path
from ignition.validate.report import Violation

TP = "manifest.json:tensor_parallel"
_EXCHANGE_OPS = {  # the stage op whose output an all-gather carries -> its exchange
    "ignition.vocab_shard_statistics.default": EXCHANGES[0],
    "ignition.vocab_shard_candidates.default": EXCHANGES[1],
    "ignition.score_shard_statistics.default": EXCHANGES[2],
    "ignition.score_shard_candidates.default": EXCHANGES[3],
}
_COLLECTIVES = ("_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default")


def rank_view(manifest: dict, what: str) -> dict:
    """The manifest as one rank sees it: KV heads per rank (``state``) or the vocabulary shard (``weights``).

    Unchanged for an unsharded core or when the numbers do not divide (TP-RANKS reports that). State that no KV head
    splits (``catalog.parallel.split_state``: MLA's latents, DeepSeek V4's one K=V head) is whole on every rank.
    """
    section = manifest.get("tensor_parallel")
    if not section:
        return manifest
    ranks, view = section["ranks"], copy.deepcopy(manifest)
    if what == "state" and _splits_kv_heads(manifest) and view["model"]["num_kv_heads"] % ranks == 0:
        view["model"]["num_kv_heads"] //= ranks
    if what == "weights":
        view["vocab_padded"] = section["vocab_shard"]
    return view


def _splits_kv_heads(manifest: dict) -> bool:
    """Whether the core has KV heads and state split by them (``catalog.parallel.split_state``)."""
    return KV_HEADS_SYMBOL in manifest["model"] and any(split_state(s["name"]) for s in manifest.get("state", []))


def rank_graph_files(manifest: dict, rank: int) -> dict[str, str]:
    """Variant name -> rank ``rank``'s graph file (empty when the section does not name that rank)."""
    files = manifest.get("tensor_parallel", {}).get("rank_files", [])
    return dict(files[rank]["graphs"]) if rank < len(files) else {}


def named_files(manifest: dict) -> dict[str, str]:
    """Every file the section names, for the FILE-* rules."""
    named = {}
    for rank, entry in enumerate(manifest.get("tensor_parallel", {}).get("rank_files", [])):
        named[entry["weights"]] = f"{TP}.rank_files[{rank}].weights"
        named |= {path: f"{TP}.rank_files[{rank}].graphs.{name}" for name, path in entry["graphs"].items()}
    return named


def check_section(root: Path, manifest: dict, variants: list[dict]) -> list[Violation]:
    """TP-RANKS, TP-VARIANTS, TP-SHARD and TP-EXCHANGE findings that need no graph."""
    section = manifest.get("tensor_parallel")
    if not section:
        return []
    ranks, found = section["ranks"], []
    model = manifest["model"]
    for split in SPLIT_FIELDS:  # the ones the manifest's model section records (heads; KV heads that split state)
        if split.field == KV_HEADS_SYMBOL and not _splits_kv_heads(manifest):
            continue  # one K=V head shared by every query head (DeepSeek V4): every rank holds it whole
        if split.field in model and model[split.field] % ranks:
            found.append(Violation("TP-RANKS", f"manifest.json:model.{split.field}", f"{model[split.field]} "
                                   f"({split.what}) cannot be divided over {ranks} ranks"))
    if section["vocab_shard"] * ranks != manifest["vocab_padded"] or \
            padded_vocabulary(manifest["vocab_size"], ranks) > manifest["vocab_padded"]:
        found.append(Violation("TP-RANKS", f"{TP}.vocab_shard", f"expected vocab_padded / ranks = "
                               f"{manifest['vocab_padded']} / {ranks} with every rank holding an equal slice of at "
                               f"least vocab_size {manifest['vocab_size']}; found vocab_shard {section['vocab_shard']}"))
    files = section["rank_files"]
    if len(files) != ranks:
        found.append(Violation("TP-RANKS", f"{TP}.rank_files", f"expected {ranks} entries (one per rank), "
                               f"found {len(files)}"))
        return found
    names = {v["name"]: v["graph"] for v in variants}
    for rank, entry in enumerate(files):
        where = f"{TP}.rank_files[{rank}]"
        if set(entry["graphs"]) != set(names):
            found.append(Violation("TP-VARIANTS", f"{where}.graphs", f"every rank must have exactly the catalog's "
                                   f"variants {sorted(names)}; found {sorted(entry['graphs'])}"))
        expected_weights = manifest["weights"] if rank == 0 else f"{RANKS_DIR}/{rank}/"
        if (rank == 0 and entry["weights"] != expected_weights) or (rank > 0 and not entry["weights"].startswith(expected_weights)):
            found.append(Violation("TP-VARIANTS", f"{where}.weights", f"rank {rank}'s weights must be "
                                   f"{'the core weights ' if rank == 0 else 'under '}{expected_weights}, found {entry['weights']!r}"))
        if rank == 0 and any(entry["graphs"].get(n) != g for n, g in names.items()):
            found.append(Violation("TP-VARIANTS", f"{where}.graphs", "rank 0's graphs must be the catalog's own files"))
        if rank > 0:
            path, problems = safe_path(root, entry["weights"], f"{where}.weights")
            found += problems
            if path is not None and path.is_file():
                found += [Violation("TP-SHARD", v.where, v.message) for v in check_weights(path, variants)]
    found += _check_shards(section, variants)
    found += _check_rank_binding(root, manifest)
    declared = [e.to_json() for e in EXCHANGES]
    if section["exchanges"] != declared:
        found.append(Violation("TP-EXCHANGE", f"{TP}.exchanges", f"expected the contract's exchange table "
                               f"{[(e['name'], e['dtype'], e['words']) for e in declared]}, found "
                               f"{[(e['name'], e['dtype'], e['words']) for e in section['exchanges']]}"))
    return found


def _rank_recorded(path: Path) -> tuple[str | None, str | None] | None:
    """(rank, ranks) from a weights file's header metadata; None when the header is unreadable (WEIGHT-DECL)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # safetensors raises several exception types for corrupt headers; check_weights names it
        return None
    return metadata.get(RANK_METADATA), metadata.get(RANKS_METADATA)


def _check_rank_binding(root: Path, manifest: dict) -> list[Violation]:
    """TP-RANK-BIND: every rank's weights are bound to that rank (index, sha256, the file's own metadata), so
    one rank's shard copied over another's, rehashed or not, is refused."""
    section, found = manifest["tensor_parallel"], []
    ranks, seen = section["ranks"], {}
    for rank, entry in enumerate(section["rank_files"]):
        where = f"{TP}.rank_files[{rank}]"
        if entry.get("rank") != rank:
            found.append(Violation("TP-RANK-BIND", f"{where}.rank", f"expected {rank}, found {entry.get('rank')!r}"))
        recorded = manifest["files"].get(entry["weights"])
        if entry.get("sha256") != recorded:
            found.append(Violation("TP-RANK-BIND", f"{where}.sha256", f"expected the sha256 the files map records "
                                   f"for {entry['weights']} ({recorded}), found {entry.get('sha256')}"))
        if entry.get("sha256") in seen:
            found.append(Violation("TP-RANK-BIND", f"{where}.sha256", f"rank {rank}'s weights are byte for byte "
                                   f"rank {seen[entry['sha256']]}'s: a shard copied over another rank's"))
        seen.setdefault(entry.get("sha256"), rank)
        path, _ = safe_path(root, entry["weights"], f"{where}.weights")  # TP-VARIANTS / FILE-* name a bad path
        recorded_rank = _rank_recorded(path) if path is not None and path.is_file() else None
        if recorded_rank is None:
            continue
        expected = (str(rank), str(ranks)) if rank else (None, None)
        if recorded_rank != expected:
            found.append(Violation("TP-RANK-BIND", f"{entry['weights']}:__metadata__", f"expected "
                                   f"{'rank ' + str(rank) + ' of ' + str(ranks) if rank else 'no rank'} (the core's "
                                   f"own weights are rank 0's), found rank {recorded_rank[0]} of {recorded_rank[1]}"))
    return found


def _check_shards(section: dict, variants: list[dict]) -> list[Violation]:
    ranks, found = section["ranks"], []
    weights = {a["name"]: a["shape"] for v in variants for a in v["arguments"] if a["role"] == "weight"}
    for name, shape in sorted(weights.items()):
        entry = section["shards"].get(name)
        where = f"{TP}.shards.{name}"
        if entry is None:
            found.append(Violation("TP-SHARD", where, "a weight argument has no shard entry"))
            continue
        full = list(entry["shard"])
        if entry["dim"] is not None and entry["dim"] < len(full):
            full[entry["dim"]] *= ranks
        if entry["shard"] != shape or entry["full"] != full or (entry["dim"] is None) != (entry["kind"] in ("replicated", "bias_once")):
            found.append(Violation("TP-SHARD", where, f"expected shard {shape} (the declared argument) and full "
                                   f"{full} ({entry['kind']}, split along dim {entry['dim']} over {ranks} ranks); "
                                   f"found shard {entry['shard']}, full {entry['full']}"))
    for name in sorted(set(section["shards"]) - set(weights)):
        found.append(Violation("TP-SHARD", f"{TP}.shards.{name}", "names no weight argument of the catalog"))
    return found


def check_program(program, manifest: dict, where: str) -> list[Violation]:
    """Every collective of one rank's program uses the core's rank count; every exchange has its table size."""
    from ignition.validate.program_facts import tensor_facts

    section = manifest.get("tensor_parallel")
    found = []
    ranks = section["ranks"] if section else 1
    for node in program.graph.nodes:
        target = str(node.target)
        if target not in _COLLECTIVES:
            continue
        if section is None:
            found.append(Violation("TP-RANKS", where, f"an unsharded core's graph runs the collective {target}"))
            continue
        group_size = ranks if target.endswith("all_reduce.default") else node.args[1]  # all_reduce names only its group
        if group_size != ranks:
            found.append(Violation("TP-RANKS", where, f"{target} gathers over {group_size} ranks, expected {ranks}"))
        if node.args[-1] != section["group"]:
            found.append(Violation("TP-RANKS", where, f"{target} uses group {node.args[-1]!r}, expected "
                                   f"{section['group']!r} ({TP}.group)"))
        source = node.args[0]
        exchange = _EXCHANGE_OPS.get(str(getattr(source, "target", "")))
        if exchange is not None:
            tensor = tensor_facts(source)
            shape = list(tensor.shape) if tensor is not None else []
            if not shape or shape[-1] != exchange.words or str(tensor.dtype) != f"torch.{exchange.dtype}":
                found.append(Violation("TP-EXCHANGE", where, f"exchange {exchange.name} must carry {exchange.words} "
                                       f"{exchange.dtype} words per row per rank; the graph hands it "
                                       f"{tensor.dtype if tensor is not None else 'no tensor'} {shape}"))
    return found
