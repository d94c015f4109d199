"""The reductions in standard ONNX operators, replayed by onnxruntime, against the torch reference.

One small graph calls both opaque ops (``ignition::reduce_logprobs`` with explicit IDs,
``ignition::score_prompt_rows``) and the bit-cast on probe values; it goes through the same
exporter as a core's variants (reduction nodes rewritten to standard operators, functional
wrapper, opset 18) and runs in onnxruntime. The rows are adversarial: all-equal rows, ties that
exist only after the subtraction, -0.0, NaN and infinite logits, huge padded lanes, selected ids
outside the vocabulary, and a row whose request flag is zero.

Rows whose normalization is exact in any FP32 implementation (a dominant logit: lse equals it;
equal logits: every reported value ties whatever lse is) must agree bit for bit, ids and value
words alike; random rows agree in ids and order, and in values within 1e-6 (onnxruntime's exp
and log are other implementations than torch's, so lse may differ by an ulp).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402

from ignition.catalog.contract import MAX_SELECTED_IDS, NAN_BITS, PROMPT_ROW_WIDTH, packed_width  # noqa: E402
from ignition.catalog.enums import Role  # noqa: E402
from ignition.catalog.model import BufferDecl  # noqa: E402
from ignition.components.logprobs import reduce_logprobs_reference  # noqa: E402
from ignition.components.onnx_standard import float_bits, reduce_logprobs_standard  # noqa: E402
from ignition.components.prompt_scoring import score_rows_reference  # noqa: E402

VOCAB, PADDED, K = 250, 256, 20
WIDTH = packed_width(K, True)
SENTINEL = -7
TIE = 2.0 ** 24  # x - 2**24 rounds every x in [0, 0.5] to -2**24: ties created by the subtraction


def adversarial_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(PADDED, generator=g) * 3 for _ in range(10)]
    rows[1][:VOCAB] = 0.0  # every reported value ties: ids 0..19
    rows[1][VOCAB:] = 1e30  # padded lanes hold huge values: they must never enter
    rows[2][:VOCAB] = -3.5
    rows[2][VOCAB:] = float("inf")
    rows[3][:VOCAB] = -1e4
    rows[3][100] = TIE
    for token, logit in ((7, 0.4), (3, 0.1), (5, 0.3), (9, 0.2)):  # logit order 7, 5, 9, 3; reported ties: 3, 5, 7, 9
        rows[3][token] = logit
    rows[4][[11, 40, 200]] = float("nan")  # lse is NaN: every value NaN (ranked as -inf), ids by index
    rows[5][:] = float("-inf")
    rows[5][42] = -0.0  # lse = +0.0, reported -0.0 - 0.0 = -0.0: reported as +0.0
    rows[6][:VOCAB] = float("-inf")  # lse = -inf: every value NaN, ids by index
    rows[7][17] = float("inf")  # lse = inf
    rows[8][VOCAB:] = float("nan")
    return torch.stack(rows)


ROWS = 10
EXACT_ROWS = (1, 2, 3, 5, 6, 7)  # lse is exact (or every value ties): bit-identical words
CHOSEN = torch.tensor([0, 5, 249, 3, 40, 42, 0, 17, 100, 7])
REQUESTED = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.int32)
COUNTS = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 5, 128], dtype=torch.int32)
TARGETS = torch.tensor([3, 7, -1, 5, 40, 42, 0, 250, 249, 9], dtype=torch.int32)


def selected_ids() -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (ROWS, MAX_SELECTED_IDS), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    ids[8, :5] = torch.tensor([249, -1, 250, 300, 3], dtype=torch.int32)  # outside the vocabulary: NaN
    return ids


def probe_values() -> torch.Tensor:
    """Every class of float32: random bit patterns, subnormals, extremes, zeros, infinities, NaN."""
    patterns = torch.randint(-2 ** 31, 2 ** 31 - 1, (4000,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.4e-45, -1.4e-45, 1.1754942e-38, 1.17549435e-38,
               3.4028235e38, -3.4028235e38, 1.0, -1.0, 2.0 ** -126, 2.0 ** 127, 1.5, -0.75, TIE]
    return torch.cat([patterns.view(torch.float32), torch.tensor(special, dtype=torch.float32)])


def reference_bits(values: torch.Tensor) -> torch.Tensor:
    bits = (values + 0.0).view(torch.int32)
    return torch.where(torch.isnan(values), torch.tensor(NAN_BITS, dtype=torch.int32), bits)


class Reductions(torch.nn.Module):
    """Both opaque ops and the bit-cast, writing their outputs in place like a core's graph."""

    def forward(self, b):
        rows = b["logits"].shape[0]
        torch.ops.ignition.reduce_logprobs(b["logits"], b["chosen"], b["requested"], b["completion_logprobs"],
                                           rows + torch.arange(rows), b["token_ids"], b["counts"], VOCAB, K)
        torch.ops.ignition.score_prompt_rows(b["logits"], b["targets"], b["prompt_logprobs"], torch.arange(rows), VOCAB)
        b["probe_bits"].copy_(float_bits(b["probe"]))
        return (b["chosen"] + 0,)


def declarations(probes: int) -> list[BufferDecl]:
    return [BufferDecl("logits", "float32", [ROWS, PADDED]), BufferDecl("chosen", "int64", [ROWS]),
            BufferDecl("requested", "int32", [ROWS]), BufferDecl("token_ids", "int32", [ROWS, MAX_SELECTED_IDS]),
            BufferDecl("counts", "int32", [ROWS]), BufferDecl("targets", "int32", [ROWS]),
            BufferDecl("probe", "float32", [probes]),
            BufferDecl("completion_logprobs", "int32", [2, ROWS, 1, WIDTH], Role.OUTPUT),
            BufferDecl("prompt_logprobs", "int32", [2, ROWS, PROMPT_ROW_WIDTH], Role.OUTPUT),
            BufferDecl("probe_bits", "int32", [probes], Role.OUTPUT)]


def inputs() -> dict[str, torch.Tensor]:
    probe = probe_values()
    return {"logits": adversarial_logits(), "chosen": CHOSEN.clone(), "requested": REQUESTED.clone(),
            "token_ids": selected_ids(), "counts": COUNTS.clone(), "targets": TARGETS.clone(), "probe": probe,
            "completion_logprobs": torch.full((2, ROWS, 1, WIDTH), SENTINEL, dtype=torch.int32),
            "prompt_logprobs": torch.full((2, ROWS, PROMPT_ROW_WIDTH), SENTINEL, dtype=torch.int32),
            "probe_bits": torch.zeros(probe.shape[0], dtype=torch.int32)}


@pytest.fixture(scope="module")
def onnx_outputs(tmp_path_factory) -> dict[str, np.ndarray]:
    from ignition.exporter.onnx_export import export_onnx

    example = inputs()
    program = torch.export.export(Reductions(), (example,), strict=False)
    path = tmp_path_factory.mktemp("onnx-reduction") / "reductions.onnx"
    export_onnx(program, declarations(example["probe"].shape[0]), example, {}, "weights.safetensors", path, "test")
    session = ort.InferenceSession(str(path))
    feeds = {i.name: example[i.name].numpy() for i in session.get_inputs()}
    return {o.name.removesuffix(".out"): value for o, value in zip(session.get_outputs(), session.run(None, feeds))}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    b = inputs()
    reduce_logprobs_reference(b["logits"], b["chosen"], b["requested"], b["completion_logprobs"],
                              ROWS + torch.arange(ROWS), b["token_ids"], b["counts"], VOCAB, K)
    score_rows_reference(b["logits"], b["targets"], b["prompt_logprobs"], torch.arange(ROWS), VOCAB)
    return b


def test_bit_cast_is_exact_in_onnxruntime(onnx_outputs):
    np.testing.assert_array_equal(onnx_outputs["probe_bits"], reference_bits(probe_values()).numpy())


def test_bit_cast_is_exact_in_torch():
    values = probe_values()
    assert torch.equal(float_bits(values), reference_bits(values))


def _values(words: np.ndarray) -> np.ndarray:
    return words.view(np.float32)


def test_generation_rows_match_the_reference(onnx_outputs, reference):
    got = onnx_outputs["completion_logprobs"]
    want = reference["completion_logprobs"].numpy()
    np.testing.assert_array_equal(got[0], want[0])  # frame 0 untouched
    got, want = got[1, :, 0], want[1, :, 0]  # [rows, 258]
    np.testing.assert_array_equal(got[9], np.full(WIDTH, SENTINEL))  # zero request flag: nothing written
    np.testing.assert_array_equal(got[:, 0::2], want[:, 0::2])  # ids and their order, every row
    for row in EXACT_ROWS:
        np.testing.assert_array_equal(got[row], want[row], err_msg=f"row {row}")
    np.testing.assert_allclose(_values(got[:, 1::2]), _values(want[:, 1::2]), atol=1e-6, rtol=0)  # NaN == NaN


def test_adversarial_orders(onnx_outputs):
    words = onnx_outputs["completion_logprobs"][1, :, 0]
    natural = lambda row: words[row, 2:2 + 2 * K:2].tolist()  # noqa: E731
    assert natural(1) == natural(2) == list(range(K))  # all ties: ascending ids; padded lanes never enter
    assert natural(3)[:5] == [100, 3, 5, 7, 9]  # ties created by the subtraction: ascending ids
    assert natural(5)[0] == 42 and words[5, 3] == 0 and words[5, 1] == 0  # -0.0 reported as +0.0
    assert natural(6) == list(range(K)) and set(words[6, 3:2 + 2 * K:2]) == {NAN_BITS}
    assert natural(4) == list(range(K)) and words[4, 1] == NAN_BITS  # a NaN logit poisons lse: all NaN, by index
    assert words[8, 2:12:2].tolist() == [249, -1, 250, 300, 3]  # selected ids in caller order
    assert words[8, 5:11:2].tolist() == [NAN_BITS] * 3  # outside the vocabulary: NaN


def test_prompt_rows_match_the_reference(onnx_outputs, reference):
    got = onnx_outputs["prompt_logprobs"]
    want = reference["prompt_logprobs"].numpy()
    np.testing.assert_array_equal(got[1], want[1])  # frame 1 untouched
    ids = np.r_[0, 2, 3:PROMPT_ROW_WIDTH:2]  # id, rank, alternative ids
    np.testing.assert_array_equal(got[0][:, ids], want[0][:, ids])
    for row in EXACT_ROWS:
        np.testing.assert_array_equal(got[0, row], want[0, row], err_msg=f"row {row}")
    values = np.r_[1, 4:PROMPT_ROW_WIDTH:2]
    np.testing.assert_allclose(_values(got[0][:, values]), _values(want[0][:, values]), atol=1e-6, rtol=0)


def test_small_vocabulary_pads_alternatives():
    """vocab_size < K: the formulation pads with id -1 and NaN like the reference (torch eager, distinct values)."""
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    args = (torch.tensor([0, 6, 2]), torch.ones(3, dtype=torch.int32))
    got = torch.full((3, packed_width(K, False)), SENTINEL, dtype=torch.int32)
    want = got.clone()
    reduce_logprobs_standard(logits, *args, got, torch.arange(3), None, None, 7, K)
    reduce_logprobs_reference(logits, *args, want, torch.arange(3), None, None, 7, K)
    assert torch.equal(got, want)
