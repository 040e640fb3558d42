"""What a quantized KV cache (NRVNA_KV_TYPE q8_0, q4_0) costs in quality, against f16, on a real
GGUF (default: the SmolLM2-135M test model).

Greedy text: 48 fixed prompts (questions, instructions, short stories, and 4 of about 300 tokens,
so some jobs attend over more cells), temperature 0, 128 tokens at most, end-of-generation
honoured; each KV type's outputs against f16's: the share identical, and the mean common prefix
as a share of f16's output (characters). Two ways: one job at a time (NRVNA_SEQS=1
NRVNA_WORKERS=1: deterministic, so every difference is the KV type's), and with the daemon's
defaults (batched), where a second f16 daemon against the first gives the noise floor of batching
itself (jobs meet different batch-mates, sums add in another order, one token flips and the rest
follows). Structured: the 32 constrained jobs of bench/structured.py (its json_schema, its seeded
sampling) on each batched daemon, every output checked against the schema by hand; it must be
100% valid for every type. Every daemon is fresh (its own workspace) and warm.

    python bench/kv_quality.py [--model PATH] [--tokens 128] [--types f16,q8_0,q4_0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from common import default_model, machine, ROOT, table
from inference import prompts
from structured import CONSTRAINED_TOKENS, RESPONSE_FORMAT, jobs, valid
from vs_llama_server import SAMPLING, Daemon

import nrvna

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How do vaccines work?",
             "What is the difference between weather and climate?", "Who wrote Romeo and Juliet?",
             "What causes the seasons on Earth?", "How does a refrigerator keep food cold?",
             "What is photosynthesis?", "Why do cats purr?", "What is 17 times 23?",
             "How many legs does a spider have?", "What is a prime number?"]
INSTRUCTIONS = ["List three uses of a paperclip.", "Write a haiku about autumn leaves.",
                "Explain recursion to a ten-year-old.", "Give me a recipe for pancakes.",
                "Translate 'good morning, my friend' into Spanish.",
                "Summarize the plot of Cinderella in two sentences.",
                "Write a limerick about a forgetful robot.", "Give five tips for a job interview.",
                "Describe the color red to someone who cannot see.", "Write a polite email declining a meeting.",
                "Name four planets and one fact about each.", "Write a Python function that reverses a string."]
PASSAGE = ("The lighthouse on the northern cape was built in 1871 from granite quarried a few miles inland. "
           "For more than a century its keepers climbed one hundred and twelve steps each evening to light "
           "the lamp, wind the clockwork that turned the lens, and record the weather in a leather logbook. "
           "The logbooks survive: they note storms that lasted a week, ships that passed too close to the rocks, "
           "a winter when the sea froze along the shore, and the summer a keeper's daughter rowed out alone to "
           "rescue two fishermen whose boat had capsized. In 1962 the lamp was electrified, and in 1989 the last "
           "keeper left, when an automatic beacon replaced the great lens. The town bought the building for one "
           "dollar and turned the keeper's cottage into a small museum, where visitors can read the logbooks, "
           "climb the stairs on summer weekends, and look out over the same rocks the keepers watched. ")
LONG = [f"{PASSAGE}\n\n{ask}" for ask in ("Summarize this passage in three sentences.",
                                          "What happened in 1962 and in 1989, according to the passage?",
                                          "Write a short poem inspired by this passage.",
                                          "List every number mentioned in the passage and what it refers to.")]


def texts() -> list[str]:
    """48 fixed prompts: 12 questions, 12 instructions, 20 short stories, 4 of about 300 tokens."""
    return QUESTIONS + INSTRUCTIONS + prompts(20) + LONG


def greedy(daemon: Daemon, work: list[str], tokens: int) -> list[dict]:
    """Every prompt at temperature 0, all submitted at once; results in the prompts' order."""
    ids = [daemon.work.publish(text, temperature=0, max_tokens=tokens) for text in work]
    out = []
    for job_id in ids:
        assert daemon.flow.wait(job_id, 900) is nrvna.Status.Done, job_id
        got = daemon.flow.get(job_id)
        out.append({"text": got.result, "tokens": got.meta["generated_tokens"]})
    return out


def structured(daemon: Daemon) -> float:
    """The 32 constrained jobs of structured.py, all at once: the share whose output is valid."""
    constrained = [job for job in jobs() if job["constrained"]]
    ids = [daemon.work.publish(job["prompt"], **dict(SAMPLING, seed=job["seed"], max_tokens=CONSTRAINED_TOKENS,
                                                     response_format=RESPONSE_FORMAT)) for job in constrained]
    results = []
    for job_id in ids:
        assert daemon.flow.wait(job_id, 900) is nrvna.Status.Done, job_id
        results.append(valid(daemon.flow.get(job_id).result))
    return sum(results) / len(results)


def compare(ref: list[dict], other: list[dict]) -> tuple[float, float]:
    """(share identical, mean common prefix as a share of the reference's output, characters)."""
    same, shares = 0, []
    for a, b in zip(ref, other):
        x, y = a["text"], b["text"]
        same += x == y
        common = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(1.0 if x == y else common / max(1, len(x)))
    return same / len(ref), statistics.mean(shares)


def run_arm(model: str, base: str, env: dict[str, str], work: list[str], tokens: int,
            with_structured: bool) -> dict:
    """A fresh warm daemon with ``env``: its greedy outputs (and structured validity), or its error."""
    start = time.perf_counter()
    try:
        daemon = Daemon(model, base, env)
    except RuntimeError as error:
        return {"error": str(error)}
    try:
        out = {"greedy": greedy(daemon, work, tokens)}
        if with_structured:
            out["valid"] = structured(daemon)
    except AssertionError as error:
        out = {"error": f"a job did not end done: {error}"}
    finally:
        daemon.close()
    out["seconds"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of a greedy job")
    parser.add_argument("--types", default=",".join(nrvna.KV_TYPES), help="KV types, comma-separated (f16 first)")
    args = parser.parse_args()
    types = args.types.split(",")
    assert types[0] == "f16", "f16 is the reference: list it first"
    work = texts()
    one = {"NRVNA_SEQS": "1", "NRVNA_WORKERS": "1"}
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    began = time.perf_counter()
    serial: dict[str, dict] = {}
    batched: dict[str, dict] = {}
    try:
        for kv in types:
            serial[kv] = run_arm(args.model, base, {**one, "NRVNA_KV_TYPE": kv}, work, args.tokens, False)
        # The reference, its repeat (batching's noise floor), then the quantized types, batched.
        for name, kv in [("f16", "f16"), ("f16 again", "f16"), *((kv, kv) for kv in types[1:])]:
            batched[name] = run_arm(args.model, base, {"NRVNA_KV_TYPE": kv}, work, args.tokens, True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.perf_counter() - began

    def against_f16(runs: dict[str, dict], name: str) -> tuple[str, str]:
        ref, arm = runs.get("f16", {}), runs.get(name, {})
        if "greedy" not in ref or "greedy" not in arm:
            return "failed", "failed"
        same, prefix = compare(ref["greedy"], arm["greedy"])
        return f"{100 * same:.0f}% ({round(same * len(work))}/{len(work)})", f"{100 * prefix:.1f}%"

    rows = []
    for name in ["f16", "f16 again", *types[1:]]:
        one_same, one_prefix = ("reference", "reference") if name == "f16" else (
            ("-", "-") if name == "f16 again" else against_f16(serial, name))
        batch_same, batch_prefix = ("reference", "reference") if name == "f16" else against_f16(batched, name)
        arm = batched.get(name, {})
        label = {"f16": "f16", "f16 again": "f16, second daemon (batching's noise floor)"}.get(name, name)
        tokens = serial.get(name if name != "f16 again" else "", {}).get("greedy")
        rows.append([label, one_same, one_prefix, batch_same, batch_prefix,
                     f"{100 * arm['valid']:.0f}%" if "valid" in arm else "failed",
                     f"{statistics.mean(r['tokens'] for r in tokens):.0f}" if tokens else "-"])
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {len(work)} greedy prompts "
          f"(4 of ~300 tokens), up to {args.tokens} tokens, end-of-generation honoured; "
          f"32 json_schema jobs of bench/structured.py")
    print("one at a time: NRVNA_SEQS=1 NRVNA_WORKERS=1 (deterministic); batched: the daemon's defaults; "
          "common prefix: characters, as a share of f16's output, mean over the prompts")
    print(table(["KV type", "identical to f16, one at a time", "common prefix, one at a time",
                 "identical to f16, batched", "common prefix, batched", "structured valid (batched)",
                 "mean tokens, one at a time"], rows))
    bad = [name for name, arm in batched.items() if arm.get("valid", 0) < 1]
    if bad:
        print(f"\nNOT 100% valid structured output: {', '.join(bad)}")
    for kind, runs in (("one at a time", serial), ("batched", batched)):
        for name, arm in runs.items():
            if "error" in arm:
                print(f"{kind}, {name}: {arm['error']}")
    for kind, runs in (("one at a time (start, greedy)", serial), ("batched (start, greedy, structured)", batched)):
        print(f"{'' if kind.startswith('batched') else chr(10)}seconds per daemon, {kind}: "
              + ", ".join(f"{name} {arm['seconds']:.0f}" for name, arm in runs.items() if "seconds" in arm))
    print(f"total {elapsed:.0f} s")


if __name__ == "__main__":
    main()
