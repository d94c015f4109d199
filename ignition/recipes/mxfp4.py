"""MXFP4-stored experts (GPT-OSS ``quantization_config.quant_method == "mxfp4"``), dequantized when read.

An MXFP4 tensor ``W`` is stored as two: ``W_blocks [*prefix, G, 16]`` (uint8, two 4-bit e2m1 codes a byte, the low
nibble first) and ``W_scales [*prefix, G]`` (uint8, an e8m0 exponent biased by 127 shared by each block of 32
values). Value ``2 * i + n`` of block ``g`` is ``E2M1[code] * 2 ** (scale[g] - 127)``, exactly representable in FP32
(transformers' ``integrations/mxfp4.py``, ``convert_moe_packed_tensors``). The dequantized ``[*prefix, G * 32]`` is
transposed on its last two dims to the layout transformers' BF16 ``GptOssExperts`` stores: ``gate_up_proj_blocks
[E, 2I, H / 32, 16]`` becomes ``gate_up_proj [E, H, 2I]``, ``down_proj_blocks [E, H, I / 32, 16]`` ``down_proj
[E, I, H]``. ``Mxfp4Checkpoint`` presents each pair under the BF16 name, so the recipe's weight table checks and
loads it as it would a BF16 checkpoint's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ignition.recipes.checkpoint import Checkpoint, CheckpointError, TensorInfo, open_checkpoint, read_config

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 e2m1 codes' values (sign bit 3, exponent bits 2-1, mantissa bit 0)."""
BLOCK_BYTES = 16  # one block: 32 four-bit codes
SCALE_BIAS = 127  # e8m0: the exponent is the byte minus this
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [*prefix, G, 16]`` and ``scales [*prefix, G]`` (uint8) -> FP32 ``[*prefix, G * 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BLOCK_BYTES \
            or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks must be uint8 [..., G, {BLOCK_BYTES}] with uint8 scales [..., G]; "
                              f"found {blocks.dtype} {list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [*prefix, G, 16, 2]: low nibble first
    values = table[codes].flatten(-2)  # [*prefix, G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [*prefix, G]
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)  # [*prefix, G * 32]


def stored_layout(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A ``*_blocks``/``*_scales`` pair as the BF16 checkpoint's tensor: dequantized, last two dims swapped."""
    return dequantize_mxfp4(blocks, scales).transpose(-2, -1).contiguous()


@dataclass(frozen=True, slots=True)
class Mxfp4Checkpoint(Checkpoint):
    """A checkpoint whose ``*_blocks``/``*_scales`` pairs read as the dequantized tensor of their common name."""

    stored: Checkpoint | None = None  # the checkpoint as stored, blocks and scales included
    pairs: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # name -> (blocks name, scales name)

    def load(self, name: str) -> torch.Tensor:
        if name not in self.pairs:
            return self.stored.load(name)
        blocks, scales = self.pairs[name]
        return stored_layout(self.stored.load(blocks), self.stored.load(scales))


def with_dequantized(checkpoint: Checkpoint) -> Mxfp4Checkpoint:
    """``checkpoint`` with every ``X_blocks``/``X_scales`` pair replaced by ``X`` (FP32 after dequantization)."""
    tensors, pairs = dict(checkpoint.tensors), {}
    for blocks in [name for name in checkpoint.tensors if name.endswith(BLOCKS_SUFFIX)]:
        name = blocks.removesuffix(BLOCKS_SUFFIX)
        scales = name + SCALES_SUFFIX
        if scales not in tensors:
            raise CheckpointError(f"{checkpoint.directory}: MXFP4 tensor {blocks!r} needs its scales {scales!r}; "
                                  f"found none in {checkpoint.files()}")
        block_info, scale_info = tensors.pop(blocks), tensors.pop(scales)
        if len(block_info.shape) < 3 or block_info.shape[-1] != BLOCK_BYTES \
                or block_info.shape[:-1] != scale_info.shape:
            raise CheckpointError(f"{block_info.file}: MXFP4 tensor {blocks!r} must be [..., G, {BLOCK_BYTES}] "
                                  f"over its scales [..., G]; found {list(block_info.shape)} and "
                                  f"{list(scale_info.shape)}")
        *prefix, rows, groups, _ = block_info.shape
        tensors[name] = TensorInfo(block_info.file, torch.float32, (*prefix, groups * 2 * BLOCK_BYTES, rows))
        pairs[name] = (blocks, scales)
    return Mxfp4Checkpoint(checkpoint.directory, tensors, checkpoint, pairs)


def open_gpt_oss_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path``; with an MXFP4 ``quantization_config``, its expert pairs dequantized when read."""
    checkpoint = open_checkpoint(path)
    quantization = read_config(path).get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        return with_dequantized(checkpoint)
    return checkpoint
