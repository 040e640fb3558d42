"""nrvna against llama-server where a decode is nearly free and the host's work per token decides
throughput, as on a GPU (issue 33).

The model: random weights in one layer of width 64, with SmolLM2-135M's metadata, tokenizer and
49,152-token vocabulary (bench/random_model.py --shape host, made once from SOURCE and cached), so
each token still pays for sampling over the whole vocabulary, detokenizing and the step loop.
256 prompts x 256 tokens, end-of-generation ignored, temperature 0.8, top_k 40, top_p 0.9 and
min_p 0.05, no repetition penalty (the same settings sent to both sides; --penalty 1.1 adds one
to both). Arms, in interleaved rounds (no arm always first): nrvna at its defaults, llama-server
-np 16 and -np 64 with as many concurrent clients. The ratio is nrvna's against the better
llama-server arm of the same round; the median of the rounds is the figure.

Then one profiled nrvna run of the same jobs (not in the ratios): the daemon in a child that
times, per worker thread, llama_decode, sampling (the shortlists, penalties and draws), detokenizing
(_Sequence.add and the token pieces), emitting (text passed on for partial.txt), the rest of
the step loop, and between steps the claims, the finishes (files, fsyncs, renames) and the
other gaps. Each is given in microseconds per generated token, summed over the workers: the
wall time of a worker thread (which includes waiting for the GIL and for a core), the CPU time
the thread used, and the wall's share of the workers' time; with the process's CPU time per
token. The wrappers cost about 2 us a call.

    python bench/host_bound.py [SOURCE.gguf] [--prompts 256] [--tokens 256] [--rounds 3]
        [--slots 16,64] [--penalty 1.0] [--server BIN] [--gguf-py DIR] [--no-profile]
        [--against DIR]   # also nrvna's defaults from DIR (a checkout of another commit)
    python bench/host_bound.py --in-process [--rounds 3] [--penalty 1.0]   # the sampling change alone:
        # one session in this process, the k-likeliest draws on and off in alternation
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import default_model, LOAD_NRVNA, llama_server, machine, PYTHON, ratio_rows, ROOT, table
from inference import prompts
from vs_llama_server import Daemon, server_arm

import nrvna

CACHE = os.environ.get("NRVNA_BENCH_CACHE", os.path.expanduser("~/.cache/nrvna-bench"))


def host_model(source: str, gguf_py: str | None) -> str:
    """The 1-layer width-64 model made from ``source`` (cached by the source's size and mtime;
    v2: no two tokens share an embedding row)."""
    stat = os.stat(source)
    key = hashlib.sha256(f"v2:{os.path.abspath(source)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = os.path.join(CACHE, f"host-{key}.gguf")
    if not os.path.exists(out):
        gguf_py = gguf_py or next(iter(sorted(glob.glob(os.path.join(CACHE, "llama-server-*", "src", "gguf-py")))),
                                  None)
        os.makedirs(CACHE, exist_ok=True)
        command = [PYTHON, os.path.join(ROOT, "bench", "random_model.py"), source, out + ".tmp", "--shape", "host"]
        subprocess.run(command + (["--gguf-py", gguf_py] if gguf_py else []), check=True)
        os.replace(out + ".tmp", out)
    return out


# The profiled daemon: argv NRVNA_PY MODEL WS OUT.json. Each timed method adds its time, less the
# timed calls inside it, to its category for the calling thread; a worker's step also marks
# where its steps begin and end, so the time between them is known.
PROFILED_DAEMON = LOAD_NRVNA + r"""
clock, cpu_clock, local, threads = time.perf_counter, time.thread_time, threading.local(), {}
lock = threading.Lock()

def mine():
    try:
        return local.stats
    except AttributeError:
        stats = local.stats = {"stack": [], "first": None, "last": None, "between": 0.0, "steps": 0}
        with lock:
            threads[threading.current_thread().name] = stats
        return stats

def timed(cls, name, category):
    original = getattr(cls, name)
    def wrapper(*args, **kwargs):
        stats = mine()
        stack = stats["stack"]
        stack.append([0.0, 0.0])
        start, cpu = clock(), cpu_clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent, used = clock() - start, cpu_clock() - cpu
            inner = stack.pop()
            if stats["first"] is not None:  # from the first step on (not the start-up's claims)
                stats[category] = stats.get(category, 0.0) + spent - inner[0]
                stats["cpu " + category] = stats.get("cpu " + category, 0.0) + used - inner[1]
            if stack:
                stack[-1][0] += spent
                stack[-1][1] += used
    setattr(cls, name, wrapper)

step = nrvna.LlamaSession.step
def timed_step(self):
    stats = mine()
    start = clock()
    if stats["last"] is not None:
        stats["between"] += start - stats["last"]
    if stats["first"] is None:
        stats["first"] = start
    try:
        return step(self)
    finally:
        stats["last"] = clock()
        stats["steps"] += 1
nrvna.LlamaSession.step = timed_step
timed(nrvna.LlamaSession, "step", "step loop")
timed(nrvna.LlamaSession, "_decode", "decode")
timed(nrvna._JobSampler, "sample", "sampling")
# A step's shortlists and the rows readied before the draws (where the checkout has them).
for owner, name in ((nrvna._JobSampler, "prepare"), (nrvna, "_likeliest")):
    if hasattr(owner, name):
        timed(owner, name, "sampling")
timed(nrvna._JobSampler, "accept", "sampling")
timed(nrvna._Sequence, "add", "detokenizing")
timed(nrvna.LlamaRunner, "piece", "detokenizing")
timed(nrvna._Sequence, "_emit", "emitting")
timed(nrvna.Processor, "claim", "claims")
timed(nrvna.Processor, "finish", "finishes")
cpu0 = os.times()
code = nrvna.main(["daemon", sys.argv[2], sys.argv[3], "--drain"])
cpu1 = os.times()
out = {"threads": {name: {k: v for k, v in s.items() if k != "stack"} for name, s in threads.items()},
       "cpu": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)}
with open(sys.argv[4], "w") as handle:
    json.dump(out, handle)
sys.exit(code)
"""

STEP_PARTS = ["decode", "sampling", "detokenizing", "emitting", "step loop"]
GAP_PARTS = ["claims", "finishes"]


def profiled_run(model: str, base: str, texts: list[str], tokens: int, sampling: dict, root: str = ROOT,
                 env: dict[str, str] | None = None) -> dict:
    """The jobs queued first, then drained by a profiled daemon (``env`` added to its environment):
    its profile, per token."""
    env = env or {}
    ws = tempfile.mkdtemp(dir=base)
    try:
        script = os.path.join(root, "nrvna.py")
        work = nrvna.Work(ws)
        for text in texts:
            work.publish(text, max_tokens=tokens, ignore_eos=True, **sampling)
        out = os.path.join(base, "profile.json")
        done = subprocess.run([PYTHON, "-c", PROFILED_DAEMON, script, model, ws, out], capture_output=True, text=True,
                              env={**os.environ, "NRVNA_LOG_LEVEL": "warn", **env})
        assert done.returncode == 0, done.stderr[-800:]
        with open(out) as handle:
            profile = json.load(handle)
        generated = sum(json.load(open(os.path.join(ws, nrvna.OUTPUT, name, nrvna.META_FILE)))["generated_tokens"]
                        for name in os.listdir(os.path.join(ws, nrvna.OUTPUT)))
        assert generated == len(texts) * tokens, generated
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    workers = {name: s for name, s in profile["threads"].items() if s.get("first") is not None}
    span = sum(s["last"] - s["first"] for s in workers.values())
    parts = {part: sum(s.get(part, 0.0) for s in workers.values()) for part in STEP_PARTS + GAP_PARTS}
    parts["other gaps"] = sum(s["between"] for s in workers.values()) - parts["claims"] - parts["finishes"]
    cpu = {part: sum(s.get("cpu " + part, 0.0) for s in workers.values()) for part in STEP_PARTS + GAP_PARTS}
    return {"parts": parts, "part cpu": cpu, "span": span, "tokens": generated, "workers": len(workers),
            "steps": sum(s["steps"] for s in workers.values()), "cpu": profile["cpu"],
            "wall": max(s["last"] for s in workers.values()) - min(s["first"] for s in workers.values())}


def print_profile(profile: dict) -> None:
    tokens, span = profile["tokens"], profile["span"]
    print(f"\nprofile of one nrvna run ({profile['workers']} workers, {profile['steps']} steps, "
          f"{tokens / profile['steps']:.1f} tokens a step, {tokens / profile['wall']:.0f} tok/s while profiled; "
          f"process CPU {1e6 * profile['cpu'] / tokens:.0f} us a token, start-up included)")
    cpu = profile["part cpu"]
    rows = [[part, 1e6 * seconds / tokens, f"{1e6 * cpu[part] / tokens:.1f}" if part in cpu else "",
             f"{100 * seconds / span:.1f}%"] for part, seconds in profile["parts"].items()]
    rows.append(["workers' time in all", 1e6 * span / tokens, "", "100%"])
    print(table(["part", "wall us a token", "CPU us a token", "share of the wall"], rows))


def session_host_work(model: str, shortlist: bool, seqs: int, tokens: int, penalty: float) -> tuple[float, float]:
    """One worker's session in this process, ``seqs`` jobs of ``tokens`` stepped to the end:
    (host microseconds per token, everything but llama_decode; decode microseconds per token).
    Without ``shortlist``, every draw is from the whole vocabulary, as before issue 33."""
    import threading

    size = nrvna._shortlist_size
    nrvna._shortlist_size = size if shortlist else (lambda settings: 0)
    config = nrvna.Config(max_ctx=8192, workers=1, seqs=seqs, threads=1)
    runner = session_host_work.runner = getattr(session_host_work, "runner", None) or nrvna.LlamaRunner(model, config)
    session = runner.session(0, config)
    try:
        for i in range(seqs):
            session.start(nrvna.RunningJob("1_1_1", f"Story {i}",
                                           {"max_tokens": tokens, "ignore_eos": True, "seed": i + 1,
                                                                   "repeat_penalty": penalty}, threading.Event()))
        decode, spent = session._decode, [0.0]

        def timed(ctx, batch):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            code = decode(ctx, batch)
            spent[0] += time.perf_counter() - start
            return code

        session._decode = timed
        start, generated = time.perf_counter(), 0
        while session.active():
            generated += sum(1 for seq in session.slots if seq is not None and not seq.pending)
            session.step()
        total = time.perf_counter() - start
    finally:
        session.close()
        nrvna._shortlist_size = size
    return 1e6 * (total - spent[0]) / generated, 1e6 * spent[0] / generated


def in_process(model: str, rounds: int, penalty: float) -> None:
    """The sampling change alone: one session, 16 jobs of 128 tokens, the shortlist on and off
    in alternation (no daemon, files or clients: the host work of the step loop itself)."""
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(rounds):
        for shortlist in (True, False) if r % 2 == 0 else (False, True):
            runs[shortlist].append(session_host_work(model, shortlist, 16, 128, penalty))
    print(f"machine: {machine()}; model {os.path.basename(model)}; one session in this process, 16 jobs x 128 "
          f"tokens, repeat_penalty {penalty}; {rounds} alternating rounds")
    rows = [[name, statistics.median(h for h, _ in runs[on]),
             f"{min(h for h, _ in runs[on]):.1f}-{max(h for h, _ in runs[on]):.1f}",
             statistics.median(d for _, d in runs[on])]
            for name, on in (("top_k draws from the k likeliest (now)", True),
                             ("every draw from the whole vocabulary", False))]
    print(table(["sampling", "host us a token (median)", "range", "decode us a token"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", default=default_model(),
                        help="the GGUF whose tokenizer and metadata to use")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", default="16,64", help="llama-server arms: -np N with N clients each")
    parser.add_argument("--penalty", type=float, default=1.0, help="repeat_penalty for both sides (1.0: off)")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--gguf-py", help="llama.cpp's gguf-py folder (default: the llama-server build's)")
    parser.add_argument("--model", help="use this model as it is (default: make the host-bound one from SOURCE)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--against", metavar="DIR", help="also nrvna's defaults from DIR's nrvna.py")
    parser.add_argument("--in-process", action="store_true", help="only the host work of one session, the "
                                                                   "shortlist on and off (no daemon, no server)")
    args = parser.parse_args()
    model = args.model or host_model(args.source, args.gguf_py)
    if args.in_process:
        return in_process(model, max(args.rounds, 2) * 2, args.penalty)
    binary = llama_server(args.server)
    texts = prompts(args.prompts)
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": args.penalty}
    roots = {"nrvna defaults": ROOT}
    if args.against:
        roots[f"nrvna defaults, {args.against}"] = os.path.abspath(args.against)
    servers = {f"llama-server -np {n}": int(n) for n in args.slots.split(",")}
    names = [*roots, *servers]
    runs: dict[str, list[float]] = {name: [] for name in names}
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if name in servers:
                    slots = servers[name]
                    runs[name].append(server_arm(binary, model, texts, args.tokens, slots, slots, sampling)["tok/s"])
                else:
                    daemon = Daemon(model, base, {}, root=roots[name])
                    try:
                        runs[name].append(daemon.run(texts, args.tokens, **sampling)["tok/s"])
                    finally:
                        daemon.close()
                print(f"round {r + 1}: {name} {runs[name][-1]:.0f} tok/s", file=sys.stderr)
        profile = None if args.no_profile else profiled_run(model, base, texts, args.tokens, sampling)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = [max(runs[name][r] for name in servers) for r in range(args.rounds)]
    print(f"machine: {machine()}; model {os.path.basename(model)}; {len(texts)} prompts x {args.tokens} tokens; "
          f"sampling {json.dumps(sampling)}; {args.rounds} interleaved rounds; {time.strftime('%Y-%m-%d')}")
    rows = ratio_rows(names, runs, best)
    print(table(["arm", "median tok/s", "range", "vs better llama-server, round by round", "median ratio"], rows))
    if profile is not None:
        print_profile(profile)


if __name__ == "__main__":
    main()
