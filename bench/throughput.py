"""Queue throughput: N jobs submitted durably by C client processes while a daemon with W
workers (instant runner, fsync on) works them; end to end until all are in output/.

Prints jobs/s with the physical floors measured on the same disk in the same run: a bare
rename() loop, and the bare durable publish sequence (mkdir, write, fsync, rename, fsync).

    python bench/throughput.py [--jobs 5000] [--clients 4] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, daemon, machine, table, wait_for_count

import nrvna


def rename_floor(base: str, n: int = 5000) -> float:
    os.makedirs(f"{base}/a"), os.makedirs(f"{base}/b")
    for i in range(n):
        os.mkdir(f"{base}/a/{i}")
    start = time.perf_counter()
    for i in range(n):
        os.rename(f"{base}/a/{i}", f"{base}/b/{i}")
    return n / (time.perf_counter() - start)


def durable_publish_floor(base: str, n: int = 1000) -> float:
    """The bare mkdir-write-fsync-rename-fsync sequence, one process, no Python queue code."""
    writing, ready = f"{base}/w", f"{base}/r"
    os.makedirs(writing), os.makedirs(ready)
    start = time.perf_counter()
    for i in range(n):
        os.mkdir(f"{writing}/{i}")
        fd = os.open(f"{writing}/{i}/prompt.txt", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"hello")
        os.fsync(fd)
        os.close(fd)
        nrvna.fsync_dir(f"{writing}/{i}")
        os.rename(f"{writing}/{i}", f"{ready}/{i}")
        nrvna.fsync_dir(ready)
        nrvna.fsync_dir(writing)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        renames = rename_floor(f"{base}/floor")
        publishes = durable_publish_floor(f"{base}/durable")
        ws = f"{base}/ws"
        nrvna.ensure_workspace(ws)
        proc = daemon(ws, "-w", str(args.workers))
        time.sleep(1.0)  # started and idle
        per_client = args.jobs // args.clients
        code = (f"import sys; sys.path.insert(0, {ROOT!r}); import nrvna; w = nrvna.Work({ws!r})\n"
                f"for i in range({per_client}): w.publish('job %d' % i)")
        start = time.monotonic()
        clients = [subprocess.Popen([PYTHON, "-c", code]) for _ in range(args.clients)]
        for client in clients:
            client.wait()
        submitted = time.monotonic()
        end = wait_for_count(ws, nrvna.OUTPUT, per_client * args.clients, poll=0.005)
        proc.terminate()
        proc.wait()
        total = per_client * args.clients
        rate = total / (end - start)
        print(f"machine: {machine()}; workspace on {base}")
        print(table(["measure", "jobs/s", "vs nrvna"], [
            [f"nrvna end to end: {total} jobs, {args.clients} clients, {args.workers} workers, fsync on", rate, 1.0],
            [f"  of which submit ({args.clients} processes, durable)", total / (submitted - start),
             (total / (submitted - start)) / rate],
            ["floor: bare durable publish sequence, 1 process", publishes, publishes / rate],
            ["floor: bare rename() loop, 1 process", renames, renames / rate],
        ]))
        print(f"\ntarget >= 1000 jobs/s end to end: {'met' if rate >= 1000 else 'MISSED'} ({rate:.0f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
