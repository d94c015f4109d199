"""Accuracy against an oracle the way the specification asks: the spread across fresh runs plus FP32 rounding.

``spread`` is the elementwise range of fresh runs (a freshly loaded core, a freshly loaded transformers model);
``Float64`` runs a transformers model whose weights are FP64 in FP64 throughout (its explicit FP32 casts, such as
an RMS norm's ``.float()`` or a softmax's ``dtype=torch.float32``, become FP64), the reference both FP32 forwards
are measured against: where ours and transformers' FP32 results differ by more than the FP32 bound, the exact
forward says which one rounded.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class Float64(TorchFunctionMode):
    """Every torch call in FP64: ``torch.float32`` arguments become ``torch.float64``, ``Tensor.float()`` is
    ``Tensor.double()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def widened(value):
            return torch.float64 if value is torch.float32 else value

        args = tuple(widened(a) for a in args)
        kwargs = {k: widened(v) for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            return args[0].double()
        return func(*args, **kwargs)


def spread(runs: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise max - min over fresh runs of the same computation (0 where they repeat bit for bit)."""
    stacked = torch.stack([run.double() for run in runs])
    return stacked.amax(0) - stacked.amin(0)


def incremental(model, prompt: list[int], steps: int, fp64: bool = False) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` with its cache: the tokens and each step's logprobs ``[steps, vocab]``
    (FP64 values; ``fp64``: computed in FP64 by a model loaded in FP64)."""
    def run():
        return model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        if fp64:
            with Float64():
                out = run()
        else:
            out = run()
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(torch.stack(out.logits)[:, 0].double(), -1)


def full(model, tokens: list[int], fp64: bool = False) -> torch.Tensor:
    """transformers' full forward over ``tokens``: logprobs ``[len(tokens), vocab]`` (FP64 values)."""
    with torch.no_grad():
        if fp64:
            with Float64():
                logits = model(torch.tensor([tokens])).logits[0]
        else:
            logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)
