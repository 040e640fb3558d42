"""Batches at scale: `nrvna submit --file` of 100,000 lines (jobs/s) against the durable
single-submit loop of #5 (`Work.publish`, one job at a time) in the same run; then, on that
workspace, `nrvna status --tag` and `nrvna wait --tag` (all queued: it returns exit 4 at
once with --timeout 0); then the 100,000 jobs are finished by hand (result.txt and meta.json
written, renamed into output/, no model) and `nrvna export --tag` writes them (jobs/s,
peak RSS). Targets: submit --file >= 2,000 jobs/s; status --tag < 1 s; export streams.

    python bench/batch.py [--lines 100000] [--single 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, machine, table

import nrvna

SCRIPT = os.path.join(ROOT, "nrvna.py")


def run(*args: str) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, this child's peak RSS MB and the result of `nrvna ARGS`."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([PYTHON, SCRIPT, *args], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
    return elapsed, usage.ru_maxrss / 1024, done


def finish_by_hand(ws: str, ids: list[str]) -> None:
    """Move queued jobs to output/ with a result, as a daemon would (setup, not measured)."""
    for job_id in ids:
        src = os.path.join(ws, nrvna.READY, job_id)
        with open(os.path.join(src, "result.txt"), "w") as handle:
            handle.write(f"result of {job_id} " * 8)
        with open(os.path.join(src, "meta.json"), "w") as handle:
            json.dump({"id": job_id, "finished": time.time(), "finish_reason": "stop", "model": "bench",
                       "prompt_tokens": 12, "generated_tokens": 40, "attempts": 1}, handle)
        os.rename(src, os.path.join(ws, nrvna.OUTPUT, job_id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--single", type=int, default=2000, help="jobs in the single-submit baseline")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        os.sync()
        single_ws = os.path.join(base, "single")
        work = nrvna.Work(single_ws)
        start = time.perf_counter()
        for i in range(args.single):
            work.publish(f"single prompt {i}")
        single_rate = args.single / (time.perf_counter() - start)

        ws = os.path.join(base, "ws")
        lines = os.path.join(base, "prompts.jsonl")
        with open(lines, "w") as handle:
            for i in range(args.lines):
                handle.write(json.dumps({"custom_id": f"req-{i}", "prompt": f"Summarise item {i} in one line.",
                                         "max_tokens": 64}) + "\n")
        os.sync()  # earlier runs' deletions and the baseline's writes are not billed to this step
        submit_s, submit_rss, done = run("submit", ws, "--file", lines, "--tag", "big")
        assert done.returncode == 0, done.stderr[-500:]
        ids = done.stdout.decode().split()
        assert len(ids) == args.lines
        status_s, status_rss, done = run("status", ws, "--tag", "big", "--json")
        assert json.loads(done.stdout)["queued"] == args.lines, done.stdout
        wait_s, _, done = run("wait", ws, "--tag", "big", "--timeout", "0")
        assert done.returncode == 4, done.stderr
        again_s, _, done = run("submit", ws, "--file", lines, "--tag", "big")
        assert done.stdout.decode().split() == ids
        finish_by_hand(ws, ids)
        out = os.path.join(base, "out.jsonl")
        export_s, export_rss, done = run("export", ws, "--tag", "big", "--format", "openai", "-o", out)
        assert done.returncode == 0, done.stderr[-500:]
        with open(out) as handle:
            assert sum(1 for _ in handle) == args.lines
        wait_done_s, _, done = run("wait", ws, "--tag", "big")
        assert done.returncode == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    n = args.lines
    print(f"machine: {machine()}; {n:,} lines")
    print(table(["step", "seconds", "jobs/s", "vs single-submit loop", "peak RSS MB"], [
        [f"single-submit loop (Work.publish x {args.single:,})", args.single / single_rate, single_rate, 1,
         float("nan")],
        [f"submit --file ({n:,} JSONL lines, tag)", submit_s, n / submit_s, n / submit_s / single_rate, submit_rss],
        ["status --tag (all queued)", status_s, float("nan"), float("nan"), status_rss],
        ["wait --tag --timeout 0 (all queued)", wait_s, float("nan"), float("nan"), float("nan")],
        ["submit --file again (all already queued)", again_s, n / again_s, float("nan"), float("nan")],
        ["wait --tag (all done)", wait_done_s, float("nan"), float("nan"), float("nan")],
        [f"export --tag --format openai -o ({n:,} done)", export_s, n / export_s, float("nan"), export_rss],
    ]))


if __name__ == "__main__":
    main()
