"""benchmarks/long_context.py in a tiny form: a served prompt longer than the KV budget's slot layout could hold."""

from __future__ import annotations

import re

from benchmarks import long_context


def test_a_budgeted_server_serves_a_prompt_the_slot_layout_could_not_hold(tmp_path, capsys):
    budget = 9 * 2**20  # 1 layer, 8 KV heads of 128 FP32: 8 KiB a token; 71 blocks of 16 after the null block
    result = long_context.main(["--threads", "1", "--layers", "1", "--hidden", "64", "--vocab", "512",
                                "--max-seq-len", "1024", "--prompt", "700", "--kv-cache-memory", str(budget),
                                "--workdir", str(tmp_path)])
    capacity = int(re.search(r"KV capacity ([\d,]+) tokens", result["line"]).group(1).replace(",", ""))
    assert 700 + 4 <= capacity < long_context.SLOTS * 1024
    assert result["slot_layout"] == long_context.SLOTS * 1024 * 2 * 8 * 128 * 4
    assert result["slot_layout"] > budget
    assert (result["prompt_tokens"], result["completion_tokens"]) == (700, 4)
    assert len(result["logprobs"]) == 4 and all(value <= 0 for value in result["logprobs"])
    assert result["rss"] > 0
    assert "| 700-token prompt, 4 tokens returned |" in capsys.readouterr().out


def test_a_pool_bound_past_the_machines_memory_exports(tmp_path):
    """The paged pool's declared bound (num_slots x max_seq_len positions) is traced with a few blocks, never
    allocated: 256 slots of 32,768 positions declare 64 GiB of one layer's K/V, more than a CI machine has."""
    import json

    from benchmarks._common import export
    from benchmarks.realsize_families import FAMILIES, make_checkpoint

    checkpoint = make_checkpoint(FAMILIES["qwen3"], tmp_path / "ckpt", 1, "float32",
                                 {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192,
                                  "max_position_embeddings": 32768})
    core = export(checkpoint, tmp_path / "core", capacities=(1,), num_slots=256, max_seq_len=32768, block_size=16)
    model = json.loads((core / "manifest.json").read_text())["model"]
    assert model["kv_blocks"] == 256 * 32768 // 16
    assert long_context.slot_layout_bytes({"model": model}) == 64 * 2**30
