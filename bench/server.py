"""The served API (issue 58): what `nrvna serve` costs against nrvna's own clients, and what it
delivers against llama-server, on the real model (default: the SmolLM2-135M test model).

Every nrvna arm is a fresh workspace with a fresh daemon at nrvna's defaults (warm: model loaded,
one job done) and, where the API is measured, `nrvna serve WS --port P` started as the `nrvna`
command beside it; requests go through the real `openai` package. Generation is greedy
(temperature 0, a seed) with end of text HONOURED in every arm (OpenAI's bodies have no
ignore_eos): throughput is counted in the completion tokens the replies report. Where two arms
are compared they run in interleaved rounds (the order reversed every other round), and ratios
are taken round by round, from runs minutes apart at most.

  (a) batch: a 1,000-line OpenAI batch file (chat completions) through the API (files.create,
      batches.create, batches.retrieve every 0.25 s until completed, files.content of the output)
      against `nrvna submit WS --file` + `nrvna wait --tag` + `nrvna export --tag --format openai`
      of the same file, each from its start to the output file in hand. Target >= 0.95x (tok/s).
  (b) concurrent: 32 concurrent synchronous chat clients (streaming off) through `nrvna serve`
      against llama-server -np 16 (16 slots of 1,024 tokens, the same build and model as
      vs_llama_server.py; bench/build_llama_server.sh); the same prompts, the same client code.
      Target >= 1.0x (completion tok/s).
  (c) HTTP cost: one request's latency on an idle daemon through the API against Work.submit +
      Flow.wait for the same job (the same messages, parameters and priority), alternating; the difference
      of the medians, with a timing split (daemon's own end, meta.json's "finished"). Target <= 20 ms.
  (d) behind a batch: the same synchronous request on an idle daemon, then while a 2,000-line
      batch (submitted through the API) runs; the ratio of the medians, and the batch must still
      complete (every line). Target <= 2x.
  (e) memory: `nrvna serve` on a workspace of its own, started as the `nrvna` command, asked a few
      listings, then left idle: VmRSS after a minute. Target <= 50 MiB. (Runs beside the others.)

    python bench/server.py [--parts a,b,c,d,e] [--model PATH] [--rounds 2] [--lines 1000]
        [--clients 32] [--requests 64] [--pairs 20] [--backlog 2000] [--server PATH]

Needs the `openai` package and llama-cpp-python (the test setup's .venv); part (b) builds
llama-server once (cached). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Any, Optional

from common import PYTHON, ROOT, default_model, llama_server, machine, table
from inference import prompts
from vs_llama_server import Daemon, concurrently, free_port, start_server

import nrvna

# The `nrvna` command of this checkout's venv (scripts/setup.sh writes it), else nrvna.py.
_ENTRY = os.path.join(os.path.dirname(PYTHON), "nrvna")
NRVNA = [_ENTRY] if os.access(_ENTRY, os.X_OK) else [PYTHON, os.path.join(ROOT, "nrvna.py")]
PROBE = "Write one sentence about a lighthouse keeper."
TERMINAL = ("completed", "failed", "expired", "cancelled")
POLL = 0.25  # batches.retrieve's interval in the API arm


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def start_serve(ws: str, log: str, want_model: bool, command: Optional[list[str]] = None,
                env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, int]:
    """`nrvna serve WS --port P` as the `nrvna` command (or ``command``), answering /v1/models
    (listing a model where ``want_model``); (its process, its port)."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([*(command or NRVNA), "serve", ws, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env or {**os.environ, "NRVNA_LOG_LEVEL": "warn"})
    deadline = time.monotonic() + 60
    while True:
        try:
            if get_json(port, "/v1/models").get("data") or not want_model:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            with open(log, errors="replace") as handle:
                tail = handle.read()[-2000:]
            raise RuntimeError(f"nrvna serve did not come up (exit {proc.poll()}):\n{tail}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client_for(port: int, path: str = "/v1") -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}{path}", api_key="bench", max_retries=0, timeout=1800)


class Served:
    """A warm nrvna daemon at its defaults on a fresh workspace, and `nrvna serve` on it."""

    def __init__(self, model: str, base: str) -> None:
        self.daemon = Daemon(model, base, {})
        self.ws = self.daemon.ws
        try:
            self.proc, self.port = start_serve(self.ws, os.path.join(base, "serve.log"), want_model=True)
        except BaseException:
            self.daemon.close()
            raise
        self.client = client_for(self.port)
        self.model = self.client.models.list().data[0].id

    def ask(self, text: str, tokens: int, seed: int = 1) -> Any:
        return self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": text}],
                                                   max_tokens=tokens, temperature=0, seed=seed)

    def close(self) -> None:
        stop(self.proc)
        self.daemon.close()


def batch_lines(model: str, count: int, tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "messages": [{"role": "user", "content": text}],
                                         "max_tokens": tokens, "temperature": 0, "seed": i + 1}}).encode() + b"\n"
                    for i, text in enumerate(prompts(count)))


def read_output(data: bytes, count: int) -> int:
    """The completion tokens of an OpenAI batch output file, checked whole: ``count`` lines, each
    custom_id once, every response a 200."""
    seen, tokens = set(), 0
    for line in data.splitlines():
        record = json.loads(line)
        assert record["custom_id"] not in seen, record["custom_id"]
        seen.add(record["custom_id"])
        assert record["response"]["status_code"] == 200, record
        tokens += record["response"]["body"]["usage"]["completion_tokens"]
    assert seen == {f"req-{i}" for i in range(count)}, f"{len(seen)} of {count} lines in the output"
    return tokens


def run_batch(served: Served, path: str) -> tuple[Any, float]:
    """Upload ``path`` and create a batch of it; (the batch object, time.perf_counter() at the start)."""
    start = time.perf_counter()
    with open(path, "rb") as handle:
        uploaded = served.client.files.create(file=handle, purpose="batch")
    return served.client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h"), start


def until_done(served: Served, batch: Any, timeout: float = 3600) -> Any:
    deadline = time.monotonic() + timeout
    while batch.status not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after {timeout:.0f} s")
        time.sleep(POLL)
        batch = served.client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.status, batch.errors)
    return batch


# ---------------------------------------------------------------------------------------- (a)

def batch_api(model: str, base: str, path: str, count: int) -> dict:
    served = Served(model, base)
    try:
        batch, start = run_batch(served, path)
        batch = until_done(served, batch)
        data = served.client.files.content(batch.output_file_id).read()
        elapsed = time.perf_counter() - start
    finally:
        served.close()
    return {"s": elapsed, "tokens": read_output(data, count)}


def cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*NRVNA, *args], capture_output=True, env={**os.environ, "NRVNA_LOG_LEVEL": "warn"})
    assert done.returncode == 0, (args, done.returncode, done.stderr[-1000:])
    return done


def batch_cli(model: str, base: str, path: str, count: int) -> dict:
    daemon = Daemon(model, base, {})
    out, errors = os.path.join(daemon.ws, "..", "out.jsonl"), os.path.join(daemon.ws, "..", "errors.jsonl")
    try:
        start = time.perf_counter()
        cli("submit", daemon.ws, "--file", path, "--tag", "bench")
        cli("wait", daemon.ws, "--tag", "bench", "--quiet")
        cli("export", daemon.ws, "--tag", "bench", "--format", "openai", "-o", out, "--errors", errors)
        elapsed = time.perf_counter() - start
    finally:
        daemon.close()
    with open(out, "rb") as handle:
        data = handle.read()
    for name in (out, errors):
        if os.path.exists(name):
            os.remove(name)
    return {"s": elapsed, "tokens": read_output(data, count)}


def part_a(model: str, base: str, model_id: str, lines: int, tokens: int, rounds: int) -> list[str]:
    path = os.path.join(base, "batch.jsonl")
    with open(path, "wb") as handle:
        handle.write(batch_lines(model_id, lines, tokens))
    arms = {"API (files + batches + poll + content)": batch_api, "submit --file + wait + export": batch_cli}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            runs[name].append(arms[name](model, base, path, lines))
            last = runs[name][-1]
            print(f"  (a) round {r + 1} {name}: {last['s']:.1f} s, {last['tokens'] / last['s']:.1f} tok/s", flush=True)
    api, own = (runs[name] for name in arms)
    ratios = [(a["tokens"] / a["s"]) / (b["tokens"] / b["s"]) for a, b in zip(api, own)]
    rows = [[name, statistics.median(x["s"] for x in runs[name]), statistics.median(lines / x["s"] for x in runs[name]),
             statistics.median(x["tokens"] / x["s"] for x in runs[name]),
             statistics.median(x["tokens"] for x in runs[name])] for name in arms]
    return [f"(a) a {lines:,}-line batch, {tokens} tokens at most a line, {rounds} interleaved round(s)",
            table(["arm", "seconds", "lines/s", "tok/s", "completion tokens"], rows),
            f"API / submit --file, tok/s round by round: {', '.join(f'{x:.3f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.3f}x (target >= 0.95)"]


# ---------------------------------------------------------------------------------------- (b)

def concurrent_arm(client: Any, model_id: str, texts: list[str], tokens: int, clients: int) -> dict:
    latencies, generated, lock = [], [0], threading.Lock()

    def ask(text: str) -> None:
        start = time.perf_counter()
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": text}],
                                               max_tokens=tokens, temperature=0, seed=1)
        with lock:
            latencies.append(time.perf_counter() - start)
            generated[0] += reply.usage.completion_tokens

    elapsed = concurrently(texts, clients, ask)
    return {"tok/s": generated[0] / elapsed, "tokens": generated[0], "p50": statistics.median(latencies)}


def part_b(model: str, base: str, binary: str, requests: int, clients: int, tokens: int, rounds: int) -> list[str]:
    texts = prompts(requests)
    names = ["nrvna serve (defaults)", "llama-server -np 16"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name.startswith("nrvna"):
                served = Served(model, base)
                try:
                    served.ask("warm up", 8)
                    runs[name].append(concurrent_arm(served.client, served.model, texts, tokens, clients))
                finally:
                    served.close()
            else:
                proc, port = start_server(binary, model, 16)
                try:
                    client = client_for(port)
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm up"}],
                                                   max_tokens=8)
                    runs[name].append(concurrent_arm(client, "m", texts, tokens, clients))
                finally:
                    stop(proc)
            last = runs[name][-1]
            print(f"  (b) round {r + 1} {name}: {last['tok/s']:.1f} tok/s, p50 {last['p50']:.2f} s", flush=True)
    ratios = [a["tok/s"] / b["tok/s"] for a, b in zip(*(runs[name] for name in names))]
    rows = [[name, statistics.median(x["tok/s"] for x in runs[name]),
             f"{min(x['tok/s'] for x in runs[name]):.0f}-{max(x['tok/s'] for x in runs[name]):.0f}",
             statistics.median(x["p50"] for x in runs[name]), statistics.median(x["tokens"] for x in runs[name])]
            for name in names]
    return [f"(b) {clients} concurrent synchronous chat clients, {requests} requests of {tokens} tokens at most, "
            f"{rounds} interleaved round(s)",
            table(["arm", "median tok/s", "range", "p50 request s", "completion tokens"], rows),
            f"nrvna serve / llama-server -np 16, round by round: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f}x (target >= 1.0)"]


# ---------------------------------------------------------------------------------------- (c)

def newest_output(ws: str, before: set[str]) -> Optional[str]:
    fresh = set(os.listdir(os.path.join(ws, nrvna.OUTPUT))) - before
    return fresh.pop() if len(fresh) == 1 else None


def split(ws: str, job_id: Optional[str], began: float, ended: float) -> list[float]:
    """A job's timeline from its meta.json, in seconds: send to submitted, submitted to started,
    started to finished, finished to the reply in hand; its generated and computed prompt tokens."""
    meta = nrvna.Flow(ws).get(job_id).meta if job_id else {}
    times = [began, *(float(meta.get(k, "nan")) for k in ("submitted", "started", "finished")), ended]
    return [b - a for a, b in zip(times, times[1:])] + [meta.get("generated_tokens", -1),
                                                        meta.get("prompt_computed", -1)]


STEPS = ["send to submitted", "submitted to started", "started to finished", "finished to reply"]


def part_c(model: str, base: str, pairs: int, tokens: int) -> list[str]:
    served = Served(model, base)
    work, flow = nrvna.Work(served.ws), nrvna.Flow(served.ws)
    messages = [{"role": "user", "content": PROBE}]
    runs: list[list[list[float]]] = [[], []]  # per arm: [wall, *split]
    try:
        for _ in range(2):
            served.ask(PROBE, tokens)
        for i in range(2 * pairs):
            for arm in ((0, 1) if i % 2 == 0 else (1, 0)):  # ABBA
                before = set(os.listdir(os.path.join(served.ws, nrvna.OUTPUT)))
                began, start = time.time(), time.perf_counter()
                if arm == 0:
                    served.ask(PROBE, tokens)
                else:
                    result = work.submit(messages=messages, max_tokens=tokens, temperature=0, seed=1,
                                         priority=nrvna.SYNC_PRIORITY)  # as the API's job has
                    assert result.ok, result.message
                    assert flow.wait(result.id, 300) is nrvna.Status.Done
                wall, ended = time.perf_counter() - start, time.time()
                runs[arm].append([wall, *split(served.ws, newest_output(served.ws, before), began, ended)])
    finally:
        served.close()
    rows = [[name, *(f"{statistics.median(x[k] for x in arm) * 1000:.1f}" for k in range(5)),
             f"{percentile_ms([x[0] for x in arm], 90):.1f}", statistics.median(x[5] for x in arm),
             statistics.median(x[6] for x in arm)]
            for name, arm in zip(("API: chat.completions.create", "Work.submit + Flow.wait"), runs)]
    diff = (statistics.median(x[0] for x in runs[0]) - statistics.median(x[0] for x in runs[1])) * 1000
    return [f"(c) one request of {tokens} tokens at most on an idle daemon, {2 * pairs} of each, alternating (ABBA); "
            "p50 of each step (meta.json's submitted, started, finished) in ms",
            table(["arm", "wall", *STEPS, "p90 wall", "generated", "prompt computed"], rows),
            f"API - Work.submit+wait at p50: {diff:+.1f} ms (target <= 20 ms)"]


def percentile_ms(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000


# ---------------------------------------------------------------------------------------- (d)

def part_d(model: str, base: str, backlog: int, tokens: int, probes: int, probe_tokens: int,
           spacing: float) -> list[str]:
    path = os.path.join(base, "backlog.jsonl")
    served = Served(model, base)
    try:
        with open(path, "wb") as handle:
            handle.write(batch_lines(served.model, backlog, tokens))
        for _ in range(2):
            served.ask(PROBE, probe_tokens)

        steps: list[list[float]] = []  # each loaded probe's timeline (see split)

        def probe(keep: bool = False) -> float:
            began, start = time.time(), time.perf_counter()
            reply = served.ask(PROBE, probe_tokens)
            wall = time.perf_counter() - start
            if keep:
                steps.append(split(served.ws, reply.id.removeprefix("chatcmpl-"), began, time.time()))
            return wall

        idle = [probe() for _ in range(probes)]
        batch, start = run_batch(served, path)
        time.sleep(0.5)  # the first probe while the Batches thread queues the lines
        loaded = []
        for _ in range(probes):
            loaded.append(probe(keep=True))
            time.sleep(spacing)
        in_progress = served.client.batches.retrieve(batch.id)
        batch = until_done(served, in_progress)
        elapsed = time.perf_counter() - start
        counts = batch.request_counts
        rss = status_kib(served.proc.pid, "VmRSS") / 1024
    finally:
        served.close()
    ratio = statistics.median(loaded) / statistics.median(idle)
    return [f"(d) one request of {probe_tokens} tokens at most, idle and behind a {backlog:,}-line batch "
            f"({tokens} tokens at most a line), {probes} each",
            table(["", "median s", "each s"], [["idle", statistics.median(idle), ", ".join(f"{x:.2f}" for x in idle)],
                                               ["behind the batch", statistics.median(loaded),
                                                ", ".join(f"{x:.2f}" for x in loaded)]]),
            f"behind the batch, each probe's steps in ms (the first {0.5:.1f} s after batches.create, then every "
            f"{spacing:.0f} s):",
            table(STEPS, [[f"{x * 1000:.0f}" for x in row[:4]] for row in steps]),
            f"loaded / idle: {ratio:.2f}x (target <= 2); the batch: {batch.status}, {counts.completed} of "
            f"{counts.total} completed, {counts.failed} failed, {elapsed:.0f} s from upload to completed "
            f"({backlog / elapsed:.1f} lines/s, while {in_progress.request_counts.completed} were done at the last "
            f"probe); the server's VmRSS after it: {rss:.1f} MiB"]


# ---------------------------------------------------------------------------------------- (e)

# The form pip's console script runs (`nrvna = "nrvna:main"`): nrvna imported, from cached bytecode.
IMPORT = f"import sys; sys.path.insert(0, {ROOT!r}); import nrvna"
IMPORTED = [PYTHON, "-c", IMPORT + "; sys.exit(nrvna.main())"]
# The `nrvna` command's form (nrvna.py compiled as __main__), with glibc's malloc_trim(0) called once,
# 3 s after the start: how much of its memory is the compiler's, freed but kept by malloc.
TRIMMED = [PYTHON, "-c", "import ctypes, runpy, sys, threading; "
           "threading.Timer(3, ctypes.CDLL('libc.so.6').malloc_trim, (0,)).start(); "
           f"sys.argv[0] = {os.path.join(ROOT, 'nrvna.py')!r}; runpy.run_path(sys.argv[0], run_name='__main__')"]
FORMS = {"command": f"`nrvna serve` as {os.path.basename(NRVNA[0])} (the command scripts/setup.sh writes)",
         "cached": "`nrvna serve` as pip's console script runs it (nrvna imported, bytecode cached)",
         "trimmed": "as the command, with malloc_trim(0) 3 s after the start (not in nrvna.py)"}


class IdleServer:
    """`nrvna serve` on an empty workspace, asked a few listings, then left alone; its VmRSS is
    read ``idle`` seconds after the last request, whatever the other parts are doing. ``form``, a
    key of FORMS: as the `nrvna` command; as IMPORTED, with bytecode written and read (in a cache
    folder of its own); as TRIMMED."""

    def __init__(self, base: str, idle: float, form: str) -> None:
        self.ws = tempfile.mkdtemp(dir=base)
        nrvna.ensure_workspace(self.ws)
        env = {**os.environ, "NRVNA_LOG_LEVEL": "warn"}
        self.name, command = FORMS[form], {"command": None, "cached": IMPORTED, "trimmed": TRIMMED}[form]
        if form == "cached":
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(base, "pycache")
            subprocess.run([PYTHON, "-c", IMPORT], env=env, check=True)  # writes the cache
        self.proc, self.port = start_serve(self.ws, os.path.join(base, "idle.log"), False, command, env)
        self.fresh = status_kib(self.proc.pid, "VmRSS") / 1024
        client = client_for(self.port)
        try:
            for _ in range(3):
                client.models.list()
                client.files.list()
                client.batches.list()
        except BaseException:
            stop(self.proc)
            raise
        self.asked = status_kib(self.proc.pid, "VmRSS") / 1024
        self.idle = idle
        self.result: Optional[tuple[float, float]] = None
        self.timer = threading.Timer(idle, self.read)
        self.timer.start()

    def read(self) -> None:
        self.result = (status_kib(self.proc.pid, "VmRSS") / 1024, status_kib(self.proc.pid, "VmHWM") / 1024)

    def row(self) -> list[Any]:
        self.timer.join()
        self.close()
        rss, hwm = self.result or (float("nan"), float("nan"))
        return [self.name, self.fresh, self.asked, rss, hwm]

    def close(self) -> None:
        self.timer.cancel()
        stop(self.proc)


def memory_report(servers: list[IdleServer]) -> list[str]:
    idle = servers[0].idle
    return ["(e) the server's memory, on an empty workspace: VmRSS MiB (target <= 50 MiB after a minute idle)",
            table(["started", "answering", "after 9 listings", f"after {idle:.0f} s idle", "VmHWM"],
                  [server.row() for server in servers])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="a,b,c,d,e", help="which parts to run (comma-separated)")
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
                        if os.path.exists(os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
                        else default_model())
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of (a) and (b)")
    parser.add_argument("--lines", type=int, default=1000, help="(a): lines of the batch")
    parser.add_argument("--batch-tokens", type=int, default=16, help="(a), (d): max_tokens of a batch line")
    parser.add_argument("--clients", type=int, default=32, help="(b): concurrent clients")
    parser.add_argument("--requests", type=int, default=64, help="(b): requests in all")
    parser.add_argument("--tokens", type=int, default=32, help="(b): max_tokens of a request")
    parser.add_argument("--pairs", type=int, default=10, help="(c): ABBA pairs (each arm runs 2x this)")
    parser.add_argument("--probe-tokens", type=int, default=16, help="(c), (d): max_tokens of the lone request")
    parser.add_argument("--backlog", type=int, default=2000, help="(d): lines of the batch ahead")
    parser.add_argument("--probes", type=int, default=8, help="(d): requests idle and behind the batch")
    parser.add_argument("--probe-spacing", type=float, default=15.0,
                        help="(d): seconds between the requests behind the batch (the first: 0.5 s after it is made)")
    parser.add_argument("--idle", type=float, default=60.0, help="(e): seconds idle before VmRSS is read")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    binary = llama_server(args.server) if "b" in parts else ""
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    report = [f"machine: {machine()}; model {os.path.basename(args.model)}; greedy, end of text honoured; "
              f"nrvna at its defaults; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    idle: list[IdleServer] = []
    try:
        if "e" in parts:
            idle = [IdleServer(base, args.idle, form) for form in FORMS]
        model_id = os.path.splitext(os.path.basename(args.model))[0]
        if "c" in parts:
            report += part_c(args.model, base, args.pairs, args.probe_tokens)
        if "a" in parts:
            report += part_a(args.model, base, model_id, args.lines, args.batch_tokens, args.rounds)
        if "b" in parts:
            report += part_b(args.model, base, binary, args.requests, args.clients, args.tokens, args.rounds)
        if "d" in parts:
            report += part_d(args.model, base, args.backlog, args.batch_tokens, args.probes, args.probe_tokens,
                             args.probe_spacing)
        if idle:
            report += memory_report(idle)
    finally:  # what was measured is printed even when a later part fails or is interrupted
        for server in idle:
            server.close()
        shutil.rmtree(base, ignore_errors=True)
        print("\n\n".join(report))


if __name__ == "__main__":
    main()
