"""Pickup latency: an idle daemon (instant runner); 200 jobs submitted one at a time with
pauses; time from `submit` returning to the job being claimed by a worker. Baseline, run in
the same process on the same disk: the spec's Scanner, which lists input/ready/ every 1 s.

    python bench/pickup.py [--jobs 200] [--pause 0.02]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import threading
import time

from common import ROOT, daemon, machine, percentile, table

import nrvna

# The runner reports when it was called: the claim happened immediately before it.
RUNNER = "lambda job: repr(__import__('time').time())"


def measure_nrvna(ws: str, jobs: int, pause: float) -> list[float]:
    proc = daemon(ws, "-w", "2", runner=RUNNER)
    time.sleep(1.0)
    flow, work, latencies = nrvna.Flow(ws), nrvna.Work(ws), []
    try:
        for _ in range(jobs):
            job_id = work.publish("ping")
            published = time.time()
            assert flow.wait(job_id, 10) is nrvna.Status.Done
            latencies.append(float(flow.get(job_id).result) - published)
            time.sleep(pause)
    finally:
        proc.terminate()
        proc.wait()
    return latencies


def measure_spec_loop(ws: str, jobs: int, pause: float) -> list[float]:
    """The spec's design: every second, list ready/ and claim what is there."""
    nrvna.ensure_workspace(ws)
    ready, processing = os.path.join(ws, nrvna.READY), os.path.join(ws, nrvna.PROCESSING)
    claimed: dict[str, float] = {}
    stop = threading.Event()

    def scan_loop() -> None:
        while not stop.is_set():
            for name in os.listdir(ready):
                os.rename(os.path.join(ready, name), os.path.join(processing, name))
                claimed[name] = time.time()
            stop.wait(1.0)

    thread = threading.Thread(target=scan_loop)
    thread.start()
    work, latencies = nrvna.Work(ws), []
    try:
        for _ in range(jobs):
            job_id = work.publish("ping")
            published = time.time()
            while job_id not in claimed:
                time.sleep(0.001)
            latencies.append(claimed[job_id] - published)
            time.sleep(pause + random.random())  # a random phase against the 1 s loop
    finally:
        stop.set()
        thread.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between jobs")
    parser.add_argument("--baseline-jobs", type=int, default=20, help="jobs for the 1 s loop (each costs ~0.5 s)")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        ours = measure_nrvna(f"{base}/ws", args.jobs, args.pause)
        spec = measure_spec_loop(f"{base}/spec", args.baseline_jobs, args.pause)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ms = lambda v: v * 1000  # noqa: E731
    rows = []
    for name, values in ((f"nrvna (inotify), {len(ours)} jobs", ours),
                         (f"spec's 1 s scan loop, {len(spec)} jobs", spec)):
        rows.append([name, ms(statistics.median(values)), ms(percentile(values, 99)), ms(statistics.mean(values)),
                     statistics.mean(spec) / statistics.mean(values)])
    print(f"machine: {machine()}")
    print(table(["pickup latency", "p50 ms", "p99 ms", "mean ms", "speed-up vs spec (mean)"], rows))
    p50, p99 = ms(statistics.median(ours)), ms(percentile(ours, 99))
    print(f"\ntarget p50 <= 20 ms, p99 <= 100 ms: {'met' if p50 <= 20 and p99 <= 100 else 'MISSED'}")


if __name__ == "__main__":
    main()
