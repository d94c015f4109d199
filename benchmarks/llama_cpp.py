"""llama.cpp as a second anchor for the decode rows (``benchmarks/realsize.py``): the same random checkpoint converted
to an F32 or BF16 GGUF and decoded by ``llama-batched-bench`` at the same batches, prompt length, token count and
threads.

llama.cpp is not a dependency: ``python -m benchmarks.llama_cpp build`` downloads the ``llama-cpp-python``
``LLAMA_CPP_PYTHON`` source package (it vendors llama.cpp: ``llama-bench``, ``llama-batched-bench``,
``convert_hf_to_gguf.py`` and its ``gguf-py``), builds only the two benchmark tools with cmake for this CPU
(``GGML_NATIVE``) into ``build_root()`` (``$IGNITION_CACHE_DIR/llama.cpp/<version>``, outside the checkout), and
``python -m benchmarks.llama_cpp status`` says what is there. The converter runs from that source with its own
``gguf-py``, so nothing is installed. Where the tools are missing, ``tools`` raises ``LlamaCppMissing`` with the
command that builds them; a benchmark prints that and no number.

A random checkpoint has no tokenizer, and the converter needs one: ``write_tokenizer`` puts a small byte-level BPE
(``TOKENIZER_SIZE`` entries, trained on a fixed text) beside it; the converter pads the vocabulary to the config's
size with unused entries, and the pre-tokenizer is named ``qwen2`` (the converter identifies a pre-tokenizer by the
hash of a known tokenizer's output, which a fresh one has not got). ``llama-batched-bench`` decodes random token ids,
so the tokenizer only has to load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from ignition.runtime.backends.gemm_calibration import cache_path

LLAMA_CPP_PYTHON = "0.3.36"
"""The ``llama-cpp-python`` source package whose vendored llama.cpp is built (pinned: the converter and the tools
change their options between releases)."""
TOOLS = ("llama-bench", "llama-batched-bench")
BUILD_JOBS = 2
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
"""The GGUF weight type a core of each dtype is compared against: F32 against FP32, BF16 against BF16."""
TOKENIZER_SIZE = 320
"""The byte-level BPE's entries: the 256 bytes and 64 merges (llama.cpp refuses a BPE vocabulary without merges)."""
TOKENIZER_TEXT = ("The quick brown fox jumps over the lazy dog. Ignition exports a model once and serves it "
                  "with llama.cpp beside it as the anchor of its decode rows, the same checkpoint in both. ") * 8
PRE_TOKENIZER = "qwen2"
SEQUENCE_CELLS = 64
"""KV cells per sequence llama-batched-bench gets (its context is this times the largest batch): past the prompt and
the generated tokens of the decode rows, a multiple of llama.cpp's cell padding."""


class LlamaCppMissing(RuntimeError):
    """The llama.cpp tools or their source are not built here; the message says how to build them."""


def build_root(version: str = LLAMA_CPP_PYTHON) -> Path:
    """Where ``build`` puts the source and the tools: beside the GEMM calibration cache (``IGNITION_CACHE_DIR``, else
    ``~/.cache/ignition``), one directory a version."""
    return cache_path().parent / "llama.cpp" / version


def source_dir(root: Path | None = None) -> Path:
    """The vendored llama.cpp of the unpacked source package."""
    root = build_root() if root is None else root
    return root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


BUILD_COMMAND = "python -m benchmarks.llama_cpp build"


def tools(root: Path | None = None) -> dict[str, Path]:
    """Each of ``TOOLS`` and the converter, by name (``convert`` for the converter); ``LlamaCppMissing`` naming what
    is absent and the command that builds it."""
    root = build_root() if root is None else root
    found = {name: root / "build" / "bin" / name for name in TOOLS}
    found["convert"] = source_dir(root) / "convert_hf_to_gguf.py"
    missing = [str(path) for path in found.values() if not path.is_file()]
    if missing:
        raise LlamaCppMissing(f"llama.cpp {LLAMA_CPP_PYTHON} (llama-cpp-python's vendored copy) is not built here: "
                              f"missing {', '.join(missing)}. Build it (a few minutes of CPU) with "
                              f"`{BUILD_COMMAND}` from the repository root.")
    return found


def _run(command: list[str], log: Path, **kwargs) -> None:
    """Run ``command``, its output appended to ``log``; SystemExit naming the command and the log's tail on failure."""
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); {log}:\n{tail}")


def build(root: Path | None = None, jobs: int = BUILD_JOBS) -> dict[str, Path]:
    """Download the source package (pip, no dependencies, no wheel), unpack it and build ``TOOLS`` with cmake for
    this CPU, at low priority; each step skipped when its output is there. Returns ``tools``."""
    root = build_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    print(f"building llama.cpp {LLAMA_CPP_PYTHON} in {root} (output: {log})", file=sys.stderr)
    archive = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], log)
    if not (source_dir(root) / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run([*nice, "cmake", "-S", str(source_dir(root)), "-B", str(root / "build"), *generator,
          "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"], log)
    _run([*nice, "cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *TOOLS], log)
    return tools(root)


def write_tokenizer(checkpoint: Path, vocab_size: int) -> None:
    """A byte-level BPE of ``TOKENIZER_SIZE`` entries (``tokenizer.json`` and ``tokenizer_config.json``) beside
    ``checkpoint``'s weights, for a config of ``vocab_size`` ids (the converter pads it to that size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < TOKENIZER_SIZE:
        raise ValueError(f"a GGUF conversion needs a vocabulary of at least {TOKENIZER_SIZE} ids (the byte-level "
                         f"tokenizer's), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TOKENIZER_TEXT], trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


_CONVERT = """\
import sys
source, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
base.TextModel._set_vocab_sentencepiece = base.TextModel._set_vocab_gpt2
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""
"""The converter with the pre-tokenizer named (argv: source, pre-tokenizer, then the converter's own arguments), and
the byte-level BPE read as such: a recipe that tries a SentencePiece model first (Qwen's) takes the GPT-2 path at once
(there is no ``tokenizer.model``, and its probe would import ``sentencepiece``, which nothing else needs)."""


def convert(checkpoint: Path, dtype: str, out: Path, root: Path | None = None) -> Path:
    """``checkpoint`` (a transformers directory of a recipe llama.cpp knows, e.g. Qwen3) as a GGUF of ``dtype``'s
    type (``GGUF_TYPES``) at ``out``, a byte-level tokenizer written beside it first (``write_tokenizer``)."""
    if dtype not in GGUF_TYPES:
        raise ValueError(f"no GGUF type for dtype {dtype!r}; expected one of {', '.join(GGUF_TYPES)}")
    source = tools(root)["convert"].parent
    config = json.loads((checkpoint / "config.json").read_text())
    write_tokenizer(checkpoint, config.get("text_config", config)["vocab_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-c", _CONVERT, str(source), PRE_TOKENIZER, str(checkpoint), "--outtype", GGUF_TYPES[dtype],
          "--outfile", str(out)], out.with_suffix(".log"), env=os.environ | {"NO_LOCAL_GGUF": "1"})
    return out


def batched_bench_command(model: Path, batches: list[int], prompt: int, tokens: int, threads: int,
                          root: Path | None = None) -> list[str]:
    """``llama-batched-bench``: every batch in ``batches`` prefills ``prompt`` random tokens a sequence (not shared),
    then decodes ``tokens`` steps of one token a sequence; JSONL out."""
    context = SEQUENCE_CELLS * max(batches)
    if prompt + tokens > SEQUENCE_CELLS:
        raise ValueError(f"prompt {prompt} + tokens {tokens} exceed the {SEQUENCE_CELLS} cells a sequence gets")
    return [str(tools(root)["llama-batched-bench"]), "-m", str(model), "-c", str(context), "-b", "2048",
            "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens), "-npl", ",".join(map(str, batches)),
            "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]


def parse_batched_bench(output: str) -> dict[int, float]:
    """Each batch's decode rate (``speed_tg``: the batch's generated tokens over the decode steps' seconds) from
    ``llama-batched-bench``'s JSONL lines; ValueError when there are none."""
    rates = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            rates[int(record["pl"])] = float(record["speed_tg"])
    if not rates:
        raise ValueError(f"no JSONL result in llama-batched-bench's output:\n{output[-2000:]}")
    return rates


def decode_rates(model: Path, batches: list[int], prompt: int, tokens: int, threads: int, repeats: int,
                 root: Path | None = None) -> dict[int, list[float]]:
    """``repeats`` runs of ``llama-batched-bench`` on ``model``: each batch's decode rate, run by run (tokens/s)."""
    command = batched_bench_command(model, batches, prompt, tokens, threads, root)
    runs: dict[int, list[float]] = {size: [] for size in batches}
    for _ in range(repeats):
        for size, rate in _complete_run(command, batches).items():
            runs[size].append(rate)
    return runs


RUN_ATTEMPTS = 4
"""Runs of ``llama-batched-bench`` until one prints every batch's line. NOTE: its results go through llama.cpp's
asynchronous log thread, which the process does not drain at exit, so a run now and then prints some or none of its
lines (a tiny model's runs, which end milliseconds after their last line, lost them in one run of a few here)."""


def _complete_run(command: list[str], batches: list[int]) -> dict[int, float]:
    """One run's rates for every batch (``RUN_ATTEMPTS`` at most); SystemExit with the output when none has them."""
    for _ in range(RUN_ATTEMPTS):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        try:
            rates = parse_batched_bench(done.stdout)
        except ValueError:
            continue
        if set(batches) <= set(rates):
            return rates
    sys.exit(f"{' '.join(command)} printed no result for every batch in {RUN_ATTEMPTS} runs; the last:\n"
             f"{done.stdout[-1000:]}{done.stderr[-1000:]}")


def anchor_rows(dtype: str, runs: dict[int, list[float]],
                ours: dict[int, float]) -> tuple[list[tuple[str, str, str, str]], list[tuple[str, str, bool]]]:
    """The table rows (llama.cpp's median rate beside ours, logprobs off) and the targets (at least 1.0x llama.cpp in
    the same dtype, batches 1 and 8) of a run: ``runs`` from ``decode_rates``, ``ours``: batch -> our tok/s."""
    kind = GGUF_TYPES[dtype].upper()
    rows, found = [], []
    for size, rates in sorted(runs.items()):
        median = statistics.median(rates)
        spread = ", ".join(f"{rate:.1f}" for rate in rates)
        mine = ours.get(size)
        rows.append((f"decode batch {size}, logprobs off, against llama.cpp {kind} GGUF",
                     "" if mine is None else f"{mine:.2f} tok/s", f"llama.cpp {median:.2f} tok/s (runs: {spread})",
                     "" if mine is None else f"{mine / median:.2f}x llama.cpp"))
        if mine is not None and size in (1, 8):
            found.append((f"decode batch {size} at least 1.0x llama.cpp ({kind} GGUF, logprobs off)",
                          f"{mine / median:.2f}x", mine >= median))
    return rows, found


def anchor(checkpoint: Path, work: Path, dtype: str, batches: list[int], prompt: int, tokens: int, threads: int,
           repeats: int, ours: dict[int, float],
           root: Path | None = None) -> tuple[list[tuple[str, str, str, str]], list[tuple[str, str, bool]]]:
    """``realsize``'s llama.cpp rows and targets: ``checkpoint`` converted to ``dtype``'s GGUF under ``work`` and
    decoded ``repeats`` times at ``batches`` (``anchor_rows``). Where llama.cpp is not built: one row and one unmet
    target per batch saying so and how to build it, never a number."""
    try:
        tools(root)
    except LlamaCppMissing as exc:
        note = f"not measured: {exc}"
        return ([("llama.cpp anchor", "", note, "")],
                [(f"decode batch {size} at least 1.0x llama.cpp ({GGUF_TYPES[dtype].upper()} GGUF)", note, False)
                 for size in batches if size in (1, 8)])
    model = convert(checkpoint, dtype, work / f"model-{GGUF_TYPES[dtype]}.gguf", root)
    return anchor_rows(dtype, decode_rates(model, batches, prompt, tokens, threads, repeats, root), ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help=f"download llama-cpp-python {LLAMA_CPP_PYTHON}'s source and build {', '.join(TOOLS)}")
    sub.add_parser("status", help="say whether the tools are built, and where")
    args = parser.parse_args()
    if args.command == "build":
        found = build()
    else:
        try:
            found = tools()
        except LlamaCppMissing as exc:
            sys.exit(str(exc))
    for name, path in found.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
