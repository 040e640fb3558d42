"""Scale: the same instant-runner daemon draining a backlog queued before it starts, at 1k
and at 100k jobs. Reports jobs/s, the daemon's peak RSS, and `nrvna status WS ID` wall time
on the 100k workspace. Targets: 100k throughput >= 80% of 1k; RSS growth <= 100 MB; status
< 100 ms.

    python bench/scale.py [--big 100000] [--small 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, daemon, machine, plant_jobs, table

import nrvna


def drain(ws: str, jobs: int) -> tuple[float, float]:
    """Seconds to drain `jobs` (start-up excluded) and the largest peak RSS (MB) of any
    child so far (run the small backlog first)."""
    proc = daemon(ws, "-w", "4", "--drain")
    processing = os.path.join(ws, nrvna.PROCESSING)
    start = None
    while proc.poll() is None:
        if start is None and os.listdir(processing):
            start = time.monotonic()  # the first claim: start-up is over
        time.sleep(0.002 if start is None else 0.05)
    end = time.monotonic()
    assert proc.returncode == 0 and not os.listdir(os.path.join(ws, nrvna.READY))
    return end - (start or end), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=1000)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        rows = []
        results = {}
        for jobs in (args.small, args.big):
            ws = f"{base}/ws{jobs}"
            ids = plant_jobs(ws, jobs)
            if jobs == args.big:
                samples = []
                for job_id in (ids[0], ids[len(ids) // 2], ids[-1]) * 3:
                    t = time.perf_counter()
                    subprocess.run([PYTHON, os.path.join(ROOT, "nrvna.py"), "status", ws, job_id],
                                   stdout=subprocess.DEVNULL, check=False)
                    samples.append(time.perf_counter() - t)
                status_ms = statistics.median(samples) * 1000
            seconds, rss = drain(ws, jobs)
            results[jobs] = (jobs / seconds, rss)
            rows.append([f"{jobs} jobs queued before start", jobs / seconds, rss])
            shutil.rmtree(ws)
        ratio = results[args.big][0] / results[args.small][0]
        growth = results[args.big][1] - results[args.small][1]
        print(f"machine: {machine()}")
        print(table(["backlog", "jobs/s", "daemon peak RSS MB"], rows))
        print(f"\nthroughput at {args.big} / at {args.small}: {ratio:.2f} (target >= 0.80)")
        print(f"peak RSS growth: {growth:.1f} MB (target <= 100)")
        print(f"`nrvna status WS ID` on {args.big} queued jobs: {status_ms:.1f} ms median (target < 100)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
