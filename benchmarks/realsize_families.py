"""The shapes ``benchmarks/realsize.py --family`` builds random checkpoints of, and its memory rows per cache kind.

Each family: the recipe that exports it, the transformers classes that build and run it, and the published text
config of the real model it mimics (where each value comes from is noted beside it). ``--layers`` shrinks the
depth (the layer pattern is the published one, cut to that many layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ignition.catalog.inspect import kind_memory


@dataclass(frozen=True)
class Family:
    """One shape realsize can build: ``recipe`` for ``export-core``, the transformers config and model classes (by
    name, in ``transformers``), the real model's config values and how to lay out its layers."""

    label: str
    recipe: str
    config_class: str
    model_class: str
    shape: dict
    layers: int  # the real model's depth (the --layers default)
    layer_types: tuple[str, ...] = ()  # one period of the layer pattern, repeated over the depth (empty: none)
    extra: dict = field(default_factory=dict)  # config values that are not shape (ids, RoPE)

    def config(self, layers: int, dtype: str, overrides: dict | None = None):
        import transformers

        values = dict(self.shape)
        if self.layer_types:
            values["layer_types"] = [self.layer_types[i % len(self.layer_types)] for i in range(layers)]
        values |= overrides or {}  # last: a test's own layer pattern too
        return getattr(transformers, self.config_class)(num_hidden_layers=layers, torch_dtype=dtype, **self.extra,
                                                        **values)

    def model(self, config):
        import transformers

        return getattr(transformers, self.model_class)(config)

    def pretrained(self, checkpoint: Path, dtype: str, attention: str):
        import transformers

        return getattr(transformers, self.model_class).from_pretrained(
            checkpoint, torch_dtype=getattr(torch, dtype), attn_implementation=attention).eval()


_NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

FAMILIES: dict[str, Family] = {
    # Qwen/Qwen3-0.6B config.json
    "qwen3": Family("Qwen3-0.6B", "qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6), layers=28, extra=dict(bos_token_id=None, eos_token_id=None)),
    # google/gemma-3-1b-it config.json (Gemma3TextConfig): hidden 1152, 26 layers, 4 heads over 1 KV head of 256,
    # MLP 6912, vocabulary 262,144, window 512, five sliding layers to one full (sliding_window_pattern 6),
    # query_pre_attn_scalar 256, RoPE 1e6 on full layers and 1e4 (rope_local_base_freq) on sliding ones, tied
    "gemma3": Family("Gemma-3-1B", "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        layers=26, layer_types=("sliding_attention",) * 5 + ("full_attention",), extra=_NO_IDS),
    # Qwen/Qwen3.5-0.8B config.json text_config: hidden 1024, 24 layers laid out 6 x (3 Gated DeltaNet + 1 gated
    # attention) (layer_types; full_attention_interval 4), gated attention 8 query / 2 KV heads of 256 with a
    # 64-wide rotary part (partial_rotary_factor 0.25), Gated DeltaNet linear_num_key_heads 16 and
    # linear_num_value_heads 16 of linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4, MLP
    # 3584, vocabulary 248,320 tied, rope_theta 1e7 (its mrope_section only matters for image positions)
    "qwen3_5": Family("Qwen3.5-0.8B", "qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}),
        layers=24, layer_types=("linear_attention",) * 3 + ("full_attention",), extra=_NO_IDS),
}


def make_checkpoint(family: Family, directory: Path, layers: int, dtype: str, overrides: dict | None = None) -> Path:
    """A random checkpoint of ``family``'s shape (``overrides``: config values replaced, e.g. a smaller vocabulary),
    written by transformers' ``save_pretrained``."""
    torch.manual_seed(0)
    model = family.model(family.config(layers, dtype, overrides)).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _mib(count: int) -> str:
    """Bytes as MiB, or as KiB below one MiB (a tiny core's state)."""
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def _kept(positions: int | None) -> str:
    return "no positions" if positions is None else f"{positions} positions"


def memory_rows(manifest: dict, longer: dict | None = None) -> list[tuple[str, str, str, str]]:
    """The state memory of each cache kind a core's layers use (``inspect-core --memory``'s ``cache_kinds``): its
    layers, bytes and positions kept per slot. ``longer``: the manifest of a core exported with a longer
    ``max_seq_len``; then a row per kind compares the bytes per slot and layer of the two, which for a sliding layer
    stay those of its window and for a full one grow with ``max_seq_len``."""
    model = manifest["model"]
    kinds, rows = kind_memory(manifest), []
    for kind, entry in kinds.items():
        kept = entry["positions_per_slot"]
        note = {"full": f"{kept} positions per slot (max_seq_len {model.get('max_seq_len')})",
                "sliding": f"{kept} positions per slot (the blocks of window {model.get('sliding_window')} + a "
                           f"step's rows - 1 positions, at most max_seq_len {model.get('max_seq_len')})"}.get(
            kind, "a fixed state per slot, no positions")
        rows.append((f"state, {kind} layers ({entry['layers']}, {model.get('num_slots')} slots)",
                     _mib(entry["state_bytes"]), "", note))
    if longer is not None:
        other = kind_memory(longer)
        for kind, entry in kinds.items():
            if kind not in other or not entry["layers"]:
                continue
            mine = entry["state_bytes"] // (entry["layers"] * model["num_slots"])
            theirs = other[kind]["state_bytes"] // (other[kind]["layers"] * longer["model"]["num_slots"])
            kept = [_kept(entry["positions_per_slot"]), _kept(other[kind]["positions_per_slot"])]
            rows.append((f"state per slot and {kind} layer: max_seq_len {model['max_seq_len']} -> "
                         f"{longer['model']['max_seq_len']}", f"{_mib(mine)} -> {_mib(theirs)}", "",
                         (f"{theirs / mine:.2f}x" if mine else "") + f"; {kept[0]} -> {kept[1]}"))
    return rows
