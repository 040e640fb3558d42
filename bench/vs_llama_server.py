"""nrvna against llama.cpp's own llama-server, on the same model, machine, prompts and number
of generated tokens per job (end-of-generation ignored in every arm), every arm warm.

Arms: sequential `llama_cpp.Llama`; nrvna with NRVNA_SEQS=1 and =8; nrvna with its defaults (and
with NRVNA_PREFIX_CACHE=0: the prompts share the chat template's default system prompt, which
nrvna computes once per context and llama-server once per slot);
llama-server -np 1 with 1 client, -np 8 with 8 concurrent clients, -np 16 with 16. Then a
lone job's latency (defaults vs NRVNA_SEQS=1, both daemons up, jobs alternating between
them after a 32-job batch each) and a shared-prefix arm (32 jobs with one 300-token system
prompt, prefix reuse on and off). An nrvna job ends at its rename into output/.
llama-server is built once from the llama.cpp sources vendored in the pinned
llama-cpp-python sdist (bench/build_llama_server.sh).

    python bench/vs_llama_server.py [--model PATH] [--prompts 32] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, Sequence

from common import default_model, gpu_offload, llama_server, machine, PYTHON, ROOT, table
from inference import prompts, sequential_llama

import nrvna

SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1}


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM")) / 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def start_server(binary: str, model: str, slots: int, *extra: str) -> tuple[subprocess.Popen, int]:
    """llama-server with ``slots`` slots of 1,024 tokens on every core, answering /health;
    (its process, its port). The caller terminates it."""
    port = free_port()
    cores = nrvna.cpu_count()
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                             "-c", str(1024 * slots), "-t", str(cores), "-tb", str(cores), "--no-webui", *gpu_offload(),
                             *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.terminate()
                proc.wait()
                raise RuntimeError("llama-server did not start") from None
            time.sleep(0.2)


def concurrently(items: list, clients: int, handle: Callable[[Any], None]) -> float:
    """``handle(item)`` for every item, from ``clients`` threads taking them in turn (as
    concurrent HTTP clients would); the seconds it took."""
    pending: queue.Queue = queue.Queue()
    for item in items:
        pending.put(item)

    def client() -> None:
        while True:
            try:
                item = pending.get_nowait()
            except queue.Empty:
                return
            handle(item)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def server_arm(binary: str, model: str, texts: list[str], tokens: int, slots: int, clients: int,
               sampling: dict = SAMPLING) -> dict:
    proc, port = start_server(binary, model, slots)
    try:
        body = {"max_tokens": tokens, "ignore_eos": True, **sampling}
        post(port, {**body, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
        latencies, generated, lock = [], [0], threading.Lock()

        def ask(text: str) -> None:
            start = time.perf_counter()
            reply = post(port, {**body, "messages": [{"role": "user", "content": text}]})
            with lock:
                latencies.append(time.perf_counter() - start)
                generated[0] += reply["usage"]["completion_tokens"]

        elapsed = concurrently(texts, clients, ask)
        assert generated[0] == tokens * len(texts), generated
        return {"tok/s": generated[0] / elapsed, "jobs/s": len(texts) / elapsed,
                "p50 s": statistics.median(latencies), "rss": peak_rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait()


class Daemon:
    """An nrvna daemon on a fresh workspace, warm (model loaded, one job done)."""

    def __init__(self, model: str, base: str, env: dict[str, str], root: str = ROOT, args: Sequence[str] = ()) -> None:
        self.ws = tempfile.mkdtemp(dir=base)
        self.proc = subprocess.Popen([PYTHON, os.path.join(root, "nrvna.py"), "daemon", model, self.ws, *args],
                                     env={**os.environ, "NRVNA_LOG_LEVEL": "warn", **env})
        self.work, self.flow = nrvna.Work(self.ws), nrvna.Flow(self.ws)
        warm = self.work.publish("warm up", max_tokens=8)
        deadline = time.monotonic() + 300
        # A daemon that exits at start (no llama-cpp-python, a bad model) fails the arm at
        # once: waiting out the timeout cost a GPU lease 300 s once (bench/README.md, On a GPU).
        while self.flow.wait(warm, 1) is not nrvna.Status.Done:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the nrvna daemon "
                                   f"{'exited' if self.proc.poll() is not None else 'did not start in 300 s'}"
                                   " (its messages are above)")

    def run(self, texts: list[str], tokens: int, each: Sequence[dict] | None = None, **params: object) -> dict:
        """The jobs of ``texts``, each with ``params`` (and ``each[i]``, if given, for the i-th)."""
        start = time.time()
        submitted = {}
        for i, text in enumerate(texts):
            own = each[i] if each else {}
            submitted[self.work.publish(text, max_tokens=tokens, ignore_eos=True, **params, **own)] = time.time()
        for job_id in submitted:
            assert self.flow.wait(job_id, 900) is nrvna.Status.Done
        # A job is done when its rename into output/ happens (which sets the directory's
        # ctime): Flow.wait's polling interval (up to 100 ms) is the client's, not nrvna's,
        # just as a llama-server client reads its reply the moment it arrives. (ctime comes
        # from the kernel's coarse clock: a few ms early at most, the same for every arm.)
        done = {job_id: os.stat(os.path.join(self.ws, nrvna.OUTPUT, job_id)).st_ctime for job_id in submitted}
        elapsed = max(done.values()) - start
        generated = sum(self.flow.get(job_id).meta["generated_tokens"] for job_id in submitted)
        assert generated == tokens * len(texts), generated
        latencies = [done[j] - t for j, t in submitted.items()]
        return {"tok/s": generated / elapsed, "jobs/s": len(texts) / elapsed,
                "p50 s": statistics.median(latencies), "rss": peak_rss_mb(self.proc.pid)}

    def lone(self, tokens: int) -> float:
        """One job alone in the queue: its latency (submit to result), seconds."""
        return self.run(["Write a short story about a lighthouse."], tokens)["p50 s"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def lone_latency(model: str, base: str, texts: list[str], tokens: int, pairs: int) -> dict:
    """A lone job's latency with the defaults against NRVNA_SEQS=1, both daemons up at once,
    each after a 32-job batch; jobs alternate between them, so each pair of runs is
    seconds apart (the host's speed drifts between minutes)."""
    daemons = [Daemon(model, base, {}), Daemon(model, base, {"NRVNA_SEQS": "1"})]
    try:
        for daemon in daemons:
            daemon.run(texts, tokens)
        times: list[list[float]] = [[], []]
        for i in range(2 * pairs):  # ABBA order: neither arm always runs first
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for arm in order:
                times[arm].append(daemons[arm].lone(tokens))
    finally:
        for daemon in daemons:
            daemon.close()
    return {"defaults": statistics.median(times[0]), "seqs1": statistics.median(times[1]),
            "pairs": [a / b for a, b in zip(times[0], times[1])]}


def against(binary: str, model: str, texts: list[str], tokens: int, rounds: int, other: str) -> None:
    """nrvna's defaults from this checkout and from ``other``, each against the better of
    llama-server -np 8 and -np 16, in interleaved rounds (each nrvna arm between the two)."""
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    arms = {"this checkout": ROOT, other: other}
    runs: dict[str, list[float]] = {name: [] for name in [*arms, "np 8", "np 16"]}
    try:
        for r in range(rounds):
            nrvna_order = list(arms) if r % 2 == 0 else list(arms)[::-1]  # neither always first
            for name in [nrvna_order[0], "np 8", nrvna_order[1], "np 16"]:
                if name.startswith("np "):
                    slots = int(name[3:])
                    runs[name].append(server_arm(binary, model, texts, tokens, slots, slots)["tok/s"])
                    continue
                daemon = Daemon(model, base, {}, root=arms[name])
                try:
                    runs[name].append(daemon.run(texts, tokens)["tok/s"])
                finally:
                    daemon.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {machine()}; model {os.path.basename(model)}; {len(texts)} prompts x {tokens} tokens; "
          f"{rounds} interleaved rounds")
    best = [max(a, b) for a, b in zip(runs["np 8"], runs["np 16"])]
    rows = []
    for name in [*arms, "np 8", "np 16"]:
        ratios = [v / b for v, b in zip(runs[name], best)]
        rows.append([f"nrvna defaults, {name}" if name in arms else f"llama-server -np {name[3:]}",
                     statistics.median(runs[name]), ", ".join(f"{x:.2f}" for x in ratios), statistics.median(ratios)])
    print(table(["arm", "median tok/s", "vs best llama-server, round by round", "median ratio"], rows))


def quick(binary: str, model: str, texts: list[str], tokens: int, rounds: int, slots: tuple[int, ...]) -> None:
    """nrvna's defaults against llama-server with each of ``slots`` (as many clients), in
    interleaved rounds: the few arms a short GPU lease has time for (bench/gpu.sh)."""
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    names = ["nrvna defaults", *(f"llama-server -np {n}" for n in slots)]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]  # no arm always first
            for name in order:
                if name.startswith("llama-server"):
                    n = int(name.rsplit(" ", 1)[1])
                    runs[name].append(server_arm(binary, model, texts, tokens, n, n))
                    continue
                daemon = Daemon(model, base, {})
                try:
                    runs[name].append(daemon.run(texts, tokens))
                finally:
                    daemon.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = [max(runs[name][r]["tok/s"] for name in names[1:]) for r in range(rounds)]
    print(f"machine: {machine()}; GPU layers {os.environ.get('NRVNA_GPU_LAYERS', '0')}; model "
          f"{os.path.basename(model)}; "
          f"{len(texts)} prompts x {tokens} tokens; {rounds} interleaved rounds")
    rows = []
    for name in names:
        tps = [run["tok/s"] for run in runs[name]]
        ratios = [v / b for v, b in zip(tps, best)]
        rows.append([name, statistics.median(tps), f"{min(tps):.0f}-{max(tps):.0f}",
                     statistics.median(run["p50 s"] for run in runs[name]), ", ".join(f"{x:.2f}" for x in ratios),
                     statistics.median(ratios)])
    print(table(["arm", "median tok/s", "range", "p50 job latency s", "vs best llama-server, round by round",
                 "median ratio"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the throughput arms")
    parser.add_argument("--against", metavar="DIR", help="only the ratio that matters, for this nrvna.py and DIR's (a "
                                                        "checkout of another commit): nrvna defaults of each against "
                                                        "llama-server -np 8 and -np 16, interleaved")
    parser.add_argument("--quick", metavar="N,N", help="only nrvna's defaults against llama-server with each of these "
                                                       "numbers of slots (and clients), interleaved (bench/gpu.sh)")
    args = parser.parse_args()
    binary = llama_server(args.server)
    texts = prompts(args.prompts)
    if args.quick:
        return quick(binary, args.model, texts, args.tokens, args.rounds, tuple(int(n) for n in args.quick.split(",")))
    if args.against:
        return against(binary, args.model, texts, args.tokens, args.rounds, os.path.abspath(args.against))
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    rows, results = [], {}
    try:
        baseline = sequential_llama(args.model, texts, args.tokens)
        results["sequential llama_cpp.Llama"] = {"tok/s": baseline, "jobs/s": baseline / args.tokens,
                                                 "p50 s": float("nan"), "rss": float("nan")}
        nrvna_arms = {"nrvna, NRVNA_SEQS=1": {"NRVNA_SEQS": "1"}, "nrvna, NRVNA_SEQS=8": {"NRVNA_SEQS": "8"},
                      "nrvna, defaults": {}, "nrvna, defaults but NRVNA_PREFIX_CACHE=0": {"NRVNA_PREFIX_CACHE": "0"}}
        server_arms = {f"llama-server -np {n}, {n} clients": n for n in (1, 8, 16)}
        runs: dict[str, list[dict]] = {name: [] for name in [*nrvna_arms, *server_arms]}  # table order
        # Run order within a round: nrvna defaults between the two batched llama-server arms,
        # so the ratio that matters compares runs seconds apart (the host's speed drifts).
        order = ["nrvna, NRVNA_SEQS=1", "llama-server -np 1, 1 clients", "llama-server -np 8, 8 clients",
                 "nrvna, defaults", "llama-server -np 16, 16 clients", "nrvna, NRVNA_SEQS=8",
                 "nrvna, defaults but NRVNA_PREFIX_CACHE=0"]
        for _ in range(args.rounds):  # interleaved rounds
            for name in order:
                if name in server_arms:
                    slots = server_arms[name]
                    runs[name].append(server_arm(binary, args.model, texts, args.tokens, slots, slots))
                    continue
                daemon = Daemon(args.model, base, nrvna_arms[name])
                try:
                    runs[name].append(daemon.run(texts, args.tokens))
                finally:
                    daemon.close()
        for name, arm in runs.items():  # the median round by tokens/s, and the spread
            ordered = sorted(arm, key=lambda r: r["tok/s"])
            results[name] = dict(ordered[len(ordered) // 2],
                                 spread=f"{ordered[0]['tok/s']:.0f}-{ordered[-1]['tok/s']:.0f}")
        best_server = max(v["tok/s"] for k, v in results.items() if k.startswith("llama-server"))
        # The same ratio per round, from runs seconds apart: less exposed to the host's drift
        # than a ratio of medians taken from different rounds.
        paired = sorted(runs["nrvna, defaults"][r]["tok/s"] /
                        max(arm[r]["tok/s"] for name, arm in runs.items() if name.startswith("llama-server"))
                        for r in range(args.rounds))
        for name, r in results.items():
            rows.append([name, r["tok/s"], r.get("spread", ""), r["jobs/s"], r["p50 s"], r["rss"],
                         r["tok/s"] / baseline,
                         r["tok/s"] / best_server])
        lone = lone_latency(args.model, base, texts, args.tokens, args.rounds)
        system = " ".join(["You answer questions about history, science and art with care and precision."] * 20)
        shared = []
        for reuse in ("1", "0"):
            daemon = Daemon(args.model, base, {"NRVNA_PREFIX_CACHE": reuse})
            try:
                shared.append(["nrvna defaults, 300-token shared system prompt, prefix reuse "
                               f"{'on' if reuse == '1' else 'off'}",
                               daemon.run(texts, args.tokens, system=system)["tok/s"]])
            finally:
                daemon.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {args.prompts} prompts x {args.tokens} tokens")
    print(f"median of {args.rounds} interleaved rounds per arm (tok/s spread across rounds alongside)")
    print(table(["arm", "tok/s", "tok/s range", "jobs/s", "p50 job latency s", "peak RSS MB", "vs sequential",
                 "vs best llama-server"], rows))
    print()
    print(table(["shared prefix arm", "tok/s", "vs reuse off"], [[n, v, v / shared[1][1]] for n, v in shared]))
    ratio = results["nrvna, defaults"]["tok/s"] / best_server
    print(f"\nlone job latency, after a 32-job batch (median of {len(lone['pairs'])} pairs run back to back): "
          f"defaults {lone['defaults']:.2f} s, NRVNA_SEQS=1 {lone['seqs1']:.2f} s; "
          f"ratio of each pair: median {statistics.median(lone['pairs']):.2f}x, "
          f"range {min(lone['pairs']):.2f}-{max(lone['pairs']):.2f}x (target <= 1.1)")
    print(f"nrvna defaults vs best llama-server arm: {ratio:.2f}x (target >= 1.1)")
    print(f"the same ratio round by round: {', '.join(f'{x:.2f}x' for x in paired)} "
          f"(median {statistics.median(paired):.2f}x)")


if __name__ == "__main__":
    main()
