"""exporter/saving.save_program and tracing.capture: faster than torch's defaults, with the same archive.

``torch.export.save`` runs a canonical-form self-test whose deep copy it throws away; ``save_program``
skips it only where torch's source shows the result discarded, and the archive stays byte for byte the
one torch writes. Capture records no per-node Python stack trace (time, and this checkout's paths)."""

from __future__ import annotations

import io
import types
import zipfile

import torch

from ignition.exporter.saving import _canonical_check_is_discarded, save_program


class Windowed(torch.nn.Module):
    def forward(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        x = buffers["x"]
        buffers["cache"][: x.shape[0]].copy_(x * 2)
        return torch.nn.functional.linear(x, buffers["w"]).softmax(-1)


def _program() -> torch.export.ExportedProgram:
    example = {"x": torch.randn(4, 8), "w": torch.randn(3, 8), "cache": torch.zeros(16, 8)}
    rows = torch.export.Dim("rows", min=2, max=16)
    program = torch.export.export(Windowed(), (example,), strict=False,
                                  dynamic_shapes=({"x": {0: rows}, "w": None, "cache": None},))
    program._example_inputs = None  # as capture does
    return program


def _members(data: bytes) -> dict[str, bytes]:
    """Every member but the random ``serialization_id``."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()
                if not info.filename.endswith("serialization_id")}


def test_the_skipped_self_test_leaves_the_archive_byte_for_byte(tmp_path):
    program = _program()
    (tmp_path / "plain").mkdir()
    torch.export.save(program, tmp_path / "plain" / "g.pt2")
    save_program(program, tmp_path, "g.pt2")
    members = _members((tmp_path / "g.pt2").read_bytes())
    assert any(name.endswith(".json") and b"graph_module" in data for name, data in members.items())
    assert members == _members((tmp_path / "plain" / "g.pt2").read_bytes())
    loaded = torch.export.load(tmp_path / "g.pt2").module()
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    assert torch.equal(loaded({"x": x, "w": w, "cache": torch.zeros(16, 8)}), torch.nn.functional.linear(x, w).softmax(-1))


def test_the_skip_is_taken_on_this_torch_and_only_where_the_result_is_discarded():
    from torch._export.serde import serialize

    assert _canonical_check_is_discarded(serialize)  # else every export pays the deep copy again

    class Uses:
        def serialize(self, ep):
            kept = canonicalize(ep, set())  # noqa: F821 (parsed, never run)
            return kept

    class Bare:
        def serialize(self, ep):
            canonicalize(ep, set())  # noqa: F821
            return ep

    assert not _canonical_check_is_discarded(Uses.serialize)
    assert _canonical_check_is_discarded(Bare.serialize)


def test_captured_programs_carry_no_stack_traces():
    from ignition.catalog.enums import Role
    from ignition.exporter.tracing import capture

    class Argument:
        def __init__(self, name, shape):
            self.name, self.role, self.shape = name, Role.INPUT, shape

        def empty(self):
            return torch.zeros(self.shape)

    graph = types.SimpleNamespace(module=Windowed(), variant=types.SimpleNamespace(
        arguments=[Argument("x", (4, 8)), Argument("w", (3, 8)), Argument("cache", (16, 8))], layout={}))
    assert any(node.meta.get("stack_trace") for node in _program().graph.nodes)  # torch's default records them
    program = capture(graph, {})
    assert not any(node.meta.get("stack_trace") for node in program.graph.nodes)
    assert not torch.fx.config.do_not_emit_stack_traces  # restored
