"""Start-up: what `run`, `serve` and `export-core` refuse before any heavy work, what loading reports while it
runs, `--version`, and the serve ready line (issue 16, items 5 and 8).

"Before any heavy work" is pinned by making the heavy work fail the test: ``load_core`` and
``build_recipe`` are replaced by functions that raise, so a check that ran late would show up
as that error instead of the expected usage error.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import ignition.runtime.core as runtime_core
from ignition.cli import StageLog, app, version_text
from ignition.runtime.core import load_core

REPO = Path(__file__).resolve().parents[1]
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0 or isinstance(result.exception, SystemExit), f"{args}: {result.exception!r}"
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Loading or exporting now fails the test."""
    def heavy(*args, **kwargs):
        raise AssertionError("heavy work started before the check")
    monkeypatch.setattr(runtime_core, "load_core", heavy)
    monkeypatch.setattr("ignition.recipes.registry.build_recipe", heavy)
    monkeypatch.setattr("ignition.exporter.export.build_recipe", heavy)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return tmp_path / "ckpt"


@pytest.mark.parametrize("command", [["run", "{path}", "Hello"], ["serve", "{path}"]])
def test_a_checkpoint_is_not_a_core(no_heavy_work, checkpoint, command):
    code, output = invoke([a.replace("{path}", str(checkpoint)) for a in command])
    assert code == 2
    assert output.strip() == (f"error: {checkpoint} is a Hugging Face checkpoint, not a core; run "
                              f"`ignition export-core {checkpoint} --recipe qwen3 --out CORE` first, then use CORE")


def test_a_missing_core_is_a_usage_error(no_heavy_work, tmp_path):
    code, output = invoke(["run", tmp_path / "nothing", "--prompt-ids", "1"])
    assert code == 2 and "nothing does not exist; expected a core directory" in output


def test_a_busy_port_fails_before_loading(no_heavy_work, toy_core):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, output = invoke(["serve", toy_core, "--port", port])
    assert code == 2, output
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use (another server is listening there" in output
    code, output = invoke(["serve", toy_core, "--host", "no-such-host.invalid", "--port", port])
    assert code == 2 and "cannot listen on no-such-host.invalid" in output


def test_export_into_an_existing_out_fails_at_once(no_heavy_work, toy_core):
    code, output = invoke(["export-core", "--recipe", "toy", "--out", toy_core])
    assert code == 2 and f"{toy_core} already exists; pass --overwrite to replace it" in " ".join(output.split())


@pytest.mark.parametrize("options, message", [
    (["--recipe", "qwen4"], "error: unknown recipe 'qwen4'; available: deepseek_v3, deepseek_v4, gemma3, gpt_oss, llama, qwen3, qwen3_5, qwen3_moe, toy"),
    (["--recipe", "toy", "--targets", "cuda:90,sm_75"],
     "error: --targets: unknown kernel target(s) 'sm_75'; known targets: cuda:90, cuda:120"),
    (["--recipe", "toy", "--tokenizer", "{tmp}"], "error: --tokenizer: tokenizer directory {tmp}: expected "
                                                 "tokenizer.json or tokenizer.model, found []"),
])
def test_export_names_are_checked_before_the_checkpoint_is_read(no_heavy_work, tmp_path, options, message):
    (tmp_path / "empty").mkdir()
    options = [o.replace("{tmp}", str(tmp_path / "empty")) for o in options]
    code, output = invoke(["export-core", "--out", tmp_path / "core", *options])
    assert code == 2 and output.strip() == message.replace("{tmp}", str(tmp_path / "empty"))


@pytest.mark.parametrize("options, message", [
    (["--prompt-ids", "1", "--logprobs", "50"], "error: --logprobs: logprobs must be between 0 and 20, got 50"),
    (["Hello", "--logprobs", "50"], "error: this core has no tokenizer; pass --prompt-ids"),
    (["--prompt-ids", "1", "--prompt-logprobs", "1"],
     "error: --prompt-logprobs: this core was exported without prompt scoring (--prompt-logprobs)"),
    (["--prompt-ids", "1", "--logprob-token-ids", "1,1"],
     "error: --logprob-token-ids: logprob_token_ids contains duplicate id 1"),
    (["--prompt-ids", "1,99999"], "error: --prompt-ids: prompt token id 99999 is outside the vocabulary [0, 250)"),
])
def test_run_refuses_what_the_core_cannot_serve_before_loading(no_heavy_work, toy_core, options, message):
    code, output = invoke(["run", toy_core, *options])
    assert code == 2 and message in output, output


def test_version():
    code, output = invoke(["--version"])
    assert code == 0 and output.strip() == version_text()
    assert re.fullmatch(r"ignition \d+\.\d+\.\d+\S* \(torch \d+\.\d+\S*\)", version_text())


def test_load_reports_each_stage_and_loads_each_graph_once(toy_core, monkeypatch):
    import ignition.validate.graphs as graphs

    loads, torch_loads = [], []
    real, real_torch = graphs.read_program, graphs._load_accepted_program
    monkeypatch.setattr(graphs, "read_program", lambda *args: loads.append(args) or real(*args))
    monkeypatch.setattr(graphs, "_load_accepted_program", lambda data: torch_loads.append(data) or real_torch(data))
    seen = []
    loaded = load_core(toy_core, progress=lambda stage, item: seen.append((stage, item)))
    names = [v["name"] for v in json.loads((toy_core / "catalog.json").read_text())["variants"]]
    # the graphs are read while a worker thread reads the weights; then each variant is bound to its buffers
    assert seen == [("check", "hashes, schemas, catalog rules, signature"), ("weights", "weights.safetensors"),
                    *[("graphs", f"graph {i} of {len(names)}: {n}") for i, n in enumerate(names, 1)],
                    *[("runners", f"variant {i} of {len(names)}: {n}") for i, n in enumerate(names, 1)],
                    ("tokenizer", "none")]
    assert len(loads) == len(names)  # validation on load does not load a graph that loading loads again
    assert torch_loads == []  # the runtime reads programs with validate/program_reader.py
    assert list(loaded.timings) == ["check", "weights", "graphs", "runners", "tokenizer"]
    assert all(s >= 0 for s in loaded.timings.values()) and loaded.load_seconds == sum(loaded.timings.values())


def test_load_checks_the_bytes_it_loads(toy_core, monkeypatch):
    """The manifest's sha256 is compared on the very bytes the safe reader and torch then read."""
    import ignition.validate.graphs as graphs

    monkeypatch.setattr(graphs, "_load_accepted_program", lambda data: pytest.fail("loaded unchecked bytes"))
    variant = json.loads((toy_core / "catalog.json").read_text())["variants"][0]
    found, program = graphs.check_graph(toy_core / variant["graph"], variant, sha256="0" * 64)
    assert program is None and [v.rule for v in found] == ["FILE-HASH"]
    assert found[0].message.startswith("expected sha256 " + "0" * 64 + ", found ")


def test_cached_schema_hints_equal_typing():
    import dataclasses
    import typing

    from torch._export.serde import schema

    from ignition.validate.graphs import _CachedSchemaHints

    cached = _CachedSchemaHints(vars(schema))
    classes = [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)]
    assert len(classes) > 20
    for cls in classes * 2:  # the second round is served from the cache
        assert cached.get_type_hints(cls, globalns=vars(schema)) == typing.get_type_hints(cls, globalns=vars(schema))
    other = {"x": int}
    assert cached.get_type_hints(type("T", (), {"__annotations__": {"a": "x"}}), globalns=other) == {"a": int}
    assert cached.Annotated is typing.Annotated and len(cached._hints) == len(classes)  # others pass through


def test_plain_progress_lines_are_timestamped_and_flushed(capsys):
    with StageLog("export", terminal=False) as progress:
        progress("capture", "variant 2 of 7: decode.c1")
        assert re.fullmatch(rf"{STAMP} export capture: variant 2 of 7: decode\.c1\n", capsys.readouterr().err)
    with StageLog("export", terminal=True) as progress:  # a terminal gets one rich status line, no log lines
        progress("capture", "variant 2 of 7: decode.c1")
    assert "export capture:" not in capsys.readouterr().err


def test_export_piped_prints_each_variant_as_it_starts(tmp_path):
    code, output = invoke(["export-core", "--recipe", "toy", "--out", tmp_path / "core", "--capacities", "1"])
    assert code == 0, output
    lines = [line for line in output.splitlines() if re.match(STAMP, line)]
    assert [re.sub(STAMP + " ", "", line) for line in lines] == [
        "export build: toy", "export capture: variant 1 of 2: decode.c1",
        "export capture: variant 2 of 2: prefill.t256", f"export write: {tmp_path / 'core'}",
        f"export validate: {tmp_path / 'core'}"]


def test_serve_logs_the_load_then_a_ready_line_once_it_accepts(toy_core):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "ignition.cli", "serve", str(toy_core), "--port", str(port),
                                "--served-model-name", "toy"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=os.environ | {"PYTHONPATH": str(REPO), "COLUMNS": "300"})
    lines = []
    try:
        deadline = time.monotonic() + 120
        while not (lines and lines[-1].startswith("ready:")):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stderr.readline().rstrip("\n"))
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # ready means accepting
    finally:
        process.terminate()
        process.wait(timeout=30)
    stages = [re.sub(STAMP + " ", "", line) for line in lines if re.match(STAMP, line)]
    assert stages[:3] == ["load check: hashes, schemas, catalog rules, signature", "load weights: weights.safetensors",
                          "load graphs: graph 1 of 3: decode.c1"]
    assert re.fullmatch(rf"loaded {re.escape(str(toy_core))} on cpu in [0-9.]+ s \(check [0-9.]+ s, weights [0-9.]+ s, "
                        r"graphs [0-9.]+ s, runners [0-9.]+ s, tokenizer [0-9.]+ s\)",
                        next(x for x in lines if x.startswith("loaded ")))
    assert re.fullmatch(rf"ready: serving {re.escape(str(toy_core))} as toy on http://127\.0\.0\.1:{port} "
                        r"\(loaded in [0-9.]+ s\)", lines[-1])


class Letters:
    """A tokenizer stand-in: token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def _result(entries, prompt_entries=None):
    from ignition.runtime.outputs import Result

    return Result("r", [0, 1, 2], [e.id for e in entries], entries, "length", None, prompt_entries)


def _render(result, tokenizer=Letters()) -> str:
    from rich.console import Console

    from ignition.runtime.present import render_run

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    render_run(result, tokenizer, console)
    return console.export_text()


def test_run_output_shows_the_text_and_logprobs_only_when_asked():
    from ignition.catalog.abi import TokenEntry
    from ignition.runtime.present import run_json

    plain = _render(_result([TokenEntry(7, None), TokenEntry(4, None)]))
    assert plain.splitlines()[0] == "he"  # the completion text comes first
    assert "forced" not in plain and "logprob" not in plain and "alternatives" not in plain
    asked = _render(_result([TokenEntry(7, -0.5, [(7, -0.5), (1, -1.25)]), TokenEntry(4, None, forced=True)]))
    assert re.search(r"│ 0 │\s+7 │ 'h'\s+│\s+-0\.5000 │ 'h' -0\.500, 'b' -1\.250", asked)
    assert re.search(r"│ 1 │\s+4 │ 'e'\s+│\s+forced │", asked)  # only a truly forced token reads "forced"
    out = run_json(_result([TokenEntry(7, -0.5, [(7, -0.5), (1, -1.25)]), TokenEntry(4, None, forced=True)]), Letters())
    assert out["text"] == "he" and out["tokens"][0]["top_logprobs"] == [
        {"id": 7, "text": "h", "logprob": -0.5}, {"id": 1, "text": "b", "logprob": -1.25}]
    assert out["tokens"][1] == {"id": 4, "text": "e", "logprob": None, "top_logprobs": [], "forced": True}
    assert "forced" not in out["tokens"][0]


def test_run_output_shows_prompt_logprobs_without_json():
    from ignition.catalog.abi import TokenEntry

    scores = [None, {"id": 1, "logprob": -2.0, "rank": 3, "top_logprobs": [{"id": 5, "logprob": -0.25}]},
              {"id": 2, "logprob": -0.75, "rank": 1, "top_logprobs": [{"id": 2, "logprob": -0.75}]}]
    text = _render(_result([TokenEntry(7, None)], scores))
    assert "prompt logprobs, 3 tokens" in text
    assert re.search(r"│ 0 │\s+0 │ 'a'\s+│\s+│\s+│\s+│", text)
    assert re.search(r"│ 1 │\s+1 │ 'b'\s+│\s+-2\.0000 │\s+3 │ 'f' -0\.250", text)
    assert re.search(r"│ 2 │\s+2 │ 'c'\s+│\s+-0\.7500 │\s+1 │ 'c' -0\.750", text)


def test_cli_run_without_logprobs_shows_no_forced_tokens(toy_core):
    code, output = invoke(["run", toy_core, "--prompt-ids", "4,5", "--max-tokens", "3"])
    assert code == 0 and "3 tokens, finish_reason=length" in output
    assert "forced" not in output and "logprob" not in output
