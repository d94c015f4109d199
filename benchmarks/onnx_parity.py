"""The issue-14 acceptance check as a script: ``ignition run`` on both runtimes, compared.

``python -m benchmarks.onnx_parity CORE`` runs ``ignition run CORE PROMPT --logprobs 20
--prompt-logprobs 5 --json`` with ``--runtime torch`` and ``--runtime onnxruntime`` (the core must
have been exported with ``--onnx --prompt-logprobs``), asserts the same tokens, logprob ids and
order, prompt ids, ranks and alternative ids, and prints the largest value differences: absolute,
and relative to ``max(1, |v|)`` (the tolerance the tests use, docs/api.md "ONNX graphs").
"""

from __future__ import annotations

import argparse

from benchmarks._common import compared_values, run_json


def run(core: str, prompt: str, tokens: int, runtime: str) -> dict:
    return run_json(core, [prompt, "--max-tokens", str(tokens), "--logprobs", "20", "--prompt-logprobs", "5",
                           "--runtime", runtime])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("core")
    parser.add_argument("--prompt", default="Hello world")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    want, got = (run(args.core, args.prompt, args.tokens, runtime) for runtime in ("torch", "onnxruntime"))
    compared = compared_values(want, got)
    for name, found in compared.items():
        print(f"{name}: {len(found)} values, same ids and order; max |d| {max(abs(a - b) for a, b in found):.3g}, "
              f"max |d|/max(1,|v|) {max(abs(a - b) / max(1.0, abs(a)) for a, b in found):.3g}")


if __name__ == "__main__":
    main()
