"""Shared sampling, commit, completion outputs and logprob reduction."""

from ignition.components import logprobs  # noqa: F401  (registers ignition::reduce_logprobs on CPU)
from ignition.components import device_reduction  # noqa: F401  (the CUDA implementation: prepared launches)
from ignition.components import prompt_scoring  # noqa: F401  (registers ignition::score_prompt_rows)
from ignition.components import vocabulary_logprobs  # noqa: F401  (registers the sharded reduction ops)
