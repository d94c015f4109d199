"""The llama.cpp anchor of ``benchmarks/realsize.py`` (``benchmarks/llama_cpp.py``): what it says where llama.cpp is not
built, the byte-level tokenizer a random checkpoint converts with, the reading of ``llama-batched-bench``'s output and
the ratio rows; where ``python -m benchmarks.llama_cpp build`` has run (its default cache directory), a tiny Qwen3
checkpoint converted to an F32 GGUF and decoded by it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import llama_cpp

SAMPLE = """\
main: n_kv_max = 512, n_batch = 2048
{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": 99, \
"n_threads": 2, "n_threads_batch": 2, "pp": 4, "tg": 16, "pl": 1, "n_kv": 20, "t_pp": 0.01, "speed_pp": 400.0, \
"t_tg": 1.6, "speed_tg": 10.0, "t": 1.61, "speed": 12.4}
{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": 99, \
"n_threads": 2, "n_threads_batch": 2, "pp": 4, "tg": 16, "pl": 8, "n_kv": 160, "t_pp": 0.05, "speed_pp": 640.0, \
"t_tg": 2.0, "speed_tg": 64.0, "t": 2.05, "speed": 78.0}
"""


def test_missing_tools_name_the_build_command(tmp_path):
    with pytest.raises(llama_cpp.LlamaCppMissing) as raised:
        llama_cpp.tools(tmp_path)
    message = str(raised.value)
    assert llama_cpp.BUILD_COMMAND in message and str(tmp_path / "build" / "bin" / "llama-batched-bench") in message


def test_anchor_without_llama_cpp_reports_no_number(tmp_path):
    rows, targets = llama_cpp.anchor(tmp_path / "checkpoint", tmp_path, "bfloat16", [1, 8, 32], 4, 16, 2, 3,
                                     {1: 10.0, 8: 50.0, 32: 90.0}, root=tmp_path)
    assert len(rows) == 1 and "not measured" in rows[0][2] and llama_cpp.BUILD_COMMAND in rows[0][2]
    assert [target for target, _, _ in targets] == [
        "decode batch 1 at least 1.0x llama.cpp (BF16 GGUF)", "decode batch 8 at least 1.0x llama.cpp (BF16 GGUF)"]
    assert not any(met for _, _, met in targets)
    assert all(measured == rows[0][2] for _, measured, _ in targets) and "tok/s" not in rows[0][2]


def test_batched_bench_output_is_read_per_batch():
    assert llama_cpp.parse_batched_bench(SAMPLE) == {1: 10.0, 8: 64.0}
    with pytest.raises(ValueError, match="no JSONL result"):
        llama_cpp.parse_batched_bench("main: error: failed to load model\n")


def test_a_run_that_lost_its_lines_is_run_again(monkeypatch):
    """llama.cpp's log thread is not drained at exit, so a run may print none or some of its batches' lines."""
    import subprocess
    from types import SimpleNamespace

    outputs = ["", SAMPLE.splitlines()[1] + "\n", SAMPLE]  # nothing, batch 1 only, both
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout=outputs.pop(0),
                                                                            stderr=""))
    assert llama_cpp._complete_run(["bench"], [1, 8]) == {1: 10.0, 8: 64.0} and not outputs
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout="", stderr="log"))
    with pytest.raises(SystemExit, match=f"no result for every batch in {llama_cpp.RUN_ATTEMPTS} runs"):
        llama_cpp._complete_run(["bench"], [1, 8])


def test_batched_bench_command(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "tools", lambda root=None: {"llama-batched-bench": Path("/bin/bench")})
    command = llama_cpp.batched_bench_command(tmp_path / "m.gguf", [1, 8], 4, 16, 2)
    options = dict(zip(command[1::2], command[2::2]))
    assert command[0] == "/bin/bench"
    assert options == {"-m": str(tmp_path / "m.gguf"), "-c": str(8 * llama_cpp.SEQUENCE_CELLS), "-b": "2048",
                       "-ub": "512", "-npp": "4", "-ntg": "16", "-npl": "1,8", "-t": "2", "-tb": "2",
                       "--output-format": "jsonl"}
    with pytest.raises(ValueError, match="exceed"):
        llama_cpp.batched_bench_command(tmp_path / "m.gguf", [1], 60, 16, 2)


def test_anchor_rows_ratio_and_targets():
    rows, targets = llama_cpp.anchor_rows("float32", {1: [9.0, 10.0, 12.0], 8: [60.0, 64.0, 70.0], 32: [100.0]},
                                          {1: 11.0, 8: 48.0, 32: 150.0})
    assert [row[3] for row in rows] == ["1.10x llama.cpp", "0.75x llama.cpp", "1.50x llama.cpp"]
    assert rows[0][2] == "llama.cpp 10.00 tok/s (runs: 9.0, 10.0, 12.0)"
    assert targets == [("decode batch 1 at least 1.0x llama.cpp (F32 GGUF, logprobs off)", "1.10x", True),
                       ("decode batch 8 at least 1.0x llama.cpp (F32 GGUF, logprobs off)", "0.75x", False)]


def test_byte_level_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    llama_cpp.write_tokenizer(tmp_path, 512)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == llama_cpp.TOKENIZER_SIZE
    text = "héllo, wörld 🚀 \t\n 12345"  # any bytes: the 256 byte tokens cover them
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]  # llama.cpp needs merges
    with pytest.raises(ValueError, match="at least 320"):
        llama_cpp.write_tokenizer(tmp_path, 256)


BUILT = Path.home() / ".cache" / "ignition" / "llama.cpp" / llama_cpp.LLAMA_CPP_PYTHON
"""The default build directory (tests run with their own ``IGNITION_CACHE_DIR``, so ``build_root`` is not it)."""


@pytest.mark.skipif(not (BUILT / "build" / "bin" / "llama-batched-bench").is_file(),
                    reason=f"llama.cpp not built ({llama_cpp.BUILD_COMMAND})")
def test_tiny_checkpoint_converts_and_decodes(tmp_path):
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(tmp_path / "checkpoint")
    model = llama_cpp.convert(tmp_path / "checkpoint", "float32", tmp_path / "model.gguf", BUILT)
    assert model.read_bytes()[:4] == b"GGUF"
    runs = llama_cpp.decode_rates(model, [1, 2], 4, 4, 1, 1, BUILT)
    assert set(runs) == {1, 2} and all(rate > 0 for rates in runs.values() for rate in rates)
