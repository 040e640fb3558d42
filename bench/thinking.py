"""Thinking models: what the budget machinery costs per token, and whether any answer is empty.

A copy of the model whose chat template opens a <think> block (scripts/thinking_model.py, the
tests' thinking SmolLM2). P prompts; in the thinking arm half carry thinking_budget_tokens 32 and
half 128, all submitted at once (the issue's batch of 64). Every arm generates exactly T tokens a
job: end of generation is banned by logit_bias in every arm alike (so the budget, not the model,
ends the thinking) and ignore_eos holds the answers to T. Arms, in interleaved rounds, each on a
fresh warm daemon: the thinking arm; the same jobs on the same copy with thinking off
(thinking_budget_tokens 0: the template closes the block in the prompt); the same prompts on the
model itself, which does not think (no router, no budget: the baseline). The figure is completion
tokens/s, and its ratio to the baseline's in the same round; a thinking job's answer must not be
empty, and its reasoning tokens must be its budget plus the close the daemon writes.

    python bench/thinking.py [--model PATH] [--prompts 64] [--tokens 192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, default_model, machine, ratio_rows, table
from inference import TOPICS
from vs_llama_server import SAMPLING, Daemon

import nrvna

BUDGETS = (32, 128)
BAN_EOG = {"0": -100.0, "2": -100.0, "4": -100.0}  # SmolLM2's end-of-generation tokens


def prompts(count: int) -> list[str]:
    return [f"Question {i}: what is worth knowing about {TOPICS[i % len(TOPICS)]}? Think, then answer."
            for i in range(count)]


def arm(daemon: Daemon, texts: list[str], tokens: int, budgets: tuple[int, ...]) -> tuple[float, int, list[int]]:
    """Completion tokens/s of one arm, its empty answers, and each job's reasoning tokens less its
    budget (budgets: one per job in turn; () for no budget parameter)."""
    params = [dict(SAMPLING, logit_bias=BAN_EOG,
                   **({"thinking_budget_tokens": budgets[i % len(budgets)]} if budgets else {}))
              for i in range(len(texts))]
    start = time.time()
    ids = [daemon.work.publish(text, max_tokens=tokens, ignore_eos=True, **p) for text, p in zip(texts, params)]
    for job_id in ids:
        assert daemon.flow.wait(job_id, 900) is nrvna.Status.Done
    end = max(os.stat(os.path.join(daemon.ws, nrvna.OUTPUT, job_id)).st_ctime for job_id in ids)
    jobs = [daemon.flow.get(job_id) for job_id in ids]
    generated = sum(job.meta["generated_tokens"] for job in jobs)
    assert generated == tokens * len(texts), generated
    empty = sum(not job.result.strip() for job in jobs)
    over = [job.meta.get("reasoning_tokens", 0) - p.get("thinking_budget_tokens", 0) for job, p in zip(jobs, params)]
    return generated / (end - start), empty, over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    copy = os.path.join(base, "thinking.gguf")
    subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "thinking_model.py"), args.model, copy], check=True,
                   stdout=subprocess.DEVNULL)
    texts = prompts(args.prompts)
    names = ["model itself (no thinking)", f"thinking, budgets {BUDGETS[0]} and {BUDGETS[1]}",
             "thinking off (budget 0)"]
    runs: dict[str, list[float]] = {name: [] for name in names}
    empties = dict.fromkeys(names, 0)
    overs: list[int] = []
    try:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # no arm always first
                daemon = Daemon(args.model if name.startswith("model") else copy, base, {})
                try:
                    budgets = BUDGETS if name.startswith("thinking,") else (0,) if "off" in name else ()
                    speed, empty, over = arm(daemon, texts, args.tokens, budgets)
                finally:
                    daemon.close()
                runs[name].append(speed)
                empties[name] += empty
                if name.startswith("thinking,"):
                    overs += over
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {machine()}; model {os.path.basename(args.model)} and its thinking copy; {args.prompts} jobs x "
          f"{args.tokens} tokens (end of generation banned); {args.rounds} interleaved rounds")
    rows = [row + [empties[row[0]]] for row in ratio_rows(names, runs, runs[names[0]])]
    print(table(["arm", "completion tok/s", "range", "vs the model itself, round by round", "median ratio",
                 "empty answers (all rounds)"], rows))
    print(f"thinking jobs' reasoning tokens less their budget: min {min(overs)}, max {max(overs)} "
          "(the close the daemon writes, </think> and a blank line, is 4 tokens on SmolLM2)")


if __name__ == "__main__":
    main()
