"""--batch-invariant: a request's tokens and logprob words do not depend on its co-batching."""

from __future__ import annotations

import pytest
import torch

from ignition.catalog.enums import Operation
from ignition.exporter.export import export_core
from ignition.recipes.base import ExportOptions
from ignition.runtime.core import load_core
from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request

CONCURRENT = 64


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from tests._decoder_cores import TinyCase, save_checkpoint

    root = tmp_path_factory.mktemp("invariance")
    save_checkpoint(TinyCase("qwen3", torch.float32, False, 300), root / "ckpt")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "ckpt", capacities=(1, 2, 4, 8), chunk_limit=16,
                              max_seq_len=64), root / "core")
    return load_core(root / "core")


def _requests() -> list[Request]:
    return [Request(prompt_ids=[(7 * i + j) % 290 + 1 for j in range(3 + i % 5)], max_tokens=4, ignore_eos=True,
                    logprobs=5 if i % 3 else None, logprob_token_ids=[0, 17, 299] if i % 3 == 0 else None)
            for i in range(CONCURRENT)]


def _words(result) -> list:
    return [(e.id, e.logprob, e.top) for e in result.entries]


def test_concurrent_requests_are_bit_identical_to_alone(core):
    together = Engine(core, batch_invariant=True).generate(_requests())
    alone = [Engine(core, batch_invariant=True).generate([request])[0] for request in _requests()]
    for a, b in zip(together, alone):
        assert a.error is None and a.token_ids == b.token_ids
        assert _words(a) == _words(b)  # float equality of FP32 values read from identical bits


def _decode_capacities(engine: Engine) -> set[int]:
    used = set()

    def hook(variant, reader, pending):
        if variant.operation is Operation.DECODE:
            used.add(variant.capacity)

    engine.decode_hook = hook
    engine.generate(_requests()[:1])
    return used


def test_flag_replays_the_largest_decode_variant(core):
    assert _decode_capacities(Engine(core, batch_invariant=True)) == {8}
    assert _decode_capacities(Engine(core)) == {1}
