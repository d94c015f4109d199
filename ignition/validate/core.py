"""validate-core: JSON Schema first, then every semantic rule; all findings, never a traceback."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ignition.catalog.contract import FORMAT_CHANGES, FORMAT_VERSION
from ignition.catalog.model import MANIFEST_FILE
from ignition.validate.cache_kinds import check_cache_kinds
from ignition.validate.contract_rules import check_catalog
from ignition.validate.files import METADATA_MAX_BYTES, check_files, check_weights, read_core_file, safe_path
from ignition.validate.geometry import check_geometry, check_graph_vocabulary
from ignition.validate.parallel import check_program, check_section, named_files, rank_graph_files
from ignition.validate.report import Violation
from ignition.validate.schema import parse_json, schema_violations
from ignition.validate.signature import check_provenance

if TYPE_CHECKING:  # graphs.py imports torch: loaded only where graphs are read
    from ignition.validate.graphs import ReadAhead


@dataclass(slots=True)
class ValidationReport:
    path: Path
    violations: list[Violation] = field(default_factory=list)
    manifest: dict | None = None
    catalog: dict | None = None
    kernels: dict | None = None
    programs: dict = field(default_factory=dict)  # variant name -> loaded torch.export program (reused by loaders)
    digest: str | None = None  # core digest: sha256 of manifest.json's bytes, its canonical JSON (hashing every file)
    signed_by: str | None = None  # key id of a signature.json that verifies (against trusted_key when given)
    trusted: bool = False  # the core's signature verified against the caller's trusted key
    read: dict[str, bytes] = field(default_factory=dict, repr=False)  # metadata files as read once and parsed

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict:
        return {"core": str(self.path), "valid": self.ok, "digest": self.digest,
                "violations": [v.as_dict() for v in self.violations]}


def _read_bytes(root: Path, rel: str, where: str, report: ValidationReport) -> bytes | None:
    """The file's bytes, read once: kept in ``report.read`` so its sha256 is taken from what was parsed."""
    data, problems = read_core_file(root, rel, where, METADATA_MAX_BYTES)
    report.violations += problems
    if data is None:
        return None
    report.read[rel] = data
    return data


def _read_json(root: Path, rel: str, where: str, report: ValidationReport, data: bytes | None = None):
    data = _read_bytes(root, rel, where, report) if data is None else data
    if data is None:
        return None
    document, problems = parse_json(data, rel)
    report.violations += problems
    return document


def validate_core(path: str | Path, *, check_graphs: bool = True, expect_digest: str | None = None,
                  trusted_key=None, rank: int | None = None, hashed_by_caller: Collection[str] = (),
                  torch_load: bool = True, written: Mapping[str, str] | None = None,
                  read_ahead: Mapping[str, ReadAhead] | None = None) -> ValidationReport:
    """All findings for the core at ``path``; never raises for a bad core.

    ``expect_digest``: the core digest the caller expects (CORE-DIGEST). ``trusted_key``: an
    Ed25519 public key (or a PEM file path, loaded first: SigningError names a bad one) whose
    signature the core must carry (SIGNATURE); ``report.trusted`` is set when it verifies.
    ``rank``: of a sharded core, load (and check) only that rank's graphs into ``report.programs``
    (a runtime rank); by default every rank's graphs are checked and rank 0's are kept.
    ``hashed_by_caller``: core-relative files whose sha256 the caller checks on the bytes it reads once and
    loads (``load_core``: its weights and graphs); here they are only checked to exist.
    ``torch_load``: load each graph with ``torch.export.load`` (GRAPH-LOAD); False reads each with the program
    reader ``load_core`` runs (``validate/program_reader.py``) and checks every graph rule on that program
    instead: export-core's own last stage, on graphs ``torch.export.save`` has just written.
    ``written``: core-relative files -> the sha256 the caller took of the bytes as it wrote them (export-core's
    weights), compared with the manifest's instead of reading the file again. ``read_ahead``: graph files ->
    ``validate.graphs.ReadAhead``, each file as the caller read it once before (export-core, while other variants
    were still capturing); with ``torch_load`` False its digest is the one compared with the manifest's and its
    program the one checked, so what is checked is what the digest covers. Every rule still runs.
    """
    root = Path(path)
    report = ValidationReport(root)
    if isinstance(trusted_key, (str, Path)):
        from ignition.catalog.signatures import load_trusted_key
        trusted_key = load_trusted_key(trusted_key)
    if expect_digest is not None:
        expect_digest = expect_digest.lower().removeprefix("sha256:")
    try:
        ahead = dict(read_ahead or {}) if not torch_load else {}
        _validate(root, report, check_graphs, expect_digest, trusted_key, rank, frozenset(hashed_by_caller),
                  torch_load, dict(written or {}) | {rel: a.sha256 for rel, a in ahead.items()}, ahead)
    except Exception as exc:  # a validator bug must still produce a clean rejection
        report.violations.append(Violation("VALIDATOR-ERROR", str(root), f"{type(exc).__name__}: {exc}"))
    return report


def _validate(root: Path, report: ValidationReport, check_graphs: bool, expect_digest, trusted_key, rank,
              hashed_by_caller: frozenset[str] = frozenset(), torch_load: bool = True,
              digested: dict[str, str] | None = None, ahead: dict[str, ReadAhead] | None = None) -> None:
    ahead = ahead or {}
    if not (root / MANIFEST_FILE).is_file():
        report.violations.append(Violation("CORE-MISSING", str(root), f"expected a core directory holding {MANIFEST_FILE}"))
        return
    manifest_bytes = _read_bytes(root, MANIFEST_FILE, "core", report)  # read once: parsed and digested alike
    manifest = _read_json(root, MANIFEST_FILE, "core", report, manifest_bytes) if manifest_bytes is not None else None
    if manifest is None:
        return
    provenance = check_provenance(root, manifest_bytes, manifest, expect_digest, trusted_key)
    report.violations += provenance.violations
    report.digest, report.signed_by, report.trusted = provenance.digest, provenance.signed_by, provenance.trusted
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        # before the schema: an older format's manifest need not match this format's schema
        report.violations.append(Violation("FORMAT-VERSION", f"{MANIFEST_FILE}:format_version",
                                           f"expected {FORMAT_VERSION}, found {version}"
                                           + (f" ({FORMAT_CHANGES[version]}; re-export the core with this Ignition)"
                                              if version in FORMAT_CHANGES else "")))
        return
    schema_found = schema_violations(manifest, "manifest.schema.json", MANIFEST_FILE)
    report.violations += schema_found
    if schema_found:
        return
    report.manifest = manifest
    catalog = _read_json(root, manifest["catalog"], f"{MANIFEST_FILE}:catalog", report)
    if catalog is None:
        return
    schema_found = schema_violations(catalog, "catalog.schema.json", manifest["catalog"])
    report.violations += schema_found
    if schema_found:
        return
    report.catalog = catalog
    variants = catalog["variants"]
    named = {manifest["catalog"]: "manifest.json:catalog", manifest["weights"]: "manifest.json:weights"}
    named |= {v["graph"]: f"variant {v['name']}" for v in variants}
    named |= {path: f"variant {v['name']}: packages.{kind}" for v in variants for kind, path in v.get("packages", {}).items()}
    if manifest["kernels"] is not None:
        named[manifest["kernels"]] = "manifest.json:kernels"
    named |= named_files(manifest)
    report.violations += check_catalog(manifest, catalog)
    report.violations += check_section(root, manifest, variants)
    report.violations += check_geometry(root, manifest, catalog)
    report.violations += check_cache_kinds(manifest, variants)
    kernel_table = None
    if manifest["kernels"] is not None:
        kernel_table = _read_json(root, manifest["kernels"], f"{MANIFEST_FILE}:kernels", report)
        if kernel_table is not None:
            found = schema_violations(kernel_table, "kernels.schema.json", manifest["kernels"])
            report.violations += found
            if not found:
                from ignition.validate.kernels import check_sharded_launches, validate_kernel_table
                report.kernels = kernel_table
                named |= {k["file"]: f"{manifest['kernels']}: {k['key']}" for k in kernel_table["kernels"]}
                report.violations += validate_kernel_table(root, kernel_table, {v["name"]: v["launches"] for v in variants})
                report.violations += check_sharded_launches(manifest, variants, kernel_table)
    elif any(v["launches"] for v in variants):
        report.violations.append(Violation("KERNEL-MISSING", MANIFEST_FILE, "variants name launches but the core has no kernel table"))
    file_found = check_files(root, manifest["files"], named, hashed_by_caller, report.read, digested)
    report.violations += file_found
    broken = {v.where for v in file_found}
    weights_path, _ = safe_path(root, manifest["weights"], "weights")
    if weights_path is not None and weights_path.is_file():
        report.violations += check_weights(weights_path, variants)
    if check_graphs:
        from ignition.validate.graphs import check_graph, read_graph
        load = check_graph if torch_load else read_graph
        ranks = manifest.get("tensor_parallel", {}).get("ranks", 1)
        for graph_rank in range(ranks) if rank is None else (rank,):
            files = {v["name"]: v["graph"] for v in variants} | rank_graph_files(manifest, graph_rank)
            for variant in variants:
                rel = files[variant["name"]]
                graph_path, _ = safe_path(root, rel, variant["name"])
                if graph_path is None or not graph_path.is_file() or rel in broken:
                    continue  # already reported as a file finding
                found, program = read_graph(graph_path, variant, ahead=ahead[rel]) if rel in ahead else \
                    load(graph_path, variant)
                report.violations += found
                if program is not None:
                    report.violations += check_program(program, manifest, rel)
                    report.violations += check_graph_vocabulary(program, manifest, rel)
                    if graph_rank == (rank or 0):
                        report.programs[variant["name"]] = program
        from ignition.validate.onnx_graphs import check_onnx
        report.violations += check_onnx(root, manifest, variants, broken)
