"""No traceback from any CLI input: every bad value ends in its exit code with a message that names it.

Exit 2: a usage error (an option out of its range in catalog/limits.py, an --out that cannot be
written or replaced); exit 1: the input was understood and refused (an invalid core).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ignition.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(args: list[str]):
    result = runner.invoke(app, args)
    # an escaped exception shows up as result.exception; typer.Exit and usage errors are SystemExit
    assert isinstance(result.exception, SystemExit), f"{args}: {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


EXPORT = ["export-core", "--recipe", "toy"]
RUN = ["--prompt-ids", "1,2", "--max-tokens", "2"]

USAGE_ERRORS = [  # (arguments after the command's own, message fragment); {core} is a valid toy core
    (EXPORT + ["--max-seq-len", "10000000000"], "--max-seq-len must be <= 2147483647, got 10000000000"),
    (EXPORT + ["--max-seq-len", "1e10"], "Invalid value for '--max-seq-len'"),
    (EXPORT + ["--seed", "100000000000000000000"], "--seed must be <= 18446744073709551615"),
    (EXPORT + ["--seed", "-1"], "--seed must be >= 0, got -1"),
    (EXPORT + ["--capacities", "1,99999"], "--capacities must be <= 4096, got 99999"),
    (EXPORT + ["--chunk-limit", "0"], "chunk limit must be positive, got 0"),
    (EXPORT + ["--completion-token-capacity", "65"], "--completion-token-capacity must be <= 64, got 65"),
    (["run", "{core}", *RUN, "--seed", "1e20"], "Invalid value for '--seed'"),
    (["run", "{core}", *RUN, "--seed", "100000000000000000000"], "seed must fit in int64, got 100000000000000000000"),
    (["run", "{core}", *RUN, "--top-k", "4294967296"], "top_k must be <= 2147483647, got 4294967296"),
    (["run", "{core}", *RUN, "--top-k", "-2"], "top_k must be >= 0, got -2"),
    (["run", "{core}", *RUN, "--temperature", "nan"], "--temperature: sampling parameters out of range: "
                                                       "temperature must be a finite number"),
    (["run", "{core}", *RUN, "--temperature", "inf"], "temperature must be a finite number"),
    (["run", "{core}", *RUN, "--top-p", "nan"], "top_p must be a finite number"),
    (["run", "{core}", *RUN, "--top-p", "0"], "top_p must be > 0.0, got 0.0"),
    (["run", "{core}", *RUN, "--min-p", "1.5"], "min_p must be <= 1.0, got 1.5"),
    (["run", "{core}", *RUN, "--repetition-penalty", "0"], "repetition_penalty must be > 0.0"),
    (["run", "{core}", *RUN, "--presence-penalty", "-inf"], "presence_penalty must be a finite number"),
    (["run", "{core}", *RUN, "--frequency-penalty", "3"], "frequency_penalty must be <= 2.0, got 3.0"),
    (["run", "{core}", "--prompt-ids", "1", "--max-tokens", "4294967296"], "--max-tokens must be <= 2147483647"),
    (["run", "{core}", "--prompt-ids", "1", "--max-tokens", "-1"], "--max-tokens must be >= 0, got -1"),
    (["run", "{core}", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["run", "{core}", "caf\udce9"], "the prompt is not valid UTF-8"),  # argv byte 0xE9 under surrogateescape
    (["serve", "{core}", "--port", "70000"], "--port must be <= 65535, got 70000"),
    (EXPORT + ["--speculative-tokens", "8"], "a verify round emits up to S+1 = 9 positions, more than T=8"),
    (["run", "{core}", *RUN, "--speculative", "ngram"], "expected ngram:S, mtp:S or draft:CORE:S"),
    (["serve", "{core}", "--speculative", "ngram:2"], "has no verify variants for 2 draft tokens"),
    (["serve", "{core}", "--speculative", "mtp:2"], "has no multi-token-prediction draft graphs"),
    (["inspect-core", "{core}", "--memory-budget", "-5"], "--memory-budget must be >= 0, got -5"),
]


@pytest.mark.parametrize("args, message", USAGE_ERRORS, ids=[f"{i}-{a[0]}" for i, (a, _) in enumerate(USAGE_ERRORS)])
def test_out_of_range_options_are_usage_errors(toy_core, tmp_path, args, message):
    args = [a.replace("{core}", str(toy_core)) for a in args]
    if args[0] == "export-core":
        args += ["--out", str(tmp_path / "core")]
    code, output = invoke(args)
    assert code == 2, output
    assert message in output
    assert not (tmp_path / "core").exists()


@pytest.mark.parametrize("out, message", [
    ("/proc/ignition-test/core", "cannot create the core /proc/ignition-test/core"),
    ("{tmp}/file.txt/core", "file.txt is not a directory"),
    ("{tmp}/photos", "not an Ignition core"),
])
def test_unwritable_or_foreign_out_is_a_usage_error(tmp_path, out, message):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"keep")
    code, output = invoke(EXPORT + ["--out", out.replace("{tmp}", str(tmp_path)), "--overwrite"])
    assert code == 2 and message in output, output
    assert (tmp_path / "photos" / "a.jpg").read_bytes() == b"keep"


def test_invalid_cores_are_refused_with_findings(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    code, output = invoke(["validate-core", str(tmp_path)])
    assert code == 1 and "JSON-PARSE" in output and "VALIDATOR-ERROR" not in output
    for command in (["run", str(tmp_path), "--prompt-ids", "1"], ["serve", str(tmp_path)]):
        code, output = invoke(command)
        assert code == 1 and "cannot load core" in output and "JSON-PARSE" in output, output
    code, output = invoke(["inspect-core", str(tmp_path)])
    assert code == 1 and "cannot inspect" in output


def test_markup_in_paths_is_printed_not_interpreted(tmp_path):
    core = tmp_path / "a[" / "]core[bold]"  # "[/]" would be a closing tag with nothing to close
    core.mkdir(parents=True)
    code, output = invoke(["validate-core", str(core)])
    assert code == 1 and "a[/]core[bold]" in output


@pytest.mark.parametrize("argv, code, message", [
    ([b"validate-core", b"/tmp/no-such-\xff\xfe-core"], 1, "CORE-MISSING"),
    ([b"run", b"{core}", b"caf\xe9"], 2, "the prompt is not valid UTF-8"),
])
def test_non_utf8_argv_in_a_real_process(toy_core, argv, code, message):
    argv = [a.replace(b"{core}", os.fsencode(toy_core)) for a in argv]
    done = subprocess.run([sys.executable, "-m", "ignition.cli", *argv], capture_output=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"})
    stderr = done.stderr.decode("utf-8", "replace")
    assert done.returncode == code, stderr
    assert message in stderr and "Traceback" not in stderr


def test_an_unexpected_error_is_reported_not_dumped(monkeypatch, capsys):
    import ignition.cli as cli

    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr(cli, "app", broken)
    monkeypatch.delenv("IGNITION_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as raised:
        cli.main()
    assert raised.value.code == 70
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: a bug" in err and "Traceback" not in err
    monkeypatch.setenv("IGNITION_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main()
