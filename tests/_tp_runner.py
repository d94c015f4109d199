"""Rank 0 of a tensor-parallel run, as its own process (tests/test_tensor_parallel.py).

``python tests/_tp_runner.py CORE[,CORE...] RANKS [--prefix] [--kill] [--requests FILE]`` starts each core's ranks
in turn (one process start for every core), runs ``requests()`` (or FILE's: a JSON list of ``Request`` fields) and
prints one JSON line: a list of results per core, in the order given; with ``--prefix``, per core the
``prefix_requests()`` run one at a time with prefix caching off and on (``prefix``: both results and the cached
tokens; None for a pool too small for them); with ``--kill`` it then kills rank 1 of the last core and reports how
the next submission fails.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ignition.runtime.engine import Engine
from ignition.runtime.requests import Request, SamplingParams

PROMPT = [5, 17, 33, 2, 140, 9]
SELECTED = [0, 150, 7, 75, 76, 3]  # both sides of the TP=2 shard boundary (76) and the last token


def requests(path: str | None = None) -> list[Request]:
    if path is not None:
        return [Request(**fields) for fields in json.loads(Path(path).read_text())]
    return [Request(prompt_ids=PROMPT, max_tokens=5, logprobs=20, ignore_eos=True),
            Request(prompt_ids=PROMPT[:3], max_tokens=3, logprob_token_ids=SELECTED, ignore_eos=True)]


def prefix_requests(block_size: int) -> list[Request]:
    """The same prompt of one full block and 2 tokens twice (the block cached for the second), with penalties: the
    second's prefill starts after the cached block on every rank, its penalty counts seeded from the prompt."""
    prompt = [(7 * j + 3) % 140 + 1 for j in range(block_size + 2)]
    return [Request(prompt_ids=prompt, max_tokens=4, logprobs=3, ignore_eos=True,
                    sampling=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)) for _ in range(2)]


def prefix_run(loaded) -> dict | None:
    """``prefix_requests()`` one at a time on an engine without prefix caching, then on one with it; None when the
    core's pool cannot hold a request that long."""
    block_size = loaded.kv_pool.block_size
    if loaded.kv_pool.capacity_tokens < block_size + 6:
        return None
    cold = Engine(loaded, prefix_caching=False)
    cold_results = [as_json(cold.generate([r])[0]) for r in prefix_requests(block_size)]
    warm = Engine(loaded)
    warm_results = [as_json(warm.generate([r])[0]) for r in prefix_requests(block_size)]
    return {"cold": cold_results, "warm": warm_results, "hits": warm.kv_cache_stats()["prefix_cache_hits"],
            "block_size": block_size}


def as_json(result) -> dict:
    return {"tokens": list(result.token_ids), "error": result.error,
            "entries": [{"id": e.id, "logprob": e.logprob, "top": [list(pair) for pair in e.top]}
                        for e in result.entries],
            "prompt": result.prompt_entries}


def run(cores: list[str], ranks: int, kill: bool, path: str | None = None, prefix: bool = False) -> dict:
    from ignition.runtime.parallel.group import ParallelError, tensor_parallel

    report = {"results": [], "prefix": []}
    for index, core in enumerate(cores):
        with tensor_parallel(core, ranks, device="cpu", timeout_s=60) as loaded:
            engine = Engine(loaded)
            report["results"].append([as_json(r) for r in engine.generate(requests(path))])
            if prefix:
                report["prefix"].append(prefix_run(loaded))
            if kill and index == len(cores) - 1:
                group = loaded.group
                os.kill(group.workers[0].pid, signal.SIGKILL)
                started = time.perf_counter()
                try:
                    engine.generate(requests()[:1])
                    report["failure"] = None
                except ParallelError as exc:
                    report["failure"] = str(exc)
                report["failure_seconds"] = time.perf_counter() - started
    return report


if __name__ == "__main__":
    options = sys.argv[3:]
    path = options[options.index("--requests") + 1] if "--requests" in options else None
    print(json.dumps(run(sys.argv[1].split(","), int(sys.argv[2]), "--kill" in options, path, "--prefix" in options)))
