"""lm-eval's ``local-completions`` against ``ignition serve --api-key``, the key only in OPENAI_API_KEY.

Exports the tiny Qwen3 example with --prompt-logprobs, serves it with --api-key, writes two local tasks
over jsonl files (multiple_choice: loglikelihood requests; generate_until), and runs lm_eval from another
Python (its own venv) with no ``tokenizer=`` or ``auth_token=``: lm-eval detects the remote tokenizer through
/tokenizer_info and /tokenize, which stay open as in vLLM, and sends the key only on /v1/completions.
Checks that every run exits 0 with both tasks' metrics; batch_size 4 and num_concurrent 2 give the same
per-sample responses as batch size 1; loglikelihoods and greedy generations match transformers on the
checkpoint; a wrong key fails with a 401. Exits 2 when lm_eval is not importable from --lm-eval-python.

    python3 -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install 'lm_eval[api]==0.4.13'
    PYTHONPATH=. .venv/bin/python -m benchmarks.lm_eval_check --lm-eval-python /work/lmeval-venv/bin/python
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from benchmarks._common import ROOT, example_checkpoint, export

KEY, MODEL = "secret-key", "tiny-qwen3"
ROWS = [("The quick brown fox jumps over the lazy", ["dog", "cat", "world", "model"]),
        ("Hello", ["world", "fox", "graph", "core"]),
        ("Ignition exports a language model into a", ["core", "dog", "fox", "tiny"]),
        ("The runtime replays prefill and decode", ["graphs", "dogs", "words", "things"]),
        ("A tiny model says tiny", ["things", "graphs", "foxes", "cores"]),
        ("0123456", ["789", "abc", "dog", "fox"]),
        ("It says them", ["deterministically", "quickly", "lazily", "brownly"]),
        ("reads completion records and", ["logprobs", "dogs", "foxes", "worlds"]),
        ("graphs, weights and a", ["contract", "fox", "dog", "world"]),
        ("The lazy", ["dog", "fox", "model", "core"]),
        ("jumps over the", ["lazy dog", "brown fox", "tiny model", "core"])]
# "Text: " keeps lm-eval from literal_eval-ing a prompt such as "0123456"
TASKS = {"ignition_mc": "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: 0\n"
                        "metric_list: [{metric: acc}, {metric: acc_norm}]\n",
         "ignition_gen": "output_type: generate_until\ndoc_to_target: ' {{choices[0]}}'\n"
                         "generation_kwargs: {until: ['\\n', '.'], max_gen_toks: 16}\n"
                         "metric_list: [{metric: exact_match}]\n"}


def lm_eval_version(python: str) -> str:
    probe = "import aiohttp, requests, tenacity; from importlib.metadata import version; print(version('lm_eval'))"
    try:
        done = subprocess.run([python, "-c", "import lm_eval; " + probe], capture_output=True, text=True)
    except OSError as exc:
        done = subprocess.CompletedProcess([], 1, "", str(exc))
    if done.returncode != 0:
        print(f"lm_eval (with its [api] extras) is not importable from {python}:\n{done.stderr.strip()[-600:]}\n"
              "install it in a separate venv: python3 -m venv /work/lmeval-venv && "
              "/work/lmeval-venv/bin/pip install 'lm_eval[api]==0.4.13'", file=sys.stderr)
        sys.exit(2)
    return done.stdout.strip()


def write_tasks(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c}) + "\n" for q, c in ROWS))
    for name, body in TASKS.items():
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {json.dumps(str(data))}}}\n"
            f"test_split: train\ndoc_to_text: 'Text: {{{{question}}}}'\n{body}metadata: {{version: 1.0}}\n")
    return directory


def start_server(core: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("IGNITION_API_KEY", "VLLM_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    server = subprocess.Popen([sys.executable, "-m", "ignition.cli", "serve", str(core), "--port", str(port),
                               "--api-key", KEY, "--served-model-name", MODEL],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    sys.exit(f"server did not become healthy; see {log}:\n{log.read_text()[-2000:]}")


def run_lm_eval(python: str, url: str, tasks: Path, out: Path, key: str, limit: int, batch_size: int = 1,
                concurrent: int = 1) -> tuple[int, str, float]:
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    model_args = (f"model={MODEL},base_url={url}/v1/completions,num_concurrent={concurrent},"
                  "max_retries=1,tokenized_requests=True")
    command = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--limit", str(limit),
               "--batch_size", str(batch_size), "--output_path", str(out), "--log_samples"]
    print(f"$ OPENAI_API_KEY={key}", " ".join(command))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    output = done.stdout + done.stderr
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_eval.log").write_text(output)
    return done.returncode, output, time.perf_counter() - started


def samples(out: Path, task: str) -> list[dict]:
    found = sorted(glob.glob(str(out / MODEL / f"samples_{task}_*.jsonl")))
    return [json.loads(line) for line in Path(found[-1]).read_text().splitlines()] if found else []


def reference_failures(checkpoint: Path, out: Path) -> list[str]:
    """lm-eval's loglikelihoods and generations from the server against transformers on the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    failures, worst = [], 0.0
    for sample in samples(out, "ignition_mc"):
        for i, ((logprob, _),) in enumerate(sample["resps"]):
            args = sample["arguments"][f"gen_args_{i}"]
            context, whole = tok(args["arg_0"]).input_ids, tok(args["arg_0"] + args["arg_1"]).input_ids
            with torch.no_grad():
                logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            want = sum(logprobs[j - 1, whole[j]].item() for j in range(len(context), len(whole)))
            worst = max(worst, abs(want - float(logprob)))
    print(f"loglikelihood vs transformers: max |diff| {worst:.2e}")
    if worst > 1e-3:
        failures.append(f"loglikelihoods differ from transformers by up to {worst:.2e}")
    for sample in samples(out, "ignition_gen"):
        args = sample["arguments"]["gen_args_0"]
        ids = tok(args["arg_0"], return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=args["arg_1"]["max_gen_toks"], do_sample=False,
                                       pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        want = tok.decode(generated)
        for stop in args["arg_1"]["until"] + [tok.eos_token]:
            want = want.split(stop)[0]
        if (got := sample["resps"][0][0]) != want:
            failures.append(f"generation for {args['arg_0']!r}: server {got!r}, transformers {want!r}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval-python", required=True, help="a Python that can import lm_eval[api]")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "build" / "lm-eval-check")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--reuse-core", action="store_true", help="keep WORK_DIR/core when it exists")
    args = parser.parse_args()
    version = lm_eval_version(args.lm_eval_python)
    print(f"lm_eval {version} from {args.lm_eval_python}")
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    checkpoint, core = work / "tiny-qwen3", work / "core"
    if not (args.reuse_core and (core / "manifest.json").exists()):
        example_checkpoint(work)
        export(checkpoint, core, prompt_logprobs=True, capacities=(1, 4))
    tasks = write_tasks(work / "tasks")
    print(f"core ready in {time.perf_counter() - started:.1f} s")

    failures = []
    server, url = start_server(core, work / "server.log")
    try:
        print(f"serving {core} as {MODEL} on {url} with --api-key {KEY}")
        runs = {"bs1": (1, 1), "bs4": (4, 1), "bs4-c2": (4, 2)}
        for name, (batch_size, concurrent) in runs.items():
            rc, output, seconds = run_lm_eval(args.lm_eval_python, url, tasks, work / "out" / name, KEY, args.limit,
                                              batch_size, concurrent)
            print("\n".join(line for line in output.splitlines() if line.startswith(("|", "local-completions"))))
            print(f"{name}: exit {rc} in {seconds:.1f} s\n")
            if rc != 0 or not all(samples(work / "out" / name, task) for task in TASKS):
                failures.append(f"{name}: exit {rc}, see {work / 'out' / name / 'lm_eval.log'}")
            elif name != "bs1":
                for task in TASKS:
                    if [s["resps"] for s in samples(work / "out" / name, task)] != \
                            [s["resps"] for s in samples(work / "out" / "bs1", task)]:
                        failures.append(f"{name}: {task} responses differ from batch size 1")
        rc, output, seconds = run_lm_eval(args.lm_eval_python, url, tasks, work / "out" / "wrong-key", "wrong-key", 2)
        refused = rc != 0 and "401 Client Error: Unauthorized" in output
        print(f"wrong key: exit {rc} in {seconds:.1f} s, {'401 seen' if refused else 'NO 401'}\n")
        if not refused:
            failures.append("a wrong key was not refused with a 401")
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    statuses = Counter(" ".join(line.split('"')[1].split()[:2]) + " -> " + line.split('"')[2].split()[0]
                       for line in (work / "server.log").read_text().splitlines() if '" ' in line and "HTTP/" in line)
    print("server responses:", ", ".join(f"{request} x{n}" for request, n in sorted(statuses.items())))
    failures += reference_failures(checkpoint, work / "out" / "bs1")
    print(f"total {time.perf_counter() - started:.1f} s")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("OK: local-completions works against ignition serve --api-key with only OPENAI_API_KEY set")


if __name__ == "__main__":
    main()
