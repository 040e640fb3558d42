"""Durable single-process submit: `Work.publish` in a loop (each job fsynced and published
before the next) against the bare mkdir-write-fsync-rename-fsync sequence on the same disk,
in the same run. Target: >= 1,000 jobs/s.

    python bench/submit.py [--jobs 2000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from common import ROOT, machine, table
from throughput import durable_publish_floor

import nrvna


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        rows = []
        for round_ in range(2):  # interleaved: the disk's speed drifts
            floor = durable_publish_floor(f"{base}/floor{round_}", args.jobs)
            ws = f"{base}/ws{round_}"
            work = nrvna.Work(ws)
            work.publish("warm")
            start = time.perf_counter()
            for i in range(args.jobs):
                work.publish(f"job {i}")
            ours = args.jobs / (time.perf_counter() - start)
            rows.append([f"round {round_ + 1}: nrvna Work.publish", ours, ours / floor])
            rows.append([f"round {round_ + 1}: bare durable sequence (floor)", floor, 1.0])
        print(f"machine: {machine()}")
        print(table(["durable single-process submit", "jobs/s", "vs floor"], rows))
        best = max(r[1] for r in rows if "nrvna" in r[0])
        print(f"\ntarget >= 1000 jobs/s: {'met' if best >= 1000 else 'MISSED'} (best round {best:.0f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
