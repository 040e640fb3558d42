"""Into the pipeline at scale: `submit --file data --template` of 100,000 records (JSONL, then
CSV) against `submit --file` of the same 100,000 jobs written as nrvna's JSONL lines, in the
same run (the baseline: target >= 2,000 jobs/s and the same rate); then, once the jobs are
finished by hand (result.txt and a meta.json with its history, renamed into output/, no
model), `nrvna events` replaying their 300,000 changes, `events --tag` of one tag, and
`export --format jsonl` carrying each record's fields back as metadata (peak RSS).

    python bench/pipeline.py [--records 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import tempfile
import time

from batch import run
from common import ROOT, machine, table

import nrvna

TEMPLATE = "Classify the sentiment of this review as positive or negative: {text}"


def records(n: int) -> list[dict[str, object]]:
    return [{"id": f"rev-{i}", "text": f"Review {i}: the product did {'not ' * (i % 2)}work as described.",
             "stars": i % 5 + 1, "lang": "en"} for i in range(n)]


def finish_by_hand(ws: str, ids: list[str]) -> None:
    """Move queued jobs to output/ as a daemon would, meta.json's history included (setup)."""
    now = time.time()
    for job_id in ids:
        src = os.path.join(ws, nrvna.READY, job_id)
        with open(os.path.join(src, "result.txt"), "w") as handle:
            handle.write("positive")
        with open(os.path.join(src, "meta.json"), "w") as handle:
            json.dump({"id": job_id, "finished": now, "finish_reason": "stop", "model": "bench", "submitted": now - 2,
                       "events": [[now - 1, "running"], [now, "done"]], "attempts": 1}, handle)
        os.rename(src, os.path.join(ws, nrvna.OUTPUT, job_id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.records
    data = records(n)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    rows = []
    try:
        lines = os.path.join(base, "lines.jsonl")  # the baseline: the prompts written out by a script
        with open(lines, "w") as handle:
            for record in data:
                handle.write(json.dumps({"custom_id": record["id"], "prompt": TEMPLATE.format(**record),
                                         "metadata": {k: v for k, v in record.items() if k != "id"}}) + "\n")
        jsonl = os.path.join(base, "data.jsonl")
        with open(jsonl, "w") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in data)
        csv_path = os.path.join(base, "data.csv")
        with open(csv_path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)
        arms = {"lines": ["--file", lines],
                "jsonl": ["--file", jsonl, "--template", TEMPLATE, "--id-field", "id"],
                "csv": ["--file", csv_path, "--template", TEMPLATE, "--id-field", "id"]}
        # Interleaved rounds, each in a rotated order: this disk's speed drifts 3x within minutes.
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        ratios: dict[str, list[float]] = {"jsonl": [], "csv": []}
        kept = None
        for round_ in range(args.rounds):
            order = list(arms)[round_ % 3:] + list(arms)[:round_ % 3]
            seconds_of = {}
            for name in order:
                ws = os.path.join(base, f"ws-{name}-{round_}")
                os.sync()  # the earlier step's writes are not billed to this one
                seconds, rss, done = run("submit", ws, *arms[name], "--tag", name)
                assert done.returncode == 0, done.stderr[-500:]
                ids = done.stdout.decode().split()
                assert len(ids) == n
                timings[name].append((seconds, rss))
                seconds_of[name] = seconds
                if name == "jsonl" and kept is None:
                    kept = (ws, ids)
                else:
                    shutil.rmtree(ws)
            for name in ratios:
                ratios[name].append(seconds_of["lines"] / seconds_of[name])
        labels = {"lines": f"submit --file ({n:,} nrvna JSONL lines made by a script)",
                  "jsonl": f"submit --file --template ({n:,} JSONL records)",
                  "csv": f"submit --file --template ({n:,} CSV rows)"}
        for name, label in labels.items():
            rates = sorted(n / seconds for seconds, _ in timings[name])
            ratio = "1" if name == "lines" else " ".join(f"{r:.2f}" for r in ratios[name])
            rows.append([label, statistics.median(seconds for seconds, _ in timings[name]),
                         f"median {statistics.median(rates):,.0f} ({rates[0]:,.0f}-{rates[-1]:,.0f})", ratio,
                         max(rss for _, rss in timings[name])])
        ws, ids = kept
        assert nrvna.Flow(ws).get(ids[1]).prompt == TEMPLATE.format(**data[1])
        finish_by_hand(ws, ids)
        os.sync()
        seconds, rss, done = run("events", ws)
        assert done.returncode == 0 and done.stdout.count(b"\n") == 3 * n, done.stderr[-500:]
        rows.append([f"events ({3 * n:,} changes of {n:,} jobs)", seconds, n / seconds, float("nan"), rss])
        seconds, rss, done = run("events", ws, "--tag", "jsonl", "--since", "1m")
        assert done.returncode == 0 and done.stdout.count(b"\n") == 3 * n, done.stderr[-500:]
        rows.append(["events --tag --since 1m (the same)", seconds, n / seconds, float("nan"), rss])
        out = os.path.join(base, "out.jsonl")
        seconds, rss, done = run("export", ws, "--tag", "jsonl", "-o", out)
        assert done.returncode == 0, done.stderr[-500:]
        with open(out) as handle:
            first = json.loads(handle.readline())
        assert first["metadata"] == {k: v for k, v in data[0].items() if k != "id"} and first["custom_id"] == "rev-0"
        rows.append([f"export --format jsonl with metadata ({n:,} done)", seconds, n / seconds, float("nan"), rss])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {machine()}; {n:,} records")
    print(table(["step", "seconds (median)", "jobs/s", "vs script-made lines, round by round", "peak RSS MB"], rows))


if __name__ == "__main__":
    main()
