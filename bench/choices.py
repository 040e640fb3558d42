"""Several choices per prompt (`n`): nrvna against llama-server's own `n`, and against 8 separate
jobs per prompt in nrvna itself, on the same model, machine and prompts.

P distinct prompts of about 200 tokens each (notes to summarize: the prefill is worth sharing),
N choices of T tokens each, end-of-generation ignored everywhere, the sampling of
vs_llama_server.py. Arms, in interleaved rounds, every one warm: nrvna's defaults with one job of
n = N per prompt; nrvna with N separate jobs per prompt (seeds s, s+1, ...), with its prefix cache
and without it (NRVNA_PREFIX_CACHE=0: every job computes its prompt); llama-server with n = N in
each request, -np 16 with 2 concurrent requests and -np 32 with 4 (its children need a slot
each, so -np / N requests run at once). The figure is completion tokens/s.

    python bench/choices.py [--model PATH] [--prompts 32] [--n 8] [--tokens 16] [--rounds 3] [--server PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time

from common import default_model, llama_server, machine, ratio_rows, ROOT, table
from inference import TOPICS
from vs_llama_server import SAMPLING, Daemon, concurrently, post, start_server

import nrvna

WORDS = ("river stone light harvest engine market winter silver garden letter bridge signal forest "
         "paper orbit candle harbor thunder copper lantern meadow archive compass glacier").split()


def documents(count: int) -> list[str]:
    """Distinct prompts of about 200 tokens: notes on a topic, then a request."""
    texts = []
    for i in range(count):
        rng = random.Random(i)
        notes = " ".join(rng.choice(WORDS) for _ in range(150))
        texts.append(f"Notes about {TOPICS[i % len(TOPICS)]} (set {i}): {notes}. Summarize these notes in one "
                     "sentence.")
    return texts


def nrvna_arm(daemon: Daemon, texts: list[str], n: int, tokens: int, separate: bool) -> tuple[float, int]:
    """Completion tokens/s of one arm on a warm daemon, and the prompt tokens it computed: one
    job of n choices per prompt, or n separate jobs per prompt (seeds 1..n), all submitted at once."""
    work, flow = daemon.work, daemon.flow
    start = time.time()
    ids = []
    for text in texts:
        if separate:
            ids += [work.publish(text, max_tokens=tokens, ignore_eos=True, seed=1 + i, **SAMPLING) for i in range(n)]
        else:
            ids.append(work.publish(text, max_tokens=tokens, ignore_eos=True, seed=1, n=n, **SAMPLING))
    for job_id in ids:
        assert flow.wait(job_id, 900) is nrvna.Status.Done
    end = max(os.stat(os.path.join(daemon.ws, nrvna.OUTPUT, job_id)).st_ctime for job_id in ids)
    metas = [flow.get(job_id).meta for job_id in ids]
    generated = sum(meta["generated_tokens"] for meta in metas)
    assert generated == len(texts) * n * tokens, generated
    return generated / (end - start), sum(meta["prompt_computed"] for meta in metas)


def server_arm(binary: str, model: str, texts: list[str], n: int, tokens: int, slots: int) -> float:
    proc, port = start_server(binary, model, slots)
    try:
        body = {"max_tokens": tokens, "ignore_eos": True, "n": n, **SAMPLING}
        post(port, {**body, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        generated, lock = [0], threading.Lock()

        def ask(text: str) -> None:
            reply = post(port, {**body, "messages": [{"role": "user", "content": text}]})
            # Its usage counts one choice's completion tokens, not all n (OpenAI counts all):
            # every choice ends at max_tokens here, so n x tokens were generated.
            assert len(reply["choices"]) == n and all(c["finish_reason"] == "length" for c in reply["choices"]), reply
            with lock:
                generated[0] += n * tokens

        elapsed = concurrently(texts, max(1, slots // n), ask)
        assert generated[0] == len(texts) * n * tokens, generated
        return generated[0] / elapsed
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    args = parser.parse_args()
    binary = llama_server(args.server)
    texts = documents(args.prompts)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    names = ["nrvna, n per job", "llama-server -np 16, n per request", "nrvna, separate jobs",
             "llama-server -np 32, n per request", "nrvna, separate jobs, NRVNA_PREFIX_CACHE=0"]
    runs: dict[str, list[float]] = {name: [] for name in names}
    computed: dict[str, int] = {}
    try:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # no arm always first
                if name.startswith("llama-server"):
                    slots = int(name.split()[2].rstrip(","))
                    runs[name].append(server_arm(binary, args.model, texts, args.n, args.tokens, slots))
                    continue
                daemon = Daemon(args.model, base, {"NRVNA_PREFIX_CACHE": "0"} if "CACHE=0" in name else {})
                try:
                    speed, computed[name] = nrvna_arm(daemon, texts, args.n, args.tokens, "separate" in name)
                    runs[name].append(speed)
                finally:
                    daemon.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = [max(runs[name][r] for name in names if name.startswith("llama-server")) for r in range(args.rounds)]
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {args.prompts} prompts of ~200 tokens x "
          f"n={args.n} x {args.tokens} tokens; {args.rounds} interleaved rounds")
    rows = [row + [computed.get(row[0], "")] for row in ratio_rows(names, runs, best)]
    print(table(["arm", "completion tok/s", "range", "vs best llama-server, round by round", "median ratio",
                 "prompt tokens computed (last round)"], rows))


if __name__ == "__main__":
    main()
