"""Inputs that used to run for minutes, be taken as something else, or exit with the wrong code: each is
refused up front, by name, with exit 2 (a usage error) and nothing written."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from typer.testing import CliRunner

import ignition.cli as cli
from ignition.cli import loading
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions

runner = CliRunner()

MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 320,
              "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
              "num_experts": 4, "num_experts_per_tok": 2}
DEEPSEEK_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 320,
                   "hidden_size": 32, "num_hidden_layers": 2, "routed_scaling_factor": 2.5,
                   "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.8}}


def invoke(args: list[str]) -> tuple[int, str]:
    result = runner.invoke(cli.app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{args}: {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("base, edit, message", [
    (MOE_CONFIG, {"num_experts": 100_000_000}, "field 'num_experts' must be <= 16384, got 100000000"),
    (MOE_CONFIG | {"num_local_experts": 100_000_000}, {"num_experts": None},
     "field 'num_local_experts' must be <= 16384, got 100000000"),
    (MOE_CONFIG, {"num_hidden_layers": 10_000_000}, "field 'num_hidden_layers' must be <= 1024, got 10000000"),
    (DEEPSEEK_CONFIG, {"routed_scaling_factor": float("inf")},
     "field 'routed_scaling_factor' must be a finite number; found inf"),
    (DEEPSEEK_CONFIG, {"rope_parameters": DEEPSEEK_CONFIG["rope_parameters"] | {"mscale_all_dim": float("nan")}},
     "field 'rope_parameters.mscale_all_dim' must be a finite number; found nan"),
])
def test_config_sizes_and_non_finite_numbers_are_refused_before_any_work(tmp_path, base, edit, message):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(base | edit))  # Python writes Infinity / NaN literals
    recipe = base["model_type"]
    started = time.perf_counter()
    code, output = invoke(["export-core", checkpoint, "--recipe", recipe, "--out", tmp_path / "core"])
    assert code == 2 and message in output, output
    assert time.perf_counter() - started < 10
    assert not (tmp_path / "core").exists() and not list(tmp_path.glob(".core.*"))


def test_out_dot_with_overwrite_is_refused_fast(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    code, output = invoke(["export-core", "--recipe", "toy", "--out", ".", "--overwrite"])
    assert code == 2 and "current directory" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_onnx_with_speculative_tokens_is_refused_before_capture(tmp_path, monkeypatch):
    monkeypatch.setattr("ignition.exporter.export.export_core", lambda *a, **k: pytest.fail("exported anyway"))
    code, output = invoke(["export-core", "--recipe", "toy", "--out", tmp_path / "core", "--onnx",
                           "--speculative-tokens", "4"])
    assert code == 2 and "--onnx cannot be combined with --speculative-tokens" in output


@pytest.mark.parametrize("ranks", ["0", "-1"])
def test_tensor_parallel_below_one_is_refused(toy_core, ranks):
    code, output = invoke(["run", toy_core, "--prompt-ids", "1", "--tensor-parallel", ranks])
    assert code == 2 and "--tensor-parallel" in output


def test_device_errors_are_usage_errors(toy_core):
    code, output = invoke(["run", toy_core, "--prompt-ids", "1", "--device", "cuda:97"])
    assert code == 2 and "cuda:97" in output


@pytest.fixture(scope="module")
def speculative_target(tmp_path_factory):
    target = tmp_path_factory.mktemp("cores") / "target"
    export_core(ExportOptions(recipe="toy", capacities=(1,), chunk_limit=16, speculative_tokens=(2,)), target)
    return target


def test_trust_compiled_names_the_target_core_only(tmp_path, monkeypatch, speculative_target):
    target, draft = speculative_target, tmp_path / "draft"
    shutil.copytree(target, draft)
    trusted, real_load = {}, loading.load

    def recording_load(core, options):
        trusted[core.name] = options.trust_compiled
        return real_load(core, options)

    monkeypatch.setattr(loading, "load", recording_load)
    code, output = invoke(["run", target, "--prompt-ids", "1,2", "--max-tokens", "2", "--trust-compiled",
                           "--speculative", f"draft:{draft}:2"])
    assert code == 0, output
    assert trusted == {"target": True, "draft": False}


def test_a_draft_core_that_writes_files_is_refused(tmp_path, speculative_target):
    from _payloads import file_write, rewrite
    from conftest import CoreCopy

    victim = tmp_path / "victim.py"
    victim.write_text("print('original')\n")
    draft = CoreCopy(tmp_path / "draft")
    shutil.copytree(speculative_target, draft.root)
    graph = draft.root / "graphs/decode.c1.pt2"
    graph.write_bytes(rewrite(graph.read_bytes(), file_write(victim, 8)))
    draft.rehash("graphs/decode.c1.pt2")
    code, output = invoke(["run", speculative_target, "--prompt-ids", "1,2", "--max-tokens", "2",
                           "--speculative", f"draft:{draft.root}:2"])
    assert code == 1 and "GRAPH-OPERATOR" in output and "aten.from_file" in output
    assert victim.read_text() == "print('original')\n"


def test_onnx_with_speculative_tokens_is_refused_by_the_options_themselves():
    """Code that calls export_core directly gets the same refusal: ExportOptions owns the rule, not the CLI."""
    from ignition.recipes.base import ExportOptions, RecipeError

    with pytest.raises(RecipeError, match="--onnx cannot be combined with --speculative-tokens"):
        ExportOptions(recipe="toy", onnx=True, speculative_tokens=(4,))
