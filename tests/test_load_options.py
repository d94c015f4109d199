"""LoadOptions: every load-time choice validated once, resolved once, and shipped whole to worker ranks."""

from __future__ import annotations

import pytest
import torch

from ignition.catalog.parallel import MAX_TENSOR_PARALLEL
from ignition.runtime.options import LoadOptions
from ignition.runtime.verified import LoadOptionError


def test_create_resolves_the_device_once():
    options = LoadOptions.create()
    assert options.device == torch.device("cpu") and not options.cuda  # auto: no CUDA here
    assert LoadOptions.create("cpu").collective_backend == "gloo"


@pytest.mark.parametrize("choices, message", [
    (dict(runtime="tensorrt"), "unknown runtime 'tensorrt'; expected one of torch, onnxruntime"),
    (dict(ranks=0), f"--tensor-parallel must be between 1 and {MAX_TENSOR_PARALLEL}, got 0"),
    (dict(ranks=True), f"--tensor-parallel must be between 1 and {MAX_TENSOR_PARALLEL}, got True"),
    (dict(runtime="onnxruntime", ranks=2), "--runtime onnxruntime replays single-rank cores only"),
    (dict(device="tpu"), "unknown device 'tpu'; expected auto, cpu, cuda or cuda:N"),
    (dict(device="cuda:0"), "device 'cuda:0' was asked for, but torch sees no CUDA device"),
    (dict(timeout_s=0), "the process-group timeout must be a positive number of seconds, got 0"),
])
def test_bad_choices_are_refused_naming_the_option(choices, message):
    with pytest.raises(LoadOptionError) as refused:
        LoadOptions.create(**choices)
    assert message in str(refused.value)


def test_a_bad_trusted_key_is_an_option_error(tmp_path):
    key = tmp_path / "key.pem"
    key.write_text("not a key")
    with pytest.raises(LoadOptionError, match="--trusted-key"):
        LoadOptions.create(trusted_key=key)


def test_every_rank_gets_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    options = LoadOptions.create("cuda:1", ranks=2)
    assert [options.rank_device(r) for r in range(2)] == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert options.for_rank(1).device == torch.device("cuda", 2) and options.for_rank(1).rank == 1
    assert options.collective_backend == "nccl"
    with pytest.raises(LoadOptionError, match="needs CUDA devices 3..4, but torch sees 4"):
        LoadOptions.create("cuda:3", ranks=2)  # refused before any rank starts
    with pytest.raises(LoadOptionError, match="rank 2 is outside the 2 ranks"):
        options.rank_device(2)


def test_options_travel_whole_to_a_worker_rank():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate().public_key()
    options = LoadOptions.create("cpu", ranks=3, eager=True, trust_compiled=True, trusted_key=key,
                                 tp_host="127.0.0.1", timeout_s=12.5)
    worker = LoadOptions.from_json(options.to_json()).for_rank(2)
    assert worker.rank == 2 and worker.device == options.device
    assert (worker.ranks, worker.eager, worker.trust_compiled, worker.timeout_s) == (3, True, True, 12.5)
    assert worker.trusted_key.public_bytes_raw() == key.public_bytes_raw()
    with pytest.raises(LoadOptionError, match="unreadable load options from rank 0"):
        LoadOptions.from_json('{"device": "cpu"}')


def test_a_draft_core_loads_single_rank_and_untrusted():
    draft = LoadOptions.create("cpu", ranks=2, trust_compiled=True).for_draft()
    assert (draft.ranks, draft.rank, draft.trust_compiled) == (1, 0, False)
