"""The tensor-parallel tests' one exported core, shared by test_tensor_parallel.py and test_serve_tensor_parallel.py.

A TP=2 export is the slowest thing these tests do (every variant traced once per rank, then validated),
so the core is exported once per test run: under pytest-xdist (``make test``) the workers share one
directory beside their own temporary roots and take turns through a file lock, the first one exporting
(pytest-xdist's documented pattern for a session fixture that runs once). The TP=1 reference needs no
export at all: ``eager_core`` runs the same recipe's graph modules eagerly (what the exported graphs run).

The checkpoint: tests/_decoder_cores.py's tiny tied-embedding Qwen3 with a vocabulary of 151, which does
not divide by 2 (the shards pad it to 152; the padding lane never enters a result). The core: capacity 1,
chunks of 8, a 32-token context, prompt scoring, the sharded launches prepared for cuda:90, and a small
ASCII tokenizer with a chat template.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from _decoder_cores import TinyCase, save_checkpoint
from ignition.catalog.enums import Role
from ignition.exporter.export import export_core, manifest_for
from ignition.recipes.base import ExportOptions
from ignition.recipes.registry import build_recipe
from ignition.runtime.core import LoadedCore, LoadedVariant
from ignition.runtime.transfer import HostTransfer

VOCAB = 151
ULPS = 8
"""End-to-end bound of a TP=2 logprob against TP=1, in FP32 ulps of its magnitude (test_tensor_parallel.py)."""
CASE = TinyCase("qwen3", torch.float32, tie=True, vocab_size=VOCAB)
SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass(frozen=True, slots=True)
class TPCores:
    checkpoint: Path
    tokenizer: Path  # directory: tokenizer.json, tokenizer_config.json (with the chat template)
    tp2: Path  # the exported TP=2 core (its tokenizer/ is a copy of ``tokenizer``)

    def options(self, ranks: int) -> ExportOptions:
        """TP=``ranks``; the sharded core also prepares its six sharded launches for cuda:90."""
        return ExportOptions(recipe="qwen3", checkpoint=self.checkpoint, capacities=(1,), chunk_limit=8,
                             max_seq_len=32, prompt_logprobs=True, tokenizer=self.tokenizer, tensor_parallel=ranks,
                             targets=("cuda:90",) if ranks > 1 else ())


def _write_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of fewer ids than the model's vocabulary (ids above it have no text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["the cat sat on the mat, a dog ran to the log."] * 5,
                                  trainers.BpeTrainer(vocab_size=140, special_tokens=SPECIAL, show_progress=False))
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>",
                                                                 "chat_template": CHAT_TEMPLATE}))
    return directory


def shared_tp_cores(tmp_path_factory) -> TPCores:
    """The checkpoint, tokenizer and TP=2 core, built by the first test process that asks, under a lock."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tp-shared"
    root.mkdir(exist_ok=True)
    cores = TPCores(root / "ckpt", root / "tokenizer", root / "tp2")
    with FileLock(str(root / "build.lock")):
        if not (cores.tp2 / "manifest.json").is_file():  # export_core publishes the directory whole, or not at all
            for partial in (cores.checkpoint, cores.tokenizer):
                if partial.exists():  # an earlier process died half-way: start again
                    import shutil
                    shutil.rmtree(partial)
            save_checkpoint(CASE, cores.checkpoint)
            _write_tokenizer(cores.tokenizer)
            export_core(cores.options(2), cores.tp2)
    return cores


def eager_core(options: ExportOptions) -> LoadedCore:
    """A LoadedCore whose variants run the recipe's modules eagerly (no export, no validation)."""
    options = replace(options, tokenizer=None)  # the tokenizer is served from its directory (ServeConfig)
    build = build_recipe(options)
    state = {decl.name: decl.empty() for decl in build.state}
    variants = {}
    for graph in build.graphs:
        v = graph.variant
        buffers = {a.name: build.weights[a.name] if a.role is Role.WEIGHT else state[a.name] if a.role is Role.STATE
                   else a.empty() for a in v.arguments}
        variants[v.name] = LoadedVariant(v.name, v.operation, v.capacity, v.arguments, v.bindings, v.layout,
                                         graph.module, buffers)
    manifest = manifest_for(build, options, {}, False)
    return LoadedCore(Path("eager"), manifest, build.weights, state, variants, transfer=HostTransfer(torch.device("cpu")))


def ulps(a: float, b: float) -> float:
    """|a - b| in FP32 ulps of the larger magnitude."""
    return abs(a - b) / float(np.spacing(np.float32(max(abs(a), abs(b)))))


def close(a: float | None, b: float | None, bound: float = ULPS) -> bool:
    """Within ``bound`` FP32 ulps of the larger magnitude (None and NaN only match themselves)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return (a is None) == (b is None) and (a is None or math.isnan(a) == math.isnan(b))
    return ulps(a, b) <= bound
