"""export-core: run a recipe, prepare kernels, capture every variant, write and validate a core.

Stages, in order: build (recipe reads the checkpoint), prepare kernels (ahead of any
capture), capture (``torch.export`` per variant), write (weights once, catalog, manifest
with a sha256 per file), validate; only a valid core is renamed into place.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ignition.catalog.buffers import TOKEN_BITMASK
from ignition.catalog.contract import FORMAT_VERSION
from ignition.catalog.enums import Operation
from ignition.catalog.model import CATALOG_FILE, KERNELS_FILE, MANIFEST_FILE, WEIGHTS_FILE
from ignition.exporter.publish import check_output, discard, publish, recover, staging_dir
from ignition.exporter.signing import sign_core
from ignition.exporter.tracing import capture, dynamic_shapes, example_buffers  # noqa: F401 (re-exported)
from ignition.exporter.weights_file import save_aligned
from ignition.catalog.hashing import dump_json, hash_tree
from ignition.recipes.base import ExportOptions, GraphBuild, RecipeBuild
from ignition.recipes.registry import build_recipe
from ignition.exporter.saving import ExportError, save_program  # noqa: F401 (re-exported)

Progress = Callable[[str, str], None]  # (stage, item)


def model_section(model: dict) -> dict:
    """The manifest's ``model``: the recipe's summary, and for BF16/FP16 the softmax row length the attention was
    traced for (``recipes/attention.SHORT_ROW``, measured here: ``catalog/softmax_order.py``), which a load checks
    against its own CPU."""
    from ignition.recipes.attention import SHORT_ROW

    return model if model["dtype"] == "float32" else {**model, "softmax_short_row": SHORT_ROW}


def manifest_for(build: RecipeBuild, options: ExportOptions, files: dict[str, str], kernels: bool) -> dict:
    has_ids = any(g.variant.layout.get("logprobs") and g.variant.layout["logprobs"]["explicit_ids"] for g in build.graphs)
    scored = any(g.variant.layout.get("prompt_logprobs") for g in build.graphs)
    constrained = any(a.name == TOKEN_BITMASK for g in build.graphs for a in g.variant.arguments)
    return {
        "format_version": FORMAT_VERSION,
        "recipe": build.recipe,
        "model": model_section(build.model),
        "vocab_size": build.vocab_size,
        "vocab_padded": build.vocab_padded,
        "completion_token_capacity": build.token_capacity,
        "k": build.k,
        "capacities": sorted({g.variant.capacity for g in build.graphs if g.variant.operation is Operation.DECODE}),
        "chunk_limit": build.chunk_limit,
        "padding_rule": "smallest_capacity_at_least_batch",
        "eos_token_id": build.eos_token_id,
        "features": {"allow_logprobs": build.k > 0, "explicit_ids": has_ids, "prompt_logprobs": scored,
                     "structured_output": constrained},
        "state": [s.to_json() for s in build.state],
        "weights": WEIGHTS_FILE,
        "catalog": CATALOG_FILE,
        "kernels": KERNELS_FILE if kernels else None,
        "targets": list(options.targets),
        "tokenizer": "tokenizer" if build.tokenizer_dir else None,
        "files": files,
    }


def _checked(capture: Callable, build: RecipeBuild, kernels: dict | None) -> Callable:
    """``capture``, refusing a graph whose reduction does not have the shape its prepared launches were built for."""
    if kernels is None:
        return capture

    def capture_and_check(graph: GraphBuild, weights):
        from ignition.exporter.prepare import check_captured_launches
        program = capture(graph, weights)
        mismatch = check_captured_launches(build, graph, program)
        if mismatch:
            raise ExportError(f"variant {graph.variant.name}: {mismatch}")
        return program
    return capture_and_check


def export_core(options: ExportOptions, out: Path, *, overwrite: bool = False,
                progress: Progress = lambda stage, item: None, signing_key=None) -> dict[str, float]:
    """Export a core to ``out``; returns wall seconds per stage (``capture:<variant>`` each variant's; in capture
    workers those overlap, and ``capture (N workers)`` is their wall time). ``signing_key`` (an Ed25519 private
    key, see ``ignition.exporter.signing``) adds signature.json over the validated core's digest."""
    from ignition.validate.core import validate_core  # validation is the last export stage

    timings: dict[str, float] = {}
    out = Path(out)
    for line in recover(out):
        progress("recover", line)
    check_output(out, overwrite, {"checkpoint": options.checkpoint, "tokenizer directory": options.tokenizer})
    staging = staging_dir(out)  # before any work: proves --out's directory is writable
    try:
        started = time.perf_counter()
        progress("build", options.recipe)
        build = build_recipe(options)
        if options.onnx:
            from ignition.exporter.onnx_export import check_exportable
            check_exportable(build)
        timings["build"] = time.perf_counter() - started
        started = time.perf_counter()
        kernels = None
        if options.targets:
            from ignition.exporter.prepare import prepare_build_kernels
            progress("prepare", ",".join(options.targets))
            kernels = prepare_build_kernels(build, options.targets, staging)
            (staging / KERNELS_FILE).write_bytes(dump_json(kernels))
        timings["prepare"] = time.perf_counter() - started

        (staging / "graphs").mkdir()
        programs = {}  # kept for the ONNX stage
        group_name = None
        if build.parallel is not None:  # every rank's graphs, each traced at its rank of a fake group
            from ignition.exporter.sharded import capture_ranks
            group_name = capture_ranks(build, staging, _checked(capture, build, kernels), save_program, progress,
                                       timings)
        from ignition.exporter.workers import CaptureWorkerError, capture_in_workers, capture_jobs, capture_order
        jobs = capture_jobs(options, build)
        written: dict[str, str] = {}  # file -> the sha256 its writer took as it wrote it

        def write_weights() -> None:
            started = time.perf_counter()
            written[WEIGHTS_FILE] = save_aligned(build.weights, staging / WEIGHTS_FILE)
            timings["write:weights"] = time.perf_counter() - started

        ahead = {}  # graph file -> ReadAhead: each read as its worker saved it, while the others still capture
        variants = {graph.variant.name: graph.variant for graph in build.graphs}

        def read_captured(name: str) -> None:
            from ignition.validate.graphs import read_ahead
            variant = variants[name]
            try:
                ahead[variant.graph_file] = read_ahead(staging / variant.graph_file, variant.to_json())
            except Exception:  # noqa: BLE001  none kept: the validation reads the file itself, and reports what fails
                pass

        if jobs > 1:  # each worker builds the recipe and saves its variants' .pt2 files (exporter/workers.py)
            started = time.perf_counter()
            try:  # this process writes the weights meanwhile, then reads each saved graph ahead of validation
                timings |= capture_in_workers(options, capture_order(build.graphs), staging, kernels is not None,
                                              jobs, progress, meanwhile=write_weights, captured=read_captured)
            except CaptureWorkerError as exc:
                raise ExportError(str(exc)) from None
            timings[f"capture ({jobs} workers)"] = time.perf_counter() - started
        for index, graph in enumerate(build.graphs if build.parallel is None and jobs == 1 else (), 1):
            started = time.perf_counter()
            progress("capture", f"variant {index} of {len(build.graphs)}: {graph.variant.name}")
            program = capture(graph, build.weights)
            if kernels is not None:
                from ignition.exporter.prepare import check_captured_launches
                mismatch = check_captured_launches(build, graph, program)
                if mismatch:
                    raise ExportError(f"variant {graph.variant.name}: {mismatch}")
            save_program(program, staging, graph.variant.graph_file)
            timings[f"capture:{graph.variant.name}"] = time.perf_counter() - started
            if options.onnx:
                programs[graph.variant.name] = program
            if options.compile == "inductor":  # after kernel preparation; the reduction stays one opaque op
                from ignition.exporter.compile import compile_inductor, package_path
                started = time.perf_counter()
                progress("compile", f"variant {index} of {len(build.graphs)}: {graph.variant.name}")
                package = package_path(Path(graph.variant.graph_file)).as_posix()
                compile_inductor(program, staging / package)
                graph.variant.packages["inductor"] = package
                timings[f"compile:{graph.variant.name}"] = time.perf_counter() - started

        started = time.perf_counter()
        progress("write", str(out))
        if WEIGHTS_FILE not in written:
            write_weights()
        if options.onnx:  # after the weights: each graph's external data points into weights.safetensors
            from ignition.exporter.onnx_export import export_variants
            timings |= export_variants(build, programs, staging, WEIGHTS_FILE, progress)
        if build.tokenizer_dir is not None:  # a private copy the recipe made (recipes/tokenizer.py): no links
            shutil.copytree(build.tokenizer_dir, staging / "tokenizer", symlinks=True)
        for name, data in build.extra_files.items():
            (staging / name).write_bytes(data)
        (staging / CATALOG_FILE).write_bytes(dump_json({"variants": [g.variant.to_json() for g in build.graphs]}))
        files = hash_tree(staging, exclude=(MANIFEST_FILE,), known=written)
        manifest = manifest_for(build, options, files, kernels is not None)
        if build.parallel is not None:
            from ignition.exporter.sharded import tensor_parallel_manifest
            manifest["tensor_parallel"] = tensor_parallel_manifest(build, group_name, files)
        (staging / MANIFEST_FILE).write_bytes(dump_json(manifest))
        timings["write"] = time.perf_counter() - started

        started = time.perf_counter()
        progress("validate", str(out))
        # every rule, on the programs load_core reads; the weights' digest as written, the graphs as read ahead
        report = validate_core(staging, torch_load=False, written=written, read_ahead=ahead)
        timings["validate"] = time.perf_counter() - started
        if not report.ok:
            raise ExportError("the exported core failed validation and was not published:\n"
                              + "\n".join(f"  {v}" for v in report.violations))
        if signing_key is not None:
            sign_core(staging, signing_key)
        publish(staging, out, overwrite)
    finally:
        discard(staging, out)  # a failed export's staging directory (published: already renamed away)
    return timings
