"""AOTInductor (--compile inductor): a decode variant with the opaque logprob op compiles on CPU,
its package loads, and replaying it gives the exported program's results."""

from __future__ import annotations

import shutil

import pytest
import torch

from _decoder_cores import CoreReplay, TinyCase, save_checkpoint
from ignition.exporter.compile import CompileError, compile_inductor, package_path
from ignition.runtime.backends.aoti import load_package as load_compiled
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.validate.program_reader import ProgramModule

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                                reason="AOTInductor needs a C++ compiler")


def test_compiled_decode_matches_exported_program(tmp_path) -> None:
    case = TinyCase("qwen3", torch.float32, tie=True, vocab_size=100)
    save_checkpoint(case, tmp_path / "checkpoint", reload=False)
    export_core(ExportOptions(recipe="qwen3", checkpoint=tmp_path / "checkpoint", capacities=(2,), chunk_limit=8,
                              max_seq_len=16, packed_prefill=False), tmp_path / "core")  # decode.c2, prefill.t8
    replay = CoreReplay(tmp_path / "core")
    graph = tmp_path / "core" / replay.variants["decode.c2"]["graph"]
    program = torch.export.load(str(graph))
    package = package_path(graph)
    assert package.name == "decode.c2.aoti.pt2"
    compile_inductor(program, package)
    assert program.example_inputs is None  # the caller's program is left as it was

    replay.prefill([5, 6, 7], slot=0)
    inputs = dict(input_ids=[9, 3], positions=[3, 0], slot_ids=[0, 1], active_lanes=[1, 1], frame_index=1,
                  temperature=1.0, top_k=20, repetition_penalty=1.2, seed=[3, 4], logprob_requested=[1, 0])
    state_before = {name: tensor.clone() for name, tensor in replay.state.items()}
    tokens, expected = replay.run("decode.c2", **inputs)
    buffers = dict(expected) | state_before  # same inputs and starting state, fresh outputs
    for name in ("completion_records", "completion_logprobs"):
        buffers[name] = torch.zeros_like(expected[name])
    (compiled_tokens,) = load_compiled(package)(buffers)
    assert torch.equal(compiled_tokens, tokens)
    for name in ("completion_records", "penalty_counts"):
        assert torch.equal(buffers[name], expected[name]), name
    ours, reference = buffers["completion_logprobs"], expected["completion_logprobs"]
    ids = torch.ones(ours.shape[-1], dtype=torch.bool)
    ids[1::2] = False  # chosen id, then (id, value bits) pairs: even words are ids
    assert torch.equal(ours[..., ids], reference[..., ids])
    # fused kernels round the logits differently: measured logprob differences <= 1e-6
    torch.testing.assert_close(ours.view(torch.float32)[..., ~ids], reference.view(torch.float32)[..., ~ids],
                               atol=1e-5, rtol=0, equal_nan=True)
    for name in ("k_cache", "v_cache"):  # fused kernels may round the projections differently
        torch.testing.assert_close(buffers[name], expected[name], atol=1e-5, rtol=1e-5)


def test_compile_errors_name_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    with pytest.raises(CompileError, match=r"x\.aoti\.pt2: --compile inductor needs a C\+\+ compiler"):
        compile_inductor(program, tmp_path / "x.aoti.pt2")


def test_export_compile_inductor_packages_are_validated_and_preferred(tmp_path):
    """--compile inductor stores a package per variant beside its .pt2; a trusting loader prefers it."""
    import json

    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request
    from ignition.validate.core import validate_core

    out = tmp_path / "compiled"
    timings = export_core(ExportOptions(recipe="toy", capacities=(1,), chunk_limit=8, compile="inductor"), out)
    assert [t for t in timings if t.startswith("compile:")] == ["compile:decode.c1", "compile:prefill.t8"]
    catalog = json.loads((out / "catalog.json").read_text())
    assert [v["packages"] for v in catalog["variants"]] == [{"inductor": "graphs/decode.c1.aoti.pt2"},
                                                             {"inductor": "graphs/prefill.t8.aoti.pt2"}]
    assert validate_core(out).ok
    compiled, portable = load_core(out, trust_compiled=True), load_core(out, prefer_compiled=False)
    # the AOTInductor package, not the portable program it falls back to
    assert not isinstance(compiled.variants["decode.c1"].runner, ProgramModule)
    assert isinstance(portable.variants["decode.c1"].runner, ProgramModule)
    request = Request([3, 4, 5], max_tokens=5, logprobs=4)
    (a,), (b,) = Engine(compiled).generate([request]), Engine(portable).generate([request])
    assert a.token_ids == b.token_ids
    for x, y in zip(a.entries, b.entries):
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert abs(x.logprob - y.logprob) < 1e-5  # fused kernels round differently (< 1e-6 seen)
    (out / "graphs" / "decode.c1.aoti.pt2").write_bytes(b"tampered")
    assert "FILE-HASH" in {v.rule for v in validate_core(out, check_graphs=False).violations}
