"""Equal outputs: one nrvna.py against another, token for token, on jobs that cover every parameter.

A refactor of the engine must not change what a job produces. ``run`` queues a fixed set of
jobs (free sampling, greedy, the sampler chain's settings, penalties, logit bias, stop strings,
n choices, logprobs, priority, a system prompt and a shared prefix, a raw prompt, a GBNF
grammar, a JSON schema, json_object, seeds) in a fresh workspace, then starts a daemon of the
given nrvna.py on the SmolLM2 test model (one worker, so no thread is borrowed and the batches
are the same every run) at each ``--seqs``, waits for every job and writes each one's result,
choices, logprobs and counts to a JSON file; with ``--embed-model``, embed jobs through a
daemon of that model too. ``compare`` says whether two such files are equal, and where the
first difference of each job is (its token, for logprobs).

The jobs are queued before the daemon starts: it claims them in the same order and batches
them the same way each run (at NRVNA_SEQS=16 a job's text depends on its batch-mates: see
"Reproducibility across batch sizes" in bench/README.md).

    python bench/equal_outputs.py run NRVNA_PY OUT.json [--model PATH] [--seqs 1,16] [--embed-model PATH]
    python bench/equal_outputs.py compare A.json B.json
    # e.g. main against this checkout:
    git show main:nrvna.py > /tmp/main/nrvna.py
    python bench/equal_outputs.py run /tmp/main/nrvna.py /tmp/main.json
    python bench/equal_outputs.py run nrvna.py /tmp/this.json
    python bench/equal_outputs.py compare /tmp/main.json /tmp/this.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import PYTHON, ROOT, default_model

import nrvna

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
GRAMMAR = 'root ::= ("yes" | "no") ", because " [a-z ]{4,40} "."'
SYSTEM = ("You are a careful assistant for a hardware shop. You answer in plain English, briefly, and you never "
          "invent prices. When you do not know, you say so.")
STORY = "Write a short story about a lighthouse keeper."

# (name, prompt, params): each parameter at least once, most with a seed of their own.
JOBS: list[tuple[str, str, dict[str, Any]]] = [
    ("free", STORY, {"seed": 1}),
    ("greedy", "List three colours.", {"temperature": 0.0}),
    ("chain", STORY, {"seed": 2, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "temperature": 1.1}),
    ("no_top_k", STORY, {"seed": 3, "top_k": 0, "top_p": 0.95}),
    ("penalties", "Say cat cat cat cat cat.", {"seed": 4, "repeat_penalty": 1.3, "frequency_penalty": 0.5,
                                              "presence_penalty": 0.4}),
    ("logit_bias", STORY, {"seed": 5, "logit_bias": {"260": -100, "314": 4.5}}),
    ("stop", "Count from one to twenty in words.", {"seed": 6, "stop": [",", " seven"]}),
    ("stop_logprobs", "Count from one to twenty in words.", {"seed": 7, "stop": ["five"], "logprobs": True,
                                                            "top_logprobs": 2}),
    ("logprobs", "Name a fruit.", {"seed": 8, "logprobs": True, "top_logprobs": 4}),
    ("n", "Give me a name for a dog.", {"seed": 9, "n": 3}),
    ("n_logprobs", "Give me a name for a cat.", {"seed": 10, "n": 2, "logprobs": True, "top_logprobs": 1}),
    ("grammar", "Is the sea salty?", {"seed": 11, "grammar": GRAMMAR}),
    ("json_schema", "Describe a person as JSON.", {"seed": 12, "response_format": RESPONSE_FORMAT}),
    ("json_schema_n", "Describe a person as JSON.", {"seed": 13, "response_format": RESPONSE_FORMAT, "n": 2}),
    ("json_object", "Describe a car as a JSON object.", {"seed": 14, "response_format": {"type": "json_object"}}),
    ("priority_high", STORY, {"seed": 15, "priority": 5}),
    ("priority_low", STORY, {"seed": 16, "priority": -5}),
    ("system_a", "Do you sell hammers?", {"seed": 17, "system": SYSTEM}),
    ("system_b", "Do you sell ladders?", {"seed": 18, "system": SYSTEM}),
    ("raw", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", {"seed": 19, "raw": True}),
    ("length", STORY, {"seed": 20, "ignore_eos": True, "max_tokens": 40}),
]
MAX_TOKENS = 24
EMBED_JOBS = [("embed", ["a lighthouse by the sea", "a hammer"], {}), ("embed_dims", "a cat", {"dimensions": 8})]


def queue(ws: str, jobs: list[tuple[str, Any, dict[str, Any]]], **common: Any) -> dict[str, str]:
    """Queue ``jobs`` in ``ws`` (before any daemon runs): name -> job ID."""
    work = nrvna.Work(ws)
    return {name: work.publish(prompt, **{**common, **params}) for name, prompt, params in jobs}


def collect(ws: str, ids: dict[str, str], timeout: float) -> dict[str, Any]:
    """Wait for every job; each one's outputs, all that a job produces but its times."""
    flow = nrvna.Flow(ws)
    out = {}
    for name, job_id in ids.items():
        status = flow.wait(job_id, timeout)
        if status not in (nrvna.Status.Done, nrvna.Status.Failed):
            raise RuntimeError(f"job {name} ({job_id}) is {status} after {timeout} s")
        job = flow.get(job_id)
        meta = job.meta or {}
        out[name] = {"status": str(job.status), "result": job.result, "error": job.error,
                     "choices": job.choices, "logprobs": job.logprobs,
                     **{k: meta.get(k) for k in ("finish_reason", "code", "prompt_tokens", "generated_tokens",
                                                 "prompt_computed")}}
    return out


def run_daemon(nrvna_py: str, model: str, env: dict[str, str], jobs: list[tuple[str, Any, dict[str, Any]]],
               common: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``jobs`` through a daemon of ``nrvna_py`` on ``model`` in a fresh workspace."""
    base = tempfile.mkdtemp(prefix="nrvna-bench-equal-", dir=os.environ.get("BENCH_DIR", ROOT))
    ws = os.path.join(base, "ws")
    try:
        ids = queue(ws, jobs, **common)
        proc = subprocess.Popen([PYTHON, nrvna_py, "daemon", model, ws],
                                env={**os.environ, "NRVNA_LOG_LEVEL": "warn", "NRVNA_WORKERS": "1", **env})
        try:
            return collect(ws, ids, timeout)
        finally:
            proc.terminate()
            proc.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    nrvna_py = os.path.abspath(args.nrvna_py)
    results: dict[str, Any] = {"nrvna_py": nrvna_py, "model": args.model, "runs": {}}
    for seqs in args.seqs.split(","):
        start = time.monotonic()
        results["runs"][f"seqs={seqs}"] = run_daemon(nrvna_py, args.model, {"NRVNA_SEQS": seqs}, JOBS,
                                                     {"max_tokens": MAX_TOKENS}, args.timeout)
        print(f"seqs={seqs}: {len(JOBS)} jobs in {time.monotonic() - start:.1f} s", flush=True)
    if args.embed_model:
        results["runs"]["embed"] = run_daemon(nrvna_py, args.embed_model, {}, [(n, p, {**q, "embed": True})
                                                                               for n, p, q in EMBED_JOBS],
                                              {}, args.timeout)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1, sort_keys=True)
    print(f"wrote {args.out}")
    return 0


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where ``a`` and ``b`` first differ ("" if they are equal): a path of keys and indices."""
    if type(a) is not type(b):
        return f"{where}: {a!r:.80} != {b!r:.80}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}: only in {'the second' if key not in a else 'the first'}"
            found = first_difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return ""
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return "" if len(a) == len(b) else f"{where}: {len(a)} items != {len(b)}"
    return "" if a == b else f"{where}: {a!r:.80} != {b!r:.80}"


def compare(args: argparse.Namespace) -> int:
    with open(args.a) as handle:
        a = json.load(handle)["runs"]
    with open(args.b) as handle:
        b = json.load(handle)["runs"]
    differ = 0
    for run_name in sorted(set(a) | set(b)):
        if run_name not in a or run_name not in b:
            print(f"{run_name}: in one file only")
            differ += 1
            continue
        for job in sorted(set(a[run_name]) | set(b[run_name])):
            found = first_difference(a[run_name].get(job), b[run_name].get(job), job)
            if found:
                print(f"{run_name} {found}")
                differ += 1
        print(f"{run_name}: {len(a[run_name])} jobs compared")
    print("equal" if not differ else f"{differ} jobs differ")
    return 0 if not differ else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the jobs through a daemon of NRVNA_PY; write OUT")
    p.add_argument("nrvna_py")
    p.add_argument("out")
    p.add_argument("--model", default=None, help="a chat GGUF (default: the SmolLM2 test model)")
    p.add_argument("--seqs", default="1,16", help="NRVNA_SEQS values, one daemon each (default 1,16)")
    p.add_argument("--embed-model", default=None, help="an embedding GGUF: embed jobs too")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for a job")
    c = sub.add_parser("compare", help="compare two files that run wrote")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args()
    if args.command == "compare":
        return compare(args)
    args.model = args.model or default_model()
    if not os.path.exists(args.nrvna_py):
        print(f"{args.nrvna_py}: no such file", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
