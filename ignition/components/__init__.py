"""Shared sampling, commit, completion outputs and logprob reduction."""

from ignition.components import logprobs  # noqa: F401  (registers ignition::reduce_logprobs on CPU)
from ignition.components import prompt_scoring  # noqa: F401  (registers ignition::score_prompt_rows)

try:  # the Triton launches register the CUDA implementation of the same op
    from ignition.components import triton_logprobs  # noqa: F401
except ImportError:  # pragma: no cover - a build without the Triton path still serves on CPU
    triton_logprobs = None
