"""Natural-only cores (no explicit-ID inputs, K < 20): export, validate, load and serve end to end.

The specification: such a core "has a last output extent of 2+2*K with 1<=K<=20; it serves
natural alternatives and rejects logprob_token_ids". The records-only build is benchmark-only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ignition.catalog.buffers import ID_INPUTS, LOGPROBS
from ignition.cli import app
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import AdmissionError, Request
from ignition.validate.core import validate_core
from _served import Served
from test_server import CMPL

K = 5
TOL = 3e-5  # as tests/test_runtime.py: fp32 32-wide matmul vs fp64, plus the FP32 reduction


@pytest.fixture(scope="module")
def natural_core(tmp_path_factory):
    out = tmp_path_factory.mktemp("natural") / "k5"
    result = CliRunner().invoke(app, ["export-core", "--recipe", "toy", "--out", str(out), "--capacities", "1,4",
                                      "--logprob-k", str(K), "--no-logprob-ids"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def served_natural(natural_core):
    server = Served(natural_core)
    yield server
    server.close()


def test_natural_only_core_exports_and_validates(natural_core):
    report = validate_core(natural_core)
    assert report.ok, report.violations
    manifest = report.manifest
    assert (manifest["k"], manifest["features"]) == (K, {"allow_logprobs": True,
                                                         "explicit_ids": False, "prompt_logprobs": False,
                                                         "structured_output": True})
    for variant in report.catalog["variants"]:
        args = {a["name"]: a for a in variant["arguments"]}
        assert not set(ID_INPUTS) & set(args) and not set(ID_INPUTS) & set(variant["contract"]["bindings"])
        assert args[LOGPROBS]["shape"][-1] == 2 + 2 * K
        assert variant["contract"]["layout"]["logprobs"]["k"] == K


def test_natural_only_core_serves_naturals_through_the_loader(natural_core):
    weights = load_file(str(natural_core / "weights.safetensors"))
    oracle = torch.log_softmax((weights["embedding.weight"].double() @ weights["lm_head.weight"].double().T)[:, :250], 1)
    engine = Engine(load_core(natural_core))
    (result,) = engine.generate([Request([10, 20], max_tokens=4, logprobs=K)])
    previous = [20] + result.token_ids[:-1]
    for prev, entry in zip(previous, result.entries):
        row = oracle[prev]
        assert abs(entry.logprob - row[entry.id].item()) < TOL
        assert [i for i, _ in entry.top] == sorted(range(250), key=lambda t: (-row[t].item(), t))[:K]
        np.testing.assert_allclose([v for _, v in entry.top], row[[i for i, _ in entry.top]].numpy(), atol=TOL, rtol=0)
    assert engine.readers["decode.c1"].payload_words_copied == 3 * 8 * (2 + 2 * K)  # W = K: the whole packed row
    with pytest.raises(AdmissionError, match="does not support logprob_token_ids"):
        engine.submit(Request([1], logprobs=0, logprob_token_ids=[3]))
    with pytest.raises(AdmissionError, match=f"between 0 and {K}, got {K + 1}"):
        engine.submit(Request([1], logprobs=K + 1))


def test_natural_only_core_over_http(served_natural):
    prompt = [11, 42]
    expected = served_natural.generate(prompt, max_tokens=3, logprobs=K)
    response = served_natural.post(CMPL, {"prompt": prompt, "max_tokens": 3, "logprobs": K})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [e.logprob for e in expected.entries]
    assert [len(row) for row in logprobs["top_logprobs"]] == [K + (e.id not in dict(e.top)) for e in expected.entries]
    features = json.loads(served_natural.client.models.list().to_json())["data"][0]["features"]
    assert (features["max_logprobs"], features["explicit_ids"], features["max_logprob_token_ids"]) == (K, False, 0)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": [1], "logprobs": 0, "logprob_token_ids": [2]}, "logprob_token_ids", "does not support logprob_token_ids"),
    ({"prompt": [1], "logprobs": K + 1}, "logprobs", f"between 0 and {K}"),
])
def test_natural_only_rejections_are_400_before_admission(served_natural, monkeypatch, body, param, message):
    engine = served_natural.ctx.engine.engine
    admitted = []
    monkeypatch.setattr(engine, "submit", lambda r, submit=engine.submit: admitted.append(r) or submit(r))
    response = served_natural.post(CMPL, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert admitted == [] and served_natural.wait_idle()["running"] == 0


@pytest.mark.parametrize("options, message", [
    ({"k": 5}, "add --no-logprob-ids"),
    ({"k": 0, "logprob_ids": False}, "between 1 and 20"),
    ({"k": 21, "logprob_ids": False}, "between 1 and 20"),
    ({"k": 5, "logprob_ids": False, "prompt_logprobs": True}, "requires the K=20"),
])
def test_natural_only_options_are_checked(options, message):
    with pytest.raises(RecipeError, match=message):
        ExportOptions(recipe="toy", **options)


def test_cli_has_no_records_only_export(tmp_path):
    result = CliRunner().invoke(app, ["export-core", "--recipe", "toy", "--out", str(tmp_path / "x"), "--no-logprobs"])
    assert result.exit_code == 2 and "No such option" in result.output
    assert not (tmp_path / "x").exists()


def test_natural_only_k20_core_is_valid(tmp_path):
    export_core(ExportOptions(recipe="toy", capacities=(2,), logprob_ids=False), tmp_path / "k20")
    assert validate_core(tmp_path / "k20").ok
