"""Ignition: export LLM checkpoints to validated cores with exact in-graph logprobs.

Importing ``ignition`` registers the ``ignition::*`` ops, which loading a core's ``.pt2``
graphs requires.
"""

from ignition import components as _components  # noqa: F401  (registers ignition::reduce_logprobs)

__version__ = "0.1.0"
