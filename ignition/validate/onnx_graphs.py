"""ONNX rules: a core's ``graphs/<variant>.onnx`` files, one per ``.pt2`` variant, against the catalog.

Each file is parsed as protobuf only (nothing executes), passed through
``onnx.checker.check_model(full_check=True)``, and compared with the variant's declarations as
``ignition.catalog.onnx_layout`` lays them out: inputs, outputs, external weights, and the data
flow that makes binding ``<buffer>`` and ``<buffer>.out`` to one memory safe.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ignition.catalog.enums import Role
from ignition.catalog.model import BufferDecl
from ignition.catalog.operators import ONNX_CUSTOM_DOMAINS
from ignition.catalog.onnx_layout import (ONNX_DTYPES, ONNX_OPSET, expected_inputs, expected_outputs, external_data,
                                          onnx_path, output_name, safetensors_offsets, weights_as_inputs,
                                          written_buffers)
from ignition.validate.files import GRAPH_MAX_BYTES, read_core_file, safe_path
from ignition.validate.onnx_allocations import onnx_allocation_violations
from ignition.validate.report import Violation

_DTYPE_NAMES = {code: name for name, code in ONNX_DTYPES.items()}
STANDARD_DOMAINS = ("", "ai.onnx")
ALLOWED_DOMAINS = STANDARD_DOMAINS + ONNX_CUSTOM_DOMAINS
ALIASING_OPS = ("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def check_pairing(variants: list[dict]) -> list[Violation]:
    """ONNX graphs and .pt2 variants match one-to-one: none or all, each at graphs/<name>.onnx."""
    with_onnx = [v for v in variants if "onnx" in v.get("packages", {})]
    found = []
    if with_onnx and len(with_onnx) != len(variants):
        missing = [v["name"] for v in variants if v not in with_onnx]
        found.append(Violation("ONNX-PAIRING", "catalog.json", f"every variant needs an ONNX graph once one has; "
                                                              f"missing for {', '.join(missing)}"))
    for v in with_onnx:
        if v["packages"]["onnx"] != onnx_path(v["name"]):
            found.append(Violation("ONNX-PAIRING", f"variant {v['name']}: packages.onnx",
                                   f"expected {onnx_path(v['name'])}, found {v['packages']['onnx']!r}"))
    return found


def _value_sig(value) -> tuple[str | None, list]:
    tensor = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
    return _DTYPE_NAMES.get(tensor.elem_type, f"onnx type {tensor.elem_type}"), dims


def _compare(kind: str, where: str, values, expected: list[BufferDecl]) -> list[Violation]:
    rule = "ONNX-INPUTS" if kind == "inputs" else "ONNX-OUTPUTS"
    names, wanted = [v.name for v in values], [d.name for d in expected]
    if names != wanted:
        missing = [n for n in wanted if n not in names]
        extra = [n for n in names if n not in wanted]
        detail = (f"missing {missing}" if missing else "") + ("; " if missing and extra else "") + \
                 (f"unexpected {extra}" if extra else "")
        return [Violation(rule, f"{where}: {kind}", f"expected {wanted} in order, found {names}"
                          + (f" ({detail})" if detail else ""))]
    found = []
    for value, decl in zip(values, expected):
        sig = _value_sig(value)
        if sig != (decl.dtype, decl.shape):
            found.append(Violation(rule, f"{where}: {kind[:-1]} {decl.name}",
                                   f"expected {decl.dtype} {decl.shape}, found {sig[0]} {sig[1]}"))
    return found


def _check_weights(model, where: str, weights: list[BufferDecl], weights_file: str,
                   offsets: dict[str, tuple[int, int]] | None) -> list[Violation]:
    import onnx

    found = []
    initializers = {t.name: t for t in model.graph.initializer}
    for decl in weights:
        tensor = initializers.get(decl.name)
        here = f"{where}: weight {decl.name}"
        if tensor is None:
            found.append(Violation("ONNX-WEIGHTS", here, "no initializer of that name"))
            continue
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            found.append(Violation("ONNX-WEIGHTS", here, f"expected external data in {weights_file}, found the "
                                                         f"bytes embedded in the graph"))
            continue
        sig = (_DTYPE_NAMES.get(tensor.data_type, f"onnx type {tensor.data_type}"), list(tensor.dims))
        if sig != (decl.dtype, decl.shape):
            found.append(Violation("ONNX-WEIGHTS", here, f"expected {decl.dtype} {decl.shape}, found {sig[0]} {sig[1]}"))
        entries = external_data(tensor)
        stored = offsets.get(decl.name) if offsets is not None else None
        expected = {"location": weights_file} | ({"offset": str(stored[0]), "length": str(stored[1])} if stored else {})
        if {key: entries.get(key) for key in expected} != expected or set(entries) - {"location", "offset", "length"}:
            found.append(Violation("ONNX-WEIGHTS", here, f"expected external data {expected}, found {entries}"))
    declared = {d.name for d in weights}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name not in declared:
            found.append(Violation("ONNX-WEIGHTS", f"{where}: initializer {tensor.name}",
                                   f"external data {external_data(tensor)} for a tensor that is no declared weight"))
    inputs = {v.name for v in model.graph.input}
    for name in sorted(inputs & set(initializers)):
        found.append(Violation("ONNX-WEIGHTS", f"{where}: initializer {name}", "shadows a graph input of the same name"))
    return found


def inplace_hazards(model, written: list[str]) -> list[str]:
    """Written buffers whose old value may be read after ``<buffer>.out`` is written in place.

    A runtime binds ``<buffer>`` and ``<buffer>.out`` to one memory. That is safe when every node
    reading the input, or a value that may share its memory (onnxruntime may run Identity,
    Reshape, Squeeze, Unsqueeze and Flatten as aliases), is the output's producer or one of its
    ancestors: onnxruntime runs nodes in a topological order, so every read of the old value then
    finishes before the new value lands.
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    readers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            readers[name].append(node)
    hazards = []
    for buffer in written:
        final = producer.get(output_name(buffer))
        if final is None:
            hazards.append(f"{output_name(buffer)} has no producing node")
            continue
        ancestors, stack = set(), list(final.input)
        while stack:
            node = producer.get(stack.pop())
            if node is not None and id(node) not in ancestors:
                ancestors.add(id(node))
                stack.extend(node.input)
        aliases, stack = {buffer}, [buffer]
        while stack:
            for node in readers[stack.pop()]:
                if node.op_type in ALIASING_OPS and node.input[0] in aliases and node.output[0] not in aliases:
                    aliases.add(node.output[0])
                    stack.append(node.output[0])
        late = [n for name in sorted(aliases) for n in readers[name]
                if n is not final and id(n) not in ancestors and not (n.op_type in ALIASING_OPS and n.output[0] in aliases)]
        if late:
            hazards.append(f"{buffer} is read by {', '.join(f'{n.op_type} {n.name}' for n in late[:3])}, which may "
                           f"run after {output_name(buffer)} is written in place")
    return hazards


def check_onnx_graph(data: bytes, variant: dict, weights_file: str,
                     offsets: dict[str, tuple[int, int]] | None) -> list[Violation]:
    """All ONNX findings for one variant's graph, given the file's bytes (a loader passes the very bytes it
    verified and then hands to onnxruntime)."""
    import onnx

    where = f"variant {variant['name']}: {variant['packages']['onnx']}"
    try:
        model = onnx.ModelProto()
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError and others on garbage
        return [Violation("ONNX-LOAD", where, f"not an ONNX model: {type(exc).__name__}: {str(exc)[:200]}")]
    if not model.HasField("graph"):
        return [Violation("ONNX-LOAD", where, "not an ONNX model: no graph")]
    found = []
    opsets = {o.domain: o.version for o in model.opset_import}
    if opsets.get("", opsets.get("ai.onnx", 0)) < ONNX_OPSET:
        found.append(Violation("ONNX-OPSET", where, f"expected the default-domain opset >= {ONNX_OPSET}, found {opsets}"))
    foreign = sorted({n.domain for n in model.graph.node if n.domain not in ALLOWED_DOMAINS}
                     | {d for d in opsets if d not in ALLOWED_DOMAINS} | {f.domain for f in model.functions})
    if foreign:
        found.append(Violation("ONNX-OPSET", where, f"expected standard operators only, found domains {foreign}"))
    try:
        onnx.checker.check_model(weights_as_inputs(model), full_check=True)
    except Exception as exc:  # ValidationError, InferenceError
        found.append(Violation("ONNX-CHECKER", where, f"onnx.checker (full_check=True): {str(exc).strip()[:300]}"))
    arguments = [BufferDecl.from_json(a) for a in variant["arguments"]]
    returns = [BufferDecl.from_json(r) for r in variant["returns"]]
    found += _compare("inputs", where, list(model.graph.input), expected_inputs(arguments))
    found += _compare("outputs", where, list(model.graph.output), expected_outputs(arguments, returns))
    found += _check_weights(model, where, [a for a in arguments if a.role is Role.WEIGHT], weights_file, offsets)
    found += [Violation("ONNX-INPLACE", where, hazard) for hazard in inplace_hazards(model, written_buffers(arguments))]
    return found + onnx_allocation_violations(model, variant, where)


def check_onnx(root: Path, manifest: dict, variants: list[dict], broken: set[str]) -> list[Violation]:
    """ONNX-* findings for the whole core (nothing when it has no ONNX graphs)."""
    found = check_pairing(variants)
    with_onnx = [v for v in variants if "onnx" in v.get("packages", {})]
    if not with_onnx:
        return found
    try:
        import onnx  # noqa: F401
    except ImportError:
        return found + [Violation("ONNX-LOAD", "graphs/*.onnx", "the core has ONNX graphs but the onnx package is not "
                                                              "installed to check them (pip install 'ignition[onnx]')")]
    weights_file = manifest["weights"]
    try:
        offsets = safetensors_offsets(root / weights_file) if weights_file not in broken else None
    except Exception:  # a corrupt header is already a WEIGHT-DECL finding
        offsets = None
    for variant in with_onnx:
        rel = variant["packages"]["onnx"]
        path, _ = safe_path(root, rel, variant["name"])
        if path is None or rel in broken or not path.is_file() or rel != onnx_path(variant["name"]):
            continue  # already a file or pairing finding
        data, problems = read_core_file(root, rel, variant["name"], GRAPH_MAX_BYTES)
        found += problems if data is None else check_onnx_graph(data, variant, weights_file, offsets)
    return found
