"""Memory (issue 46): nrvna's daemon against llama-server on the same work, peak resident memory
(VmHWM) and throughput, in one run.

The work: 32 prompts x 64 generated tokens (end-of-generation ignored) plus 16 structured jobs
(bench/structured.py's schema, end-of-generation honoured), all queued at once; llama-server gets
them from 16 concurrent clients. Every process is fresh and warm (model loaded, one short job
done) before the work starts; VmHWM is read after it, so it covers the load and the work.

Arms, in interleaved rounds (reversed every other round):
  nrvna at its defaults (this checkout), with NRVNA_KV_TYPE=q8_0 and =q4_0;
  nrvna at its defaults from --against DIR (the commit before), where given;
  llama-server -np 16 with as many KV cells in all as nrvna's daemon has (-c = workers x cells
  per worker context, read from nrvna's start line), f16 and q8_0 (-ctk/-ctv q8_0 -fa on).

--reference (issue 60): the comparison a user makes, defaults against defaults. The work: the same
32 prompts x 64 tokens with end-of-generation honoured and 16 schema jobs of max_tokens 40. Arms:
nrvna started as `nrvna.py daemon MODEL WS` with no flag (and with NRVNA_KV_TYPE=q8_0);
llama-server `-np 16 -c <the model's trained context> -t <cores>`, f16 cache, 16 clients; and each
--arm LABEL:VAR=VALUE,... (nrvna with those NRVNA_* variables: what a setting changes). Each arm's
row gives its peak against llama-server's and its jobs/s against nrvna's defaults, both as the
median of the rounds' ratios (each ratio within one round: the host's speed drifts between rounds).

    python bench/memory.py [--model PATH] [--rounds 3] [--against DIR] [--server PATH] [--kv f16,q8_0,q4_0]
    python bench/memory.py --reference [--model PATH] [--rounds 3] [--arm LABEL:VAR=VALUE,...]...
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

from common import default_model, llama_server, machine, ROOT, table
from inference import prompts
from structured import RESPONSE_FORMAT, jobs as structured_jobs, valid
from vs_llama_server import SAMPLING, Daemon, concurrently, peak_rss_mb, post, start_server

import nrvna

TOKENS, STRUCTURED_TOKENS = 64, 256
REFERENCE_STRUCTURED_TOKENS = 40  # issue 60's schema jobs


def workload(reference: bool = False) -> list[dict]:
    """32 free jobs of 64 tokens (exactly 64, end-of-generation ignored, unless ``reference``),
    then 16 structured ones (each with its own seed; max_tokens 40 for ``reference``)."""
    until = {} if reference else {"ignore_eos": True}
    free = [{"prompt": text, "params": dict(SAMPLING, max_tokens=TOKENS, seed=i + 1, **until),
             "structured": False} for i, text in enumerate(prompts(32))]
    constrained = [job for job in structured_jobs() if job["constrained"]][:16]
    budget = REFERENCE_STRUCTURED_TOKENS if reference else STRUCTURED_TOKENS
    shaped = [{"prompt": job["prompt"], "structured": True,
               "params": dict(SAMPLING, max_tokens=budget, seed=job["seed"], response_format=RESPONSE_FORMAT)}
              for job in constrained]
    return free + shaped


def trained_context(model: str) -> int:
    """The model's trained context: its GGUF's <architecture>.context_length (a vocabulary-only
    load, which reads the metadata and no weights; its lines on fd 2 silenced)."""
    import llama_cpp

    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            metadata = llama_cpp.Llama(model, vocab_only=True, verbose=False).metadata
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return int(metadata[f"{metadata.get('general.architecture', 'llama')}.context_length"])


def nrvna_arm(model: str, base: str, env: dict[str, str], root: str = ROOT, reference: bool = False) -> dict:
    daemon = Daemon(model, base, env, root)
    try:
        start = time.time()
        submitted = {daemon.work.publish(job["prompt"], **job["params"]): job for job in workload(reference)}
        for job_id in submitted:
            assert daemon.flow.wait(job_id, 900) is nrvna.Status.Done
        done = [os.stat(os.path.join(daemon.ws, nrvna.OUTPUT, job_id)).st_ctime for job_id in submitted]
        elapsed = max(done) - start
        got = {job_id: daemon.flow.get(job_id) for job_id in submitted}
        tokens = sum(job.meta["generated_tokens"] for job in got.values())
        shaped = [got[job_id].result or "" for job_id, job in submitted.items() if job["structured"]]
        return {"rss": peak_rss_mb(daemon.proc.pid), "elapsed": elapsed, "tokens": tokens,
                "valid": sum(valid(text) for text in shaped) / len(shaped), "cells": daemon_cells(daemon.ws),
                "memory": daemon_memory(daemon.ws)}
    finally:
        daemon.close()


def daemon_memory(ws: str) -> str:
    """The daemon's memory report as its start line says it ("" where it has none)."""
    return "; ".join(nrvna.memory_line(model.get("name", "?"), model["memory"])
                     for record in nrvna.daemon_info(ws) for model in record.get("models", []) if model.get("memory"))


def daemon_cells(ws: str) -> int:
    """The daemon's KV cells in all (its record's memory report), 0 where it has none."""
    total = 0
    for record in nrvna.daemon_info(ws):
        for model in record.get("models", []):
            memory = model.get("memory") or {}
            total += memory.get("contexts", 0) * memory.get("cells", 0)
    return total


def server_arm(binary: str, model: str, cells: int, kv: str, reference: bool = False) -> dict:
    extra = ["-c", str(cells)]  # after start_server's own -c: the last one counts
    if kv != "f16":
        extra += ["-ctk", kv, "-ctv", kv, "-fa", "on"]
    proc, port = start_server(binary, model, 16, *extra)
    try:
        post(port, {"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
        results, lock = [], threading.Lock()

        def ask(job: dict) -> None:
            params = dict(job["params"])
            body = {**params, "messages": [{"role": "user", "content": job["prompt"]}]}
            reply = post(port, body)
            with lock:
                results.append((job["structured"], reply["choices"][0]["message"]["content"] or "",
                                reply["usage"]["completion_tokens"]))

        elapsed = concurrently(workload(reference), 16, ask)
        shaped = [text for structured, text, _ in results if structured]
        return {"rss": peak_rss_mb(proc.pid), "elapsed": elapsed, "tokens": sum(t for _, _, t in results),
                "valid": sum(valid(text) for text in shaped) / len(shaped), "cells": cells}
    finally:
        proc.terminate()
        proc.wait()


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    """``LABEL:VAR=VALUE,VAR=VALUE`` as (label, environment)."""
    label, _, pairs = spec.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    if not label or any(not name.startswith("NRVNA_") for name in env):
        raise SystemExit(f"--arm {spec!r}: LABEL:NRVNA_VAR=VALUE,... expected")
    return label, env


def compare_defaults(args: argparse.Namespace) -> None:
    """Issue 60's comparison: nrvna's defaults against llama-server's, in interleaved rounds."""
    binary = None if args.no_server else llama_server(args.server)
    train = trained_context(args.model)
    arms: dict[str, dict[str, str]] = {"nrvna defaults": {}, "nrvna q8_0": {"NRVNA_KV_TYPE": "q8_0"}}
    arms.update(parse_arm(spec) for spec in args.arm)
    names = ["llama-server", *arms] if binary else list(arms)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    jobs = len(workload(True))
    try:
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else list(reversed(names))):
                out = (server_arm(binary, args.model, train, "f16", True) if name == "llama-server"
                       else nrvna_arm(args.model, base, arms[name], ROOT, True))
                runs[name].append(out)
                print(f"round {r + 1} {name}: VmHWM {out['rss']:.0f} MiB, {jobs / out['elapsed']:.2f} jobs/s, "
                      f"{out['tokens'] / out['elapsed']:.1f} tok/s, valid {out['valid']:.0%}"
                      + (f"\n    {out['memory']}" if out.get("memory") and r == 0 else ""), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(machine())
    print(f"model: {os.path.basename(args.model)} (trained context {train:,}); {jobs} jobs (32 x {TOKENS} tokens, "
          f"end-of-generation honoured, + 16 schema jobs of max_tokens {REFERENCE_STRUCTURED_TOKENS}); "
          f"{args.rounds} rounds; llama-server -np 16 -c {train} -t {nrvna.cpu_count()}, f16, 16 clients")
    rows = []
    for name in names:
        outs = runs[name]
        peak = [o["rss"] / s["rss"] for o, s in zip(outs, runs.get("llama-server", []))] or [float("nan")]
        speed = [d["elapsed"] / o["elapsed"] for o, d in zip(outs, runs["nrvna defaults"])]
        rows.append([name, f"{statistics.median(o['rss'] for o in outs):.0f}", f"{statistics.median(peak):.2f}",
                     f"{statistics.median(jobs / o['elapsed'] for o in outs):.2f}", f"{statistics.median(speed):.2f}",
                     f"{statistics.median(o['tokens'] / o['elapsed'] for o in outs):.1f}",
                     f"{min(o['valid'] for o in outs):.0%}"])
    print(table(["arm", "VmHWM MiB (median)", "vs llama-server (median ratio)", "jobs/s (median)",
                 "vs nrvna defaults (median ratio)", "tok/s", "schema valid (worst)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="another checkout's nrvna.py at its defaults (the commit before)")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--kv", default="f16,q8_0,q4_0", help="nrvna's KV types to run (comma-separated)")
    parser.add_argument("--no-server", action="store_true", help="nrvna's arms only")
    parser.add_argument("--reference", action="store_true", help="issue 60: defaults against llama-server's defaults")
    parser.add_argument("--arm", action="append", default=[], metavar="LABEL:VAR=VALUE,...",
                        help="with --reference: one more nrvna arm, with these NRVNA_* variables")
    args = parser.parse_args()
    if args.reference:
        return compare_defaults(args)
    binary = None if args.no_server else llama_server(args.server)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    arms: dict[str, tuple] = {f"nrvna {kv}": ("nrvna", {"NRVNA_KV_TYPE": kv} if kv != "f16" else {}, ROOT)
                              for kv in args.kv.split(",")}
    if args.against:
        arms["nrvna f16, --against"] = ("nrvna", {}, os.path.abspath(args.against))
    if binary:
        arms["llama-server f16"] = ("server", "f16")
        arms["llama-server q8_0"] = ("server", "q8_0")
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    cells = 0
    try:
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            # nrvna's defaults first in a round's first use: the servers take its cell count.
            if not cells:
                order.sort(key=lambda name: not name.startswith("nrvna f16"))
            for name in order:
                arm = arms[name]
                if arm[0] == "nrvna":
                    out = nrvna_arm(args.model, base, arm[1], arm[2])
                    if name == "nrvna f16" and out["cells"]:
                        cells = out["cells"]
                else:
                    out = server_arm(binary, args.model, cells or 18432, arm[1])
                runs[name].append(out)
                print(f"round {r + 1} {name}: VmHWM {out['rss']:.0f} MiB, {len(workload()) / out['elapsed']:.2f} "
                      "jobs/s, "
                      f"{out['tokens'] / out['elapsed']:.1f} tok/s, valid {out['valid']:.0%}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(machine())
    print(f"model: {os.path.basename(args.model)}; {len(workload())} jobs (32 x {TOKENS} tokens + 16 structured); "
          f"{args.rounds} rounds; KV cells in all: {cells:,}")
    reference = "llama-server f16" if "llama-server f16" in runs else "nrvna f16"
    ref_rss = statistics.median(o["rss"] for o in runs[reference])
    ref_speed = statistics.median(len(workload()) / o["elapsed"] for o in runs["nrvna f16"])
    rows = []
    for name, outs in runs.items():
        rss = statistics.median(o["rss"] for o in outs)
        speed = statistics.median(len(workload()) / o["elapsed"] for o in outs)
        rows.append([name, f"{rss:.0f}", f"{rss / ref_rss:.2f}", f"{speed:.2f}", f"{speed / ref_speed:.2f}",
                     f"{statistics.median(o['tokens'] / o['elapsed'] for o in outs):.1f}",
                     f"{min(o['valid'] for o in outs):.0%}"])
    print(table(["arm", "VmHWM MiB (median)", f"vs {reference}", "jobs/s (median)", "vs nrvna f16", "tok/s",
                 "structured valid (worst)"], rows))


if __name__ == "__main__":
    main()
