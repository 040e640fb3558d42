"""Inference throughput on a real GGUF (default: the SmolLM2-135M test model): P prompts x T
generated tokens each (end-of-generation ignored, so every job generates exactly T in every
arm). nrvna end to end (submit all, wait for all) with 2 and 4 workers against the same
prompts run one after another through `llama_cpp.Llama` in this process. Every arm is warm
(model loaded, one job done first).

    python bench/inference.py [--model PATH] [--prompts 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from common import default_model, machine, PYTHON, ROOT, table

import nrvna

TOPICS = ["rivers", "mountains", "the moon", "bread", "bicycles", "owls", "libraries", "glass", "rain",
          "chess", "volcanoes", "bees", "trains", "salt", "maps", "clocks", "whales", "copper", "tea", "ice"]


def prompts(count: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(count)]


def sequential_llama(model: str, texts: list[str], tokens: int) -> float:
    """The baseline: llama_cpp.Llama, one prompt after another, same sampling, same chat template."""
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=2048, n_threads=nrvna.cpu_count(), n_threads_batch=nrvna.cpu_count(),
                n_gpu_layers=int(os.environ.get("NRVNA_GPU_LAYERS", "0")), verbose=False, seed=1)
    sampling = dict(max_tokens=tokens, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1)
    llm.create_chat_completion([{"role": "user", "content": "warm up"}], max_tokens=8)
    start = time.perf_counter()
    generated = 0
    for text in texts:
        out = llm.create_chat_completion([{"role": "user", "content": text}],
                                         logit_bias={llm.token_eos(): -1e9}, **sampling)
        generated += out["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - start
    assert generated == tokens * len(texts), generated
    return generated / elapsed


def nrvna_end_to_end(model: str, texts: list[str], tokens: int, workers: int, seqs: int, base: str) -> float:
    ws = os.path.join(base, f"ws-{workers}-{seqs}")
    env = {**os.environ, "NRVNA_LOG_LEVEL": "warn", "NRVNA_SEQS": str(seqs), "NRVNA_MAX_CTX": "2048"}
    proc = subprocess.Popen([PYTHON, os.path.join(ROOT, "nrvna.py"), "daemon", model, ws, "-w", str(workers)], env=env)
    try:
        work, flow = nrvna.Work(ws), nrvna.Flow(ws)
        warm = work.publish("warm up", max_tokens=8)
        assert flow.wait(warm, 120) is nrvna.Status.Done
        start = time.perf_counter()
        ids = [work.publish(text, max_tokens=tokens, ignore_eos=True) for text in texts]
        for job_id in ids:
            assert flow.wait(job_id, 600) is nrvna.Status.Done
        elapsed = time.perf_counter() - start
        generated = sum(flow.get(job_id).meta["generated_tokens"] for job_id in ids)
        assert generated == tokens * len(texts), generated
        return generated / elapsed
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--arms", default="2x1,4x1", help="nrvna arms as WORKERSxSEQS, comma-separated")
    args = parser.parse_args()
    texts = prompts(args.prompts)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        baseline = sequential_llama(args.model, texts, args.tokens)
        rows = [["sequential llama_cpp.Llama (baseline)", baseline, 1.0]]
        for arm in args.arms.split(","):
            workers, seqs = map(int, arm.split("x"))
            rate = nrvna_end_to_end(args.model, texts, args.tokens, workers, seqs, base)
            rows.append([f"nrvna, {workers} workers x {seqs} seq, end to end", rate, rate / baseline])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; "
          f"{args.prompts} prompts x {args.tokens} generated tokens")
    print(table(["arm", "generated tok/s", "vs baseline"], rows))


if __name__ == "__main__":
    main()
