"""Priority lanes under load: a priority-10 job of 32 tokens submitted to a daemon whose 2
workers are saturated by a backlog of long jobs (256 tokens each), against the same job on
the same daemon idle; and the backlog's throughput with and without priority jobs.

Baselines in the same run: the idle daemon's latency for the same job (median of ``--rounds``
jobs, submitted one at a time), and the backlog's own throughput in windows without priority
jobs, interleaved with windows that have them (A B A). Throughput is the growth of the
backlog's generated text (partial.txt of running jobs plus result.txt of finished ones), in
bytes per second.

    python bench/priority.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--backlog 1000]
        [--rounds 10] [--window 60] [--spacing 12]

Targets (issue #21): loaded latency within 1.5x the idle one (median of 10); the backlog's
throughput drops by less than 10%. A priority job pauses the backlog while it runs, so the
drop is about the share of time priority jobs run: one every ``--spacing`` seconds here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, machine, table

import nrvna

PROMPT = "Write the next sentence of a story about a lighthouse keeper."
PRIORITY_JOB = {"priority": 10, "max_tokens": 32, "ignore_eos": True, "seed": 1}
BACKLOG_JOB = {"max_tokens": 256, "ignore_eos": True}


def start_daemon(model: str, ws: str) -> subprocess.Popen:
    env = {**os.environ, "NRVNA_LOG_LEVEL": "warn"}
    return subprocess.Popen([PYTHON, os.path.join(ROOT, "nrvna.py"), "daemon", model, ws], env=env)


def latency(ws: str) -> float:
    """Seconds from submit to done for one priority job: from just before the submit to the
    daemon's own record of the end (meta.json's ``finished``), so that the waiting client's
    polling interval (up to 0.1 s) is not counted."""
    job_id, began = submit_and_wait(ws)
    return finished_at(ws, job_id) - began


def submit_and_wait(ws: str) -> tuple[str, float]:
    began = time.time()
    job_id = nrvna.Work(ws).publish(PROMPT, **PRIORITY_JOB)
    assert nrvna.Flow(ws).wait(job_id, 300) is nrvna.Status.Done
    return job_id, began


def finished_at(ws: str, job_id: str) -> float:
    return float(nrvna.Flow(ws).get(job_id).meta["finished"])


def backlog_bytes(ws: str) -> int:
    """Text generated so far by backlog jobs (running: partial.txt; finished: result.txt)."""
    total = 0
    for sub, name in ((nrvna.PROCESSING, nrvna.PARTIAL_FILE), (nrvna.OUTPUT, nrvna.RESULT_FILE)):
        with os.scandir(os.path.join(ws, sub)) as entries:
            for entry in entries:
                try:
                    total += os.path.getsize(os.path.join(entry.path, name))
                except OSError:
                    pass
    return total


def window(ws: str, seconds: float, priority_jobs: int) -> tuple[float, list[float]]:
    """The backlog's bytes/s over ``seconds``, with ``priority_jobs`` spread over it (and
    their latencies). Priority jobs' own text is not counted: they go to output/ too, so
    their result sizes are subtracted."""
    began, start_bytes = time.monotonic(), backlog_bytes(ws)
    latencies, own = [], 0
    for i in range(priority_jobs):
        while time.monotonic() < began + i * seconds / priority_jobs:
            time.sleep(0.05)
        job_id, job_start = submit_and_wait(ws)
        latencies.append(finished_at(ws, job_id) - job_start)
        own += len(nrvna.Flow(ws).result_bytes(job_id) or b"")
    while time.monotonic() < began + seconds:
        time.sleep(0.05)
    return (backlog_bytes(ws) - start_bytes - own) / (time.monotonic() - began), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--backlog", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of each window without priority jobs")
    parser.add_argument("--spacing", type=float, default=12.0, help="seconds between priority jobs under load")
    args = parser.parse_args()
    print(machine())
    ws = os.path.join(tempfile.mkdtemp(prefix="nrvna-bench-priority-"), "ws")
    nrvna.ensure_workspace(ws)
    proc = start_daemon(args.model, ws)
    try:
        for _ in range(2):  # warm-up: model pages, contexts
            latency(ws)
        idle = [latency(ws) for _ in range(args.rounds)]
        lines = b"".join(b'{"prompt": "Story %d: ' % i + PROMPT.encode()
                         + b'", "max_tokens": 256, "ignore_eos": true}\n'
                         for i in range(args.backlog))
        nrvna.Work(ws).submit_file(lines, jsonl=True, tag="backlog")
        deadline = time.monotonic() + 120
        while nrvna.Flow(ws).counts()["running"] < 32 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(5.0)  # past the backlog's prompt prefill
        before, _ = window(ws, args.window, 0)
        during, loaded = window(ws, args.spacing * args.rounds, args.rounds)
        after, _ = window(ws, args.window, 0)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(os.path.dirname(ws), ignore_errors=True)
    idle_median, loaded_median = statistics.median(idle), statistics.median(loaded)
    baseline = (before + after) / 2
    print(table(["measure", "value", "baseline in the same run", "ratio"], [
        ["priority-10 job of 32 tokens, median of %d" % args.rounds, f"{loaded_median:.2f} s loaded",
         f"{idle_median:.2f} s idle", f"{loaded_median / idle_median:.2f}x (target <= 1.5x)"],
        ["backlog throughput with priority jobs", f"{during:.0f} B/s", f"{baseline:.0f} B/s without "
         f"({before:.0f} before, {after:.0f} after)", f"{during / baseline:.3f} (target >= 0.90)"],
    ]))
    print(f"loaded latencies: {', '.join(f'{x:.2f}' for x in loaded)}; idle: {', '.join(f'{x:.2f}' for x in idle)}")


if __name__ == "__main__":
    main()
