"""Structured output: nrvna against llama-server on jobs constrained by one JSON schema.

40 jobs: 32 share one json_schema (an object of 6 fields), 8 free jobs are among them (every
fifth job); end-of-generation is honoured, so a constrained job ends when its grammar does.
Arms, in interleaved rounds: nrvna with its defaults; llama-server -np 8 with 8 concurrent
clients and -np 16 with 16, each request carrying the same response_format. Same model,
prompts, sampling settings and seeds. The schema uses only what both converters enforce
(llama-server's drops number bounds, so there are none), and every output is checked against
it here. Then the grammar's cost per token in nrvna: the 32 constrained jobs alone, against 32
free jobs made to generate exactly as many tokens each (ignore_eos, max_tokens).

    python bench/structured.py [--model PATH] [--rounds 3] [--server PATH]
    python bench/structured.py --against DIR [--rounds 3]   # this nrvna.py against DIR's, no server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from common import default_model, llama_server, machine, ROOT, table
import vs_llama_server
from vs_llama_server import SAMPLING, Daemon, concurrently, peak_rss_mb, post, start_server

import nrvna

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["tools", "toys", "food", "books", "garden"]},
        "price": {"type": "integer", "minimum": 0, "maximum": 5000},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["name", "category", "price", "in_stock", "tags", "rating"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "product", "schema": SCHEMA, "strict": True}}
CONSTRAINED_TOKENS, FREE_TOKENS = 256, 96
ITEMS = ["hammer", "kite", "olive oil", "atlas", "rake", "drill", "puzzle", "honey", "novel", "shovel", "wrench",
         "yo-yo", "bread", "cookbook", "hose", "saw"]


def valid(text: str) -> bool:
    """Whether ``text`` is a JSON object satisfying SCHEMA (checked by hand, keyword by keyword)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(props)
            and isinstance(value["name"], str) and len(value["name"]) <= 24
            and value["category"] in props["category"]["enum"]
            and type(value["price"]) is int and 0 <= value["price"] <= 5000
            and isinstance(value["in_stock"], bool)
            and isinstance(value["tags"], list) and 1 <= len(value["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 12 for t in value["tags"])
            and type(value["rating"]) is int and 1 <= value["rating"] <= 5)


def jobs() -> list[dict]:
    """40 jobs, every fifth free: (prompt, constrained, seed)."""
    out = []
    for i in range(40):
        item = ITEMS[i % len(ITEMS)]
        if i % 5 == 4:
            out.append({"prompt": f"In two sentences, what is a {item} used for?", "constrained": False, "seed": i + 1})
        else:
            out.append({"prompt": f"Describe a {item} sold in our shop (item {i}) as a JSON product record.",
                        "constrained": True, "seed": i + 1})
    return out


def nrvna_arm(daemon: Daemon, work: list[dict]) -> dict:
    start = time.time()
    submitted = {}
    for job in work:
        params = dict(SAMPLING, seed=job["seed"], max_tokens=CONSTRAINED_TOKENS if job["constrained"] else FREE_TOKENS)
        if job["constrained"]:
            params["response_format"] = RESPONSE_FORMAT
        params.update(job.get("extra", {}))
        submitted[daemon.work.publish(job["prompt"], **params)] = job
    for job_id in submitted:
        assert daemon.flow.wait(job_id, 900) is nrvna.Status.Done
    done = {job_id: os.stat(os.path.join(daemon.ws, nrvna.OUTPUT, job_id)).st_ctime for job_id in submitted}
    elapsed = max(done.values()) - start
    results = []
    for job_id, job in submitted.items():
        got = daemon.flow.get(job_id)
        results.append({"constrained": job["constrained"], "text": got.result, "finish": got.meta["finish_reason"],
                        "tokens": got.meta["generated_tokens"]})
    return summarize(results, elapsed, peak_rss_mb(daemon.proc.pid))


def server_arm(binary: str, model: str, work: list[dict], slots: int) -> dict:
    proc, port = start_server(binary, model, slots)
    try:
        post(port, {"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8,
                    "response_format": RESPONSE_FORMAT})
        results, lock = [], threading.Lock()

        def ask(job: dict) -> None:
            body = dict(SAMPLING, seed=job["seed"], messages=[{"role": "user", "content": job["prompt"]}],
                        max_tokens=CONSTRAINED_TOKENS if job["constrained"] else FREE_TOKENS)
            if job["constrained"]:
                body["response_format"] = RESPONSE_FORMAT
            reply = post(port, body)
            choice = reply["choices"][0]
            with lock:
                results.append({"constrained": job["constrained"], "text": choice["message"]["content"],
                                "finish": choice["finish_reason"], "tokens": reply["usage"]["completion_tokens"]})

        elapsed = concurrently(work, slots, ask)
        return summarize(results, elapsed, peak_rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait()


def summarize(results: list[dict], elapsed: float, rss: float) -> dict:
    constrained = [r for r in results if r["constrained"]]
    stopped = [r for r in constrained if r["finish"] == "stop"]
    return {"jobs/s": len(results) / elapsed, "tok/s": sum(r["tokens"] for r in results) / elapsed, "elapsed": elapsed,
            "valid": sum(valid(r["text"]) for r in constrained) / max(1, len(constrained)),
            "valid_stop": sum(valid(r["text"]) for r in stopped) / max(1, len(stopped)),
            "stopped": len(stopped) / max(1, len(constrained)), "rss": rss,
            "constrained_tokens": [r["tokens"] for r in constrained]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--against", metavar="DIR", help="compare with the nrvna.py in DIR (a checkout of another "
                                                        "commit) instead of llama-server")
    args = parser.parse_args()
    if args.against:
        return against(args.model, os.path.abspath(args.against), args.rounds)
    binary = llama_server(args.server)
    work = jobs()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    arms = ["nrvna, defaults", "llama-server -np 8, 8 clients", "llama-server -np 16, 16 clients"]
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    costs: list[tuple[float, float]] = []  # (constrained tok/s, free tok/s), nrvna
    try:
        for _ in range(args.rounds):
            runs[arms[1]].append(server_arm(binary, args.model, work, 8))
            daemon = Daemon(args.model, base, {})
            try:
                runs[arms[0]].append(nrvna_arm(daemon, work))
                # The grammar's cost: the constrained jobs alone, then free jobs of the same lengths.
                constrained = [job for job in work if job["constrained"]]
                alone = nrvna_arm(daemon, constrained)
                lengths = alone["constrained_tokens"]
                free = [dict(job, constrained=False, extra={"max_tokens": n, "ignore_eos": True})
                        for job, n in zip(constrained, lengths)]
                unconstrained = nrvna_arm(daemon, free)
                costs.append((alone["tok/s"], unconstrained["tok/s"]))
            finally:
                daemon.close()
            runs[arms[2]].append(server_arm(binary, args.model, work, 16))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows, medians = [], {}
    for name in arms:
        ordered = sorted(runs[name], key=lambda r: r["jobs/s"])
        medians[name] = median = ordered[len(ordered) // 2]
        rows.append([name, median["jobs/s"], f"{ordered[0]['jobs/s']:.3g}-{ordered[-1]['jobs/s']:.3g}", median["tok/s"],
                     f"{100 * min(r['valid'] for r in runs[name]):.1f}%",
                     f"{100 * min(r['valid_stop'] for r in runs[name]):.1f}%",
                     f"{100 * min(r['stopped'] for r in runs[name]):.0f}%", median["rss"]])
    best = max(medians[name]["jobs/s"] for name in arms[1:])
    paired = [runs[arms[0]][r]["jobs/s"] / max(runs[a][r]["jobs/s"] for a in arms[1:]) for r in range(args.rounds)]
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; 40 jobs (32 with one json_schema, 8 free)")
    print(f"median of {args.rounds} interleaved rounds by jobs/s; validity and stops: the worst round")
    print(table(["arm", "jobs/s", "jobs/s range", "tok/s", "constrained valid", "valid of those ending stop",
                 "ended by the grammar", "peak RSS MB"], rows))
    print(f"\nnrvna defaults vs the better llama-server arm: {medians[arms[0]]['jobs/s'] / best:.2f}x jobs/s "
          f"(per round: {', '.join(f'{x:.2f}x' for x in paired)}; target >= 1.0)")
    ratios = [c / f for c, f in costs]
    print(f"grammar cost in nrvna: constrained {statistics.median(c for c, _ in costs):.0f} tok/s vs free "
          f"{statistics.median(f for _, f in costs):.0f} tok/s for the same token counts "
          f"(ratio per round: {', '.join(f'{x:.2f}' for x in ratios)})")


def grammar_cost(daemon: Daemon, work: list[dict]) -> tuple[float, float]:
    """The constrained jobs alone, then free jobs of the same lengths: (tok/s, tok/s)."""
    constrained = [job for job in work if job["constrained"]]
    alone = nrvna_arm(daemon, constrained)
    free = [dict(job, constrained=False, extra={"max_tokens": n, "ignore_eos": True})
            for job, n in zip(constrained, alone["constrained_tokens"])]
    return alone["tok/s"], nrvna_arm(daemon, free)["tok/s"]


def against(model: str, other: str, rounds: int) -> None:
    """This checkout's nrvna against another's on the same 40 jobs, in interleaved rounds."""
    work = jobs()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    arms = {"this checkout": ROOT, f"{other}": other}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    costs: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for round_number in range(rounds):
            for name in (list(arms) if round_number % 2 == 0 else list(arms)[::-1]):
                vs_llama_server.ROOT = arms[name]  # Daemon starts ROOT/nrvna.py
                daemon = Daemon(model, base, {})
                try:
                    runs[name].append(nrvna_arm(daemon, work))
                    costs[name].append(grammar_cost(daemon, work))
                finally:
                    daemon.close()
    finally:
        vs_llama_server.ROOT = ROOT
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for name in arms:
        ordered = sorted(runs[name], key=lambda r: r["jobs/s"])
        median = ordered[len(ordered) // 2]
        ratios = [c / f for c, f in costs[name]]
        rows.append([name, median["jobs/s"], f"{ordered[0]['jobs/s']:.3g}-{ordered[-1]['jobs/s']:.3g}", median["tok/s"],
                     f"{100 * min(r['valid'] for r in runs[name]):.1f}%", statistics.median(c for c, _ in costs[name]),
                     statistics.median(f for _, f in costs[name]), f"{statistics.median(ratios):.2f}"])
    first, second = list(arms)
    paired = [runs[first][r]["jobs/s"] / runs[second][r]["jobs/s"] for r in range(rounds)]
    print(f"machine: {machine()}; model {os.path.basename(model)}; 40 jobs (32 with one json_schema, 8 free)")
    print(f"median of {rounds} interleaved rounds by jobs/s; validity: the worst round")
    print(table(["nrvna", "jobs/s", "jobs/s range", "tok/s", "constrained valid", "constrained alone tok/s",
                 "free, same lengths tok/s", "grammar cost ratio"], rows))
    print(f"\nthis checkout vs {second}: per round {', '.join(f'{x:.2f}x' for x in paired)} jobs/s")


if __name__ == "__main__":
    main()
