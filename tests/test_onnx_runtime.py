"""``--runtime onnxruntime``: a core's ONNX graphs through the same engine as the torch loader.

For the toy, qwen3 and llama cores, the onnxruntime replay must give the same greedy tokens,
the same logprob ids in the same order, the same prompt-logprob ids and ranks, and values
within ``VALUE_TOL``. onnxruntime's MatMul, ReduceSum, Exp and Log are other implementations
than torch's, so logits and lse differ in their last bits; a value ``v`` may then differ by a
few ulps of ``v`` (4.8e-7 for |v| in [4, 8), 9.5e-7 in [8, 16)). We allow 1e-6 * max(1, |v|):
a wrong normalization, a padded lane or a misplaced word moves values by far more.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from ignition.catalog.onnx_layout import external_data, safetensors_offsets  # noqa: E402
from ignition.cli import app  # noqa: E402
from ignition.exporter.export import export_core  # noqa: E402
from ignition.catalog.hashing import sha256_file  # noqa: E402
from ignition.recipes.base import ExportOptions  # noqa: E402
from ignition.runtime.core import CoreLoadError, load_core  # noqa: E402
from ignition.runtime.engine import Engine  # noqa: E402
from ignition.catalog.abi import TokenEntry  # noqa: E402
from ignition.runtime.requests import Request  # noqa: E402

VALUE_TOL = 1e-6
VOCAB = 300


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:  # no logprob requested
        return a is b
    return abs(a - b) <= VALUE_TOL * max(1.0, abs(a)) or (np.isnan(a) and np.isnan(b))


def assert_same_entry(a, b) -> None:
    assert a.id == b.id and close(a.logprob, b.logprob), (a, b)
    assert [i for i, _ in a.top] == [i for i, _ in b.top], (a.top, b.top)
    assert all(close(x, y) for (_, x), (_, y) in zip(a.top, b.top)), (a.top, b.top)


def assert_same_prompt_entries(want: list, got: list) -> None:
    for a, b in zip(want, got, strict=True):
        if a is None:
            assert b is None
            continue
        assert (a["id"], a["rank"]) == (b["id"], b["rank"]) and close(a["logprob"], b["logprob"]), (a, b)
        assert [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]
        assert all(close(x["logprob"], y["logprob"]) for x, y in zip(a["top_logprobs"], b["top_logprobs"]))


def assert_same_results(torch_results, onnx_results) -> None:
    for want, got in zip(torch_results, onnx_results, strict=True):
        assert got.error is None and want.error is None, (got.error, want.error)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        for a, b in zip(want.entries, got.entries, strict=True):
            assert_same_entry(a, b)
        assert (want.prompt_entries is None) == (got.prompt_entries is None)
        if want.prompt_entries is not None:
            assert_same_prompt_entries(want.prompt_entries, got.prompt_entries)


def requests(vocab: int, scored: bool) -> list[Request]:
    """Concurrent greedy requests: natural alternatives, explicit ids in caller order, prompt scoring."""
    prompt_logprobs = 5 if scored else None
    return [Request([10, 20, 30, 7], max_tokens=6, logprobs=20, prompt_logprobs=prompt_logprobs, ignore_eos=True),
            Request([5], max_tokens=4, logprob_token_ids=[vocab - 1, 0, 17, 3], ignore_eos=True),
            Request(list(range(1, 40)), max_tokens=5, logprobs=3, prompt_logprobs=prompt_logprobs, ignore_eos=True),
            Request([9, 9], max_tokens=3, ignore_eos=True)]


def replay_both(core, vocab: int, scored: bool):
    """(torch results, onnxruntime results, the torch-loaded core)."""
    results, loaded = {}, {}
    for runtime in ("torch", "onnxruntime"):
        loaded[runtime] = load_core(core, runtime=runtime)
        assert loaded[runtime].backend == {"torch": "pt2", "onnxruntime": "onnx"}[runtime]
        results[runtime] = Engine(loaded[runtime]).generate(requests(vocab, scored))
    return results["torch"], results["onnxruntime"], loaded["torch"]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def decoder_core(request, tmp_path_factory):
    """qwen3 (untied, with prompt scoring) and llama (tied, llama3 RoPE), float32, with ONNX graphs."""
    from tests._decoder_cores import LLAMA3_ROPE, TinyCase, save_checkpoint

    family = request.param
    root = tmp_path_factory.mktemp(f"onnx-{family}")
    case = TinyCase(family, torch.float32, tie=family == "llama", vocab_size=VOCAB,
                    rope=LLAMA3_ROPE if family == "llama" else None)
    save_checkpoint(case, root / "ckpt")
    export_core(ExportOptions(recipe=family, checkpoint=root / "ckpt", capacities=(4,), chunk_limit=16, max_seq_len=64,
                              prompt_logprobs=family == "qwen3", onnx=True), root / "core")
    return family, root / "core"


def test_toy_replay_matches_torch(toy_onnx_core):
    """Engine replay on both runtimes, then the issue's acceptance command: ``ignition run --json``."""
    want, got, torch_core = replay_both(toy_onnx_core, 250, scored=True)
    assert_same_results(want, got)
    prompt = "3,1,4,1,5,9,2,6"
    (expected,) = Engine(torch_core).generate([Request([int(t) for t in prompt.split(",")], max_tokens=5,
                                                        logprobs=20, prompt_logprobs=5)])
    result = CliRunner().invoke(app, ["run", str(toy_onnx_core), "--prompt-ids", prompt, "--max-tokens", "5",
                                      "--logprobs", "20", "--prompt-logprobs", "5", "--json", "--device", "cpu",
                                      "--runtime", "onnxruntime"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert [t["id"] for t in got["tokens"]] == expected.token_ids
    for entry, token in zip(expected.entries, got["tokens"], strict=True):
        assert_same_entry(entry, TokenEntry(token["id"], token["logprob"],
                                            [(t["id"], t["logprob"]) for t in token["top_logprobs"]]))
    assert_same_prompt_entries(expected.prompt_entries, got["prompt_logprobs"])


def test_decoder_replay_matches_torch(decoder_core):
    """qwen3 with prompt scoring, llama without: concurrent requests on both runtimes."""
    family, core = decoder_core
    want, got, _ = replay_both(core, VOCAB, scored=family == "qwen3")
    assert_same_results(want, got)
    assert any(r.prompt_entries for r in got) == (family == "qwen3")


def test_weights_are_external_data_in_the_one_safetensors(toy_onnx_core):
    manifest = json.loads((toy_onnx_core / "manifest.json").read_text())
    offsets = safetensors_offsets(toy_onnx_core / "weights.safetensors")
    graphs = sorted(toy_onnx_core.glob("graphs/*.onnx"))
    assert [g.name for g in graphs] == ["decode.c4.onnx", "prefill.t64.onnx", "scored.t64.onnx"]
    for graph in graphs:
        rel = graph.relative_to(toy_onnx_core).as_posix()
        assert manifest["files"][rel] == sha256_file(graph)  # listed and hashed like every other file
        model = onnx.load(str(graph), load_external_data=False)
        assert model.opset_import[0].version >= 18
        external = {t.name: external_data(t) for t in model.graph.initializer
                    if t.data_location == onnx.TensorProto.EXTERNAL}
        assert external == {name: {"location": "weights.safetensors", "offset": str(offset), "length": str(length)}
                            for name, (offset, length) in offsets.items()}


def test_graph_runs_in_plain_onnxruntime(toy_onnx_core):
    """Outside Ignition: the core root as the external-data folder is all onnxruntime needs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(toy_onnx_core))
    session = ort.InferenceSession((toy_onnx_core / "graphs" / "decode.c4.onnx").read_bytes(), options)
    feeds = {i.name: np.zeros([d for d in i.shape], dtype={"tensor(int64)": np.int64, "tensor(int32)": np.int32,
                                                            "tensor(float)": np.float32}[i.type])
             for i in session.get_inputs()}
    feeds["input_ids"][:] = [10, 20, 30, 40]
    feeds["active_lanes"][:] = 1
    feeds["token_budget"][:] = 100
    feeds["eos_token_ids"][:] = feeds["forced_token_ids"][:] = -1
    tokens = session.run(["next_tokens"], feeds)[0]
    core = load_core(toy_onnx_core)  # the torch program on the same inputs
    buffers = core.variants["decode.c4"].buffers
    for name, value in feeds.items():
        buffers[name].copy_(torch.from_numpy(value))
    (expected,) = core.variants["decode.c4"].run(buffers)
    assert tokens.tolist() == expected.tolist()


def test_reexported_onnx_is_byte_identical(toy_onnx_core, tmp_path):
    from ignition.exporter.export import capture, example_buffers
    from ignition.exporter.onnx_export import export_onnx
    from ignition.recipes.registry import build_recipe

    build = build_recipe(ExportOptions(recipe="toy", capacities=(4,), chunk_limit=64, prompt_logprobs=True))
    graph = build.graphs[0]
    path = tmp_path / "decode.c4.onnx"
    export_onnx(capture(graph, build.weights), graph.variant.arguments, example_buffers(graph, build.weights),
                safetensors_offsets(toy_onnx_core / "weights.safetensors"), "weights.safetensors", path, "decode.c4")
    assert path.read_bytes() == (toy_onnx_core / "graphs" / "decode.c4.onnx").read_bytes()


def test_inspect_lists_both_runtimes(toy_onnx_core):
    result = CliRunner().invoke(app, ["inspect-core", str(toy_onnx_core), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["runtimes"] == ["torch", "onnxruntime"]
    files = {v["name"]: v["files"] for v in summary["variants"]}
    assert files["decode.c4"]["torch"]["path"] == "graphs/decode.c4.pt2"
    assert files["decode.c4"]["onnxruntime"]["path"] == "graphs/decode.c4.onnx"
    assert all(f["bytes"] > 0 for v in files.values() for f in v.values())
    text = CliRunner().invoke(app, ["inspect-core", str(toy_onnx_core)])
    assert "onnxruntime" in text.stdout and "graphs/scored.t64.onnx" in text.stdout


def test_runtime_without_onnx_graphs_is_refused(toy_core):
    with pytest.raises(CoreLoadError, match="no ONNX graph: export the core with --onnx"):
        load_core(toy_core, runtime="onnxruntime")
    with pytest.raises(CoreLoadError, match="unknown runtime"):
        load_core(toy_core, runtime="tensorrt")
    result = CliRunner().invoke(app, ["run", str(toy_core), "--prompt-ids", "1", "--runtime", "tensorrt"])
    assert result.exit_code == 2 and "--runtime" in result.output


def test_bfloat16_is_refused_before_capture(tmp_path):
    from tests._decoder_cores import TinyCase, save_checkpoint

    from ignition.exporter.onnx_export import OnnxExportError

    save_checkpoint(TinyCase("qwen3", torch.bfloat16, tie=True, vocab_size=64), tmp_path / "ckpt")
    with pytest.raises(OnnxExportError, match="bfloat16"):
        export_core(ExportOptions(recipe="qwen3", checkpoint=tmp_path / "ckpt", capacities=(1,), chunk_limit=8,
                                  max_seq_len=16, onnx=True), tmp_path / "core")
    assert not (tmp_path / "core").exists()
