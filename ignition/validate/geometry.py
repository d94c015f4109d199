"""Geometry rules: the manifest's numbers against the tensors they describe.

A manifest field is only trusted when a tensor confirms it: num_slots, max_seq_len and the
model sizes against the declared state (catalog/geometry.py says which extent is which field),
vocab_padded and hidden_size against the weights file's header (read without loading a tensor),
the tokenizer's ids against vocab_size, and the catalog's operations against what the runtime
needs (one prefill at the chunk limit, at least one decode). The graphs' signatures are tied to
the same declarations by STATE-DECL, WEIGHT-DECL and GRAPH-SIGNATURE, and vocab_size and
vocab_padded to the constants and logits each graph hands to Ignition's reduction ops
(GEOM-VOCAB-GRAPH, ``check_graph_vocabulary``): a manifest that claims another vocabulary than
the graphs compute with is refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

from ignition.catalog.enums import Operation
from ignition.catalog.geometry import (ATTENTION_RECIPES, ATTENTION_WEIGHTS, FP32_STATE, MODEL_DTYPE_STATE,
                                       STATE_SHAPES, SYMBOL_RULES, VOCAB_WEIGHTS, field_name, manifest_value)
from ignition.validate.files import METADATA_MAX_BYTES, read_core_file, safe_path
from ignition.validate.paging import check_paging
from ignition.validate.parallel import rank_view
from ignition.validate.report import Violation
from ignition.validate.schema import parse_json

_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _compare(manifest: dict, what: str, expression: tuple, shape: list[int]) -> list[Violation]:
    """Each extent of ``shape`` against the manifest field its expression names."""
    if len(shape) != len(expression):
        return [Violation("GEOM-MODEL", what, f"expected {len(expression)} dimensions {list(expression)}, found {shape}")]
    found = []
    for axis, (symbol, extent) in enumerate(zip(expression, shape)):
        expected = symbol if isinstance(symbol, int) else manifest_value(manifest, symbol)
        if expected == extent:
            continue
        rule = "GEOM-MODEL" if isinstance(symbol, int) else SYMBOL_RULES.get(symbol, "GEOM-MODEL")
        source = f"the constant {symbol}" if isinstance(symbol, int) else f"{field_name(symbol)} = {expected}"
        if expected is None:
            source = f"{field_name(symbol)}, which the manifest lacks"
        found.append(Violation(rule, what, f"dimension {axis} ({symbol}) must equal {source}; the tensor has {extent}"))
    return found


def check_state(manifest: dict) -> list[Violation]:
    found = []
    for decl in manifest["state"]:
        expression = STATE_SHAPES.get(decl["name"])
        if expression is None:
            continue
        what = f"manifest.json:state {decl['name']} {decl['shape']}"
        found += _compare(manifest, what, expression, decl["shape"])
        if decl["name"] in MODEL_DTYPE_STATE and decl["dtype"] != manifest["model"]["dtype"]:
            found.append(Violation("GEOM-MODEL", what, f"expected the model dtype {manifest['model']['dtype']}, "
                                   f"found {decl['dtype']}"))
        if decl["name"] in FP32_STATE and decl["dtype"] != "float32":
            found.append(Violation("GEOM-MODEL", what, f"expected float32 (kept in FP32 whatever the model dtype), "
                                   f"found {decl['dtype']}"))
    return found


def weight_shapes(path: Path) -> dict[str, tuple[str, list[int]]] | None:
    """name -> (dtype, shape) from the safetensors header; None when unreadable (WEIGHT-DECL reports it)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: (_DTYPES.get(f.get_slice(name).get_dtype(), f.get_slice(name).get_dtype()),
                           list(f.get_slice(name).get_shape())) for name in f.keys()}
    except Exception:  # safetensors raises several exception types for corrupt headers
        return None


def check_vocab_weights(manifest: dict, header: dict[str, tuple[str, list[int]]], weights_file: str) -> list[Violation]:
    present = [name for name in VOCAB_WEIGHTS if name in header]
    if not present:
        return [Violation("GEOM-VOCAB-TENSOR", weights_file, f"no tensor carries the vocabulary: expected one of "
                          f"{sorted(VOCAB_WEIGHTS)} with {manifest['vocab_padded']} rows")]
    found = []
    for name in present:
        dtype, shape = header[name]
        found += _compare(manifest, f"{weights_file}: {name} {shape}", VOCAB_WEIGHTS[name], shape)
        if dtype != manifest["model"]["dtype"]:
            found.append(Violation("GEOM-MODEL", f"{weights_file}: {name}",
                                   f"expected the model dtype {manifest['model']['dtype']}, found {dtype}"))
    return found


def check_attention_weights(manifest: dict, header: dict[str, tuple[str, list[int]]], weights_file: str) -> list[Violation]:
    """Query and KV heads (a rank's share of a sharded core) and hidden_size against the first layer's attention
    projections in the weights header; recipes whose heads are not ``head_dim`` wide are not checked."""
    if manifest.get("recipe") not in ATTENTION_RECIPES:
        return []
    view, ranks = copy.deepcopy(manifest), (manifest.get("tensor_parallel") or {}).get("ranks", 1)
    for field in ("num_heads", "num_kv_heads"):
        if isinstance(view["model"].get(field), int) and view["model"][field] % ranks == 0:
            view["model"][field] //= ranks  # TP-RANKS reports counts that do not divide
    return [violation for name, expression in ATTENTION_WEIGHTS.items() if name in header
            for violation in _compare(view, f"{weights_file}: {name} {header[name][1]}", expression, header[name][1])]


def check_limits(manifest: dict, variants: list[dict]) -> list[Violation]:
    """Fields that bound others: slots hold the widest decode, the KV holds a chunk, EOS is a token."""
    found = []
    slots, seq = manifest_value(manifest, "num_slots"), manifest_value(manifest, "max_seq_len")
    widest = max((v["capacity"] for v in variants if v["operation"] == Operation.DECODE), default=0)
    if slots is not None and slots < widest:
        found.append(Violation("GEOM-SLOTS", field_name("num_slots"), f"expected at least the widest decode "
                               f"capacity {widest} (every lane needs its own slot), found {slots}"))
    limit = manifest["chunk_limit"]
    if seq is not None and limit is not None and limit > seq:
        found.append(Violation("GEOM-SEQ", "manifest.json:chunk_limit", f"a prefill chunk of {limit} rows does not "
                               f"fit {field_name('max_seq_len')} = {seq}"))
    eos = manifest["eos_token_id"]
    if eos is not None and eos >= manifest["vocab_size"]:
        found.append(Violation("GEOM-VOCAB", "manifest.json:eos_token_id",
                               f"expected a token id below vocab_size {manifest['vocab_size']}, found {eos}"))
    return found


def check_operations(manifest: dict, variants: list[dict]) -> list[Violation]:
    prefill = [v for v in variants if v["operation"] == Operation.PREFILL]
    found = []
    if len(prefill) != 1:
        found.append(Violation("CATALOG-PREFILL", "catalog.json", f"expected exactly one PREFILL variant, found "
                               f"{len(prefill)} ({', '.join(v['name'] for v in prefill) or 'none'})"))
    for variant in prefill:
        chunk = next((a["shape"] for a in variant["arguments"] if a["name"] == "chunk_input_ids"), None)
        if chunk != [manifest["chunk_limit"]]:
            found.append(Violation("CATALOG-PREFILL", f"variant {variant['name']}: chunk_input_ids", f"expected shape "
                                   f"[{manifest['chunk_limit']}] (manifest.json:chunk_limit), found {chunk}"))
    if not any(v["operation"] == Operation.DECODE for v in variants):
        found.append(Violation("CATALOG-DECODE", "catalog.json", "expected at least one DECODE variant, found none"))
    return found


def check_tokenizer(root: Path, manifest: dict) -> list[Violation]:
    """The tokenizer's JSON files parse, tokenizer.json loads, and its ids stay below vocab_size."""
    if manifest["tokenizer"] is None:
        return []
    directory, problems = safe_path(root, manifest["tokenizer"], "manifest.json:tokenizer")
    if directory is None or not directory.is_dir():
        return problems or [Violation("FILE-MISSING", manifest["tokenizer"], "named by manifest.json:tokenizer but absent")]
    found, read = [], {}
    for path in sorted(directory.glob("*.json")):  # only listed files: FILE-EXTRA names the others, unread
        rel = path.relative_to(root).as_posix()
        if rel not in manifest["files"]:
            continue
        data, problems = read_core_file(root, rel, "manifest.json:tokenizer", METADATA_MAX_BYTES, manifest["files"])
        if data is None:
            return problems
        read[rel] = data
        found += parse_json(data, rel)[1]
    rel = (directory / "tokenizer.json").relative_to(root).as_posix()
    if found or rel not in read:
        return [Violation("TOKENIZER-PARSE", v.where, v.message) for v in found]
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_str(read[rel].decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for every malformed file
        return [Violation("TOKENIZER-PARSE", rel, f"does not load as a tokenizer: {str(exc)[:200]}")]
    id_end = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if id_end > manifest["vocab_size"]:
        return [Violation("GEOM-TOKENIZER", rel, f"token ids must stay below manifest.json:vocab_size = "
                          f"{manifest['vocab_size']}; the tokenizer's reach {id_end - 1}")]
    return []


def check_geometry(root: Path, manifest: dict, catalog: dict) -> list[Violation]:
    """Every GEOM-*, CATALOG-PREFILL/-DECODE and TOKENIZER-PARSE finding of a schema-valid core."""
    variants = catalog["variants"]
    found = check_state(rank_view(manifest, "state")) + check_limits(manifest, variants) \
        + check_operations(manifest, variants) + check_paging(manifest, variants)
    weights_path, _ = safe_path(root, manifest["weights"], "manifest.json:weights")
    header = weight_shapes(weights_path) if weights_path is not None and weights_path.is_file() else None
    if header is not None:
        found += check_vocab_weights(rank_view(manifest, "weights"), header, manifest["weights"])
        found += check_attention_weights(manifest, header, manifest["weights"])
    return found + check_tokenizer(root, manifest)


def _call_arguments(node) -> dict:
    """Schema argument name -> value of an operator call node (positional and keyword)."""
    schema = node.target._schema
    values = {arg.name: value for arg, value in zip(schema.arguments, node.args)}
    return values | dict(node.kwargs)


def check_graph_vocabulary(program, manifest: dict, where: str) -> list[Violation]:
    """GEOM-VOCAB-GRAPH: every call to an ``ignition`` op in the loaded ``program`` passes the manifest's
    vocab_size (a shard's op too: it derives its lanes from vocab_start and the global size), its vocab_shard
    (a sharded core), and logits whose last extent is vocab_padded (a shard's: vocab_shard)."""
    import torch

    from ignition.validate.program_facts import tensor_facts

    section = manifest.get("tensor_parallel") or {}
    expected = {"vocab_size": manifest["vocab_size"], "vocab_shard": section.get("vocab_shard")}
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
                or node.target.namespace != "ignition":
            continue
        values, op = _call_arguments(node), node.target.name()
        for name, wanted in expected.items():
            if isinstance(values.get(name), int) and values[name] != wanted:
                found.append(Violation("GEOM-VOCAB-GRAPH", f"{where}: {op}", f"the graph computes with {name} "
                                       f"{values[name]}; manifest.json says {wanted}"))
        logits = values.get("logits")
        value = tensor_facts(logits)
        field = "vocab_shard" if "vocab_start" in values else "vocab_padded"
        columns = expected["vocab_shard"] if field == "vocab_shard" else manifest["vocab_padded"]
        if value is not None and value.dim() >= 1 and value.shape[-1] != columns:
            found.append(Violation("GEOM-VOCAB-GRAPH", f"{where}: {op}: logits",
                                   f"expected {columns} columns ({field}), found {list(value.shape)}"))
    return found
