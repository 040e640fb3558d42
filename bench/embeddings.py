"""Embeddings: nrvna's embed jobs against llama-server --embeddings and Llama.embed, same model,
same pooling (mean), same texts, same machine.

The texts: --texts (1,000) deterministic synthetic English-ish texts, --min-tokens to
--max-tokens (20-200) tokens each by the model's own tokenizer (special tokens included: BERT's
[CLS] and [SEP]), lengths drawn uniformly from --seed. Arms, run in --rounds interleaved rounds:

- `Llama.embed`: llama_cpp.Llama(MODEL, embedding=True, pooling_type=MEAN, n_threads=cores,
  n_threads_batch=cores, n_ctx=n_batch=n_ubatch=--llama-batch) in one process, warm (model
  loaded and a few texts embedded first), `.embed(texts, normalize=True)` over the whole list
  in one call. Llama's default n_threads is cores // 2: it is given every core here. With
  embedding=True Llama sets n_seq_max = n_batch and a unified KV cache, so embed() packs as many
  texts as fit --llama-batch tokens into each decode.
- llama-server (built by bench/build_llama_server.sh from the llama.cpp that llama-cpp-python
  vendors, unless --server) with `--embeddings --pooling mean -np N -ub U -b U -t cores -tb
  cores`, warm (one request first), fed by C concurrent HTTP clients each POSTing
  /v1/embeddings with `input` an array of 32 texts (--server-arms N:U:C,...). The best arm
  by median texts/s is the baseline. (A non-causal model needs -ub >= a text's tokens.)
- nrvna: the texts as one job each, a JSONL file of {"embed": TEXT, "custom_id": ...} lines
  queued with `nrvna.py submit WS --file F --tag T` (not timed), then `nrvna.py daemon MODEL WS
  --drain` (NRVNA_POOLING=mean, needed by SmolLM2, whose GGUF names no pooling; the same as
  MiniLM's GGUF says). Timed two ways: the daemon process from start to exit, which includes
  Python's start, the model load and the drain check ("incl. load"), and the processing alone:
  the first job's claim to the last job's finish (meta.json's started/finished). Every job
  must be done, with one vector of the model's dimensions. The "nrvna, defaults" row runs the
  plain CLI; the extra rows (--variants, e.g. BENCH_EMBED_PACK=512, NRVNA_WORKERS=1) and the
  profile run the same daemon in a child that wraps `_Embedder.step` and the decode it calls
  with timers (a perf_counter pair per decode; BENCH_EMBED_PACK sets its tokens per decode,
  nrvna's EMBED_PACK, and BENCH_FINISH_BACKLOG=0 makes every worker finish its own jobs), so
  they also report texts and tokens per
  decode, decode time per text, and a worker's time outside the decode.

Ratios in the main table are against the best llama-server arm's median and Llama.embed's
median from the same run (the median run of an arm: of two rounds, the slower), and nrvna's
defaults are also compared round by round. Correctness: the lowest cosine of each arm's
vectors against Llama.embed's over a sample of 50 texts.

The machine's other load: this host is shared, and a 2-thread llama.cpp decode slows several
fold when another process takes a core (its threads wait for each other at every barrier).
Before each arm the bench waits (up to --idle-wait seconds) until the machine has had less
than a quarter of a core busy for --quiet (10) seconds in a row; while the arm runs, a watcher
samples every 2 s the cores used by anything outside this benchmark's own process tree
(/proc/stat's busy time less the tree's CPU time). An arm beside more than --max-other cores
(0.25) of other work for two samples in a row is stopped and run again, up to --retries (2)
times; the last attempt runs to the end whatever happens, and the table shows each arm's
worst mean other load.

llama-server with -np N > 1 keeps a KV stream per slot unless given -kvu: for a causal model
(SmolLM2) its mean-pooled vectors then depend on the texts batched with them (cosine 0.96
against Llama.embed, measured; 0.9999 with -kvu or -np 1), so give SmolLM2's server arms
`:-kvu` (BERT has no KV cache: unaffected). Peak RSS comes from /usr/bin/time for nrvna's
commands and Llama.embed's process (os.wait4's would carry this process's own peak over exec)
and from VmHWM for llama-server.

Then the export's memory: --export-jobs (100,000) embed jobs are queued for real with
`submit --file` (one short text each, tagged) and finished by hand, without a model (each gets
a result.txt holding one fabricated 384-float vector line written as nrvna writes them, and a
meta.json), then `nrvna.py export WS --tag T --format openai -o FILE` and `--format f32` run,
and their peak RSS (from /usr/bin/time) and time are printed.

    python bench/embeddings.py [--model PATH] [--texts 1000] [--rounds 2] [--server PATH]
        [--server-arms 2:512:2,4:512:4,8:512:8,4:2048:4] [--llama-batch 512]
        [--variants "NRVNA_BATCH=1024;NRVNA_BATCH=2048;NRVNA_WORKERS=1"] [--variant-rounds N]
        [--profile] [--export-jobs 100000 | --no-export] [--idle-wait 300] [--quiet 10] [--max-other 0.25]
        [--retries 2] [--nrvna PATH]

Examples (both models the issue names):

    python bench/embeddings.py --model models/all-MiniLM-L6-v2-f16.gguf --profile \
        --server-arms "2:512:2,4:512:4,8:512:8,4:2048:4,8:2048:8,4:512:4:-fa off" \
        --variants "NRVNA_BATCH=1024;NRVNA_BATCH=2048;NRVNA_WORKERS=1"
    python bench/embeddings.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --no-export --profile \
        --server-arms "4:512:4:-kvu,8:512:8:-kvu,4:512:4" --variants "NRVNA_BATCH=2048;NRVNA_WORKERS=1" \
        --variant-rounds 1

(SmolLM2 embeds about 200 tokens/s on 2 cores: about 9 minutes an arm for 1,000 texts.)

--nrvna PATH runs another copy of nrvna.py (a snapshot of a commit, say) for every nrvna
command and for reading its results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from types import ModuleType
from typing import Callable

from common import LOAD_NRVNA, llama_server, machine, PYTHON, ROOT, table
from vs_llama_server import concurrently, peak_rss_mb, start_server

import nrvna

WORDS = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education river garden market bridge window letter winter summer train
harbour forest village engine signal pattern measure record season island""".split()
VERBS = """is was has makes takes finds gives tells asks works seems feels tries leaves calls keeps
brings begins shows hears plays runs moves lives believes holds writes stands loses pays meets
includes continues sets learns leads understands watches follows stops creates speaks reads spends
grows opens walks wins offers remembers considers appears buys waits serves sends expects builds
stays falls reaches remains suggests raises passes sells requires reports decides pulls""".split()
ADJECTIVES = """good new first last long great little own other old right big high different small
large next early young important few public bad same able quiet bright cold warm narrow wide
heavy simple careful strange recent certain clear common dark final free full green local
major modern natural open real red short single special strong true whole""".split()
GLUE = "the a this that every some each their our its".split()
LINKS = "and but because while although so then after before when".split()
PREPOSITIONS = "in on at with from into over under near across through behind beside".split()
PACK = 32  # texts per llama-server request
TICK = os.sysconf("SC_CLK_TCK")


# -- the machine's other load ----------------------------------------------------------------

def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK  # less idle and iowait


def wait_idle(limit: float, quiet: float, threshold: float = 0.25) -> float:
    """Wait (at most ``limit`` seconds) until the machine's busy cores have stayed below
    ``threshold`` for ``quiet`` seconds in a row, so that an arm does not start beside
    someone else's work (or in a pause between their runs); the seconds waited."""
    start = time.monotonic()
    since = start
    while time.monotonic() - start < limit:
        before = busy_seconds()
        time.sleep(1.0)
        if busy_seconds() - before >= threshold:
            since = time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return time.monotonic() - start


def tree_cpu() -> float:
    """CPU seconds used by this process, its reaped children and every live descendant."""
    me = os.times()
    total = me.user + me.system + me.children_user + me.children_system
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        used[int(entry)] = sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime
    stack = list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0.0)
        stack += children.get(pid, [])
    return total


class Aborted(Exception):
    """Other work took the machine's cores during an arm, which was stopped."""


class Watch:
    """Measures, while an arm runs, the cores used by anything outside this benchmark's own
    process tree; with ``limit``, stops the arm (``kill``) once that exceeds ``limit`` cores
    for two samples in a row (a 2-thread llama.cpp decode slows several fold beside other
    work, so such a run is worth nothing and is better stopped early)."""

    def __init__(self, limit: float | None, interval: float = 2.0) -> None:
        self.limit, self.interval = limit, interval
        self.aborted = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, kill: Callable[[], None]) -> None:
        self._kill = kill
        self._start = (time.perf_counter(), busy_seconds(), tree_cpu())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last, strikes = self._start, 0
        while not self._done.wait(self.interval):
            now = (time.perf_counter(), busy_seconds(), tree_cpu())
            other = (now[1] - last[1] - (now[2] - last[2])) / (now[0] - last[0])
            last = now
            strikes = strikes + 1 if self.limit is not None and other > self.limit else 0
            if strikes >= 2:
                self.aborted = True
                try:
                    self._kill()
                except OSError:
                    pass
                return

    def end(self) -> float:
        """Stop watching; the other work's mean cores over the whole arm."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        now = (time.perf_counter(), busy_seconds(), tree_cpu())
        return max(0.0, (now[1] - self._start[1] - (now[2] - self._start[2])) / (now[0] - self._start[0]))


# -- texts ---------------------------------------------------------------------------------

class Tokenizer:
    """The model's own tokenizer (a vocab-only llama_cpp.Llama): special tokens included, as
    nrvna, llama-server and Llama.embed add them."""

    def __init__(self, model: str) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=model, vocab_only=True, verbose=False)

    def count(self, text: str) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=True, special=False))


def sentence(rng: random.Random) -> str:
    def phrase() -> str:
        return f"{rng.choice(GLUE)} {rng.choice(ADJECTIVES) + ' ' if rng.random() < 0.5 else ''}{rng.choice(WORDS)}"

    parts = [phrase(), rng.choice(VERBS), phrase()]
    if rng.random() < 0.6:
        parts += [rng.choice(PREPOSITIONS), phrase()]
    if rng.random() < 0.4:
        parts += [rng.choice(LINKS), phrase(), rng.choice(VERBS), phrase()]
    text = " ".join(parts)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def make_texts(tokenizer: Tokenizer, count: int, seed: int, low: int, high: int) -> tuple[list[str], list[int]]:
    """``count`` texts of ``low``-``high`` tokens each (lengths drawn uniformly), with their
    token counts: a stream of sentences cut at the word where the length is reached."""
    rng = random.Random(seed)
    texts, counts = [], []
    for _ in range(count):
        target = rng.randint(low, high)
        words: list[str] = []
        while len(words) < 2 * high:
            words += sentence(rng).split()
        lo, hi = 1, len(words)  # the most words whose text is at most ``target`` tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokenizer.count(" ".join(words[:mid])) <= target:
                lo = mid
            else:
                hi = mid - 1
        while tokenizer.count(" ".join(words[:lo])) < low:
            lo += 1
        text = " ".join(words[:lo])
        texts.append(text)
        counts.append(tokenizer.count(text))
    assert all(low <= n <= high + 4 for n in counts), (min(counts), max(counts))
    return texts, counts


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# -- nrvna ---------------------------------------------------------------------------------

def load_nrvna(path: str) -> ModuleType:
    """The nrvna module at ``path`` (the repository's, or a snapshot's)."""
    if os.path.abspath(path) == os.path.abspath(nrvna.__file__):
        return nrvna
    spec = importlib.util.spec_from_file_location("nrvna_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A daemon whose embedding decodes are timed: argv NRVNA MODEL WS OUT. Each record: the
# worker thread, the step's start and end, the decode's start and end, texts and tokens in it.
PROFILED_DAEMON = LOAD_NRVNA + r"""
if os.environ.get("BENCH_EMBED_PACK"):  # a variant's tokens per embedding decode (nrvna's EMBED_PACK)
    nrvna.EMBED_PACK = int(os.environ["BENCH_EMBED_PACK"])
if os.environ.get("BENCH_FINISH_BACKLOG"):  # 0: every worker finishes its own jobs (no Finisher)
    nrvna.FINISH_BACKLOG = int(os.environ["BENCH_FINISH_BACKLOG"])
records, lock, step = [], threading.Lock(), nrvna._Embedder.step

def timed_step(self, decode):
    mark = {}
    def timed(ctx, batch):
        n = batch.n_tokens
        mark["texts"], mark["tokens"] = (batch.seq_id[n - 1][0] + 1 if n else 0), n
        mark["d0"] = time.perf_counter()
        code = decode(ctx, batch)
        mark["d1"] = time.perf_counter()
        return code
    s0 = time.perf_counter()
    ended = step(self, timed)
    s1 = time.perf_counter()
    if mark:
        with lock:
            records.append([threading.current_thread().name, s0, s1, mark["d0"], mark["d1"], mark["texts"],
                            mark["tokens"]])
    return ended

nrvna._Embedder.step = timed_step
code = nrvna.main(["daemon", sys.argv[2], sys.argv[3], "--drain"])
with open(sys.argv[4], "w") as handle:
    json.dump(records, handle)
sys.exit(code)
"""


def nrvna_arm(script: str, module: ModuleType, model: str, base: str, texts: list[str], env: dict[str, str],
              profiled: bool, sample: list[int], watch: Watch) -> dict:
    """One nrvna run: submit the texts as jobs, drain them with a fresh daemon."""
    ws = tempfile.mkdtemp(dir=base)
    try:
        lines = os.path.join(base, "texts.jsonl")
        with open(lines, "w") as handle:
            for i, text in enumerate(texts):
                handle.write(json.dumps({"embed": text, "custom_id": f"text-{i}"}) + "\n")
        done = subprocess.run([PYTHON, script, "submit", ws, "--file", lines, "--tag", "bench"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-800:]
        ids = done.stdout.split()
        assert len(ids) == len(texts), len(ids)
        profile_out = os.path.join(base, "profile.json")
        command = ([PYTHON, "-c", PROFILED_DAEMON, script, model, ws, profile_out] if profiled
                   else [PYTHON, script, "daemon", model, ws, "--drain"])
        full_env = {**os.environ, "NRVNA_LOG_LEVEL": "warn", "NRVNA_POOLING": "mean", **env}
        wall_start = time.time()
        total, rss, other, done = timed_child(command, full_env, watch)
        assert done.returncode == 0, done.stderr[-800:]
        flow = module.Flow(ws)
        started, finished, vectors, dims = [], [], {}, set()
        for i, job_id in enumerate(ids):
            job = flow.get(job_id)
            assert job.status is module.Status.Done, (job_id, job.status, job.error)
            rows = module.job_vectors(job)
            assert len(rows) == 1, len(rows)
            dims.add(len(rows[0]))
            started.append(job.meta["started"])
            finished.append(job.meta["finished"])
            if i in sample:
                vectors[i] = rows[0]
        processing = max(finished) - min(started)
        result = {"total": total, "processing": processing, "load": min(started) - wall_start,
                  "rss": rss, "other": other, "dims": dims, "vectors": vectors}
        if profiled:
            with open(profile_out) as handle:
                result["profile"] = summarize_profile(json.load(handle))
        return result
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def summarize_profile(records: list[list]) -> dict:
    """Per decode: texts, tokens, seconds; per worker: time outside the embedding step."""
    decodes = len(records)
    texts = sum(r[5] for r in records)
    tokens = sum(r[6] for r in records)
    decode_s = sum(r[4] - r[3] for r in records)
    step_s = sum(r[2] - r[1] for r in records)
    outside, span = 0.0, 0.0
    for worker in {r[0] for r in records}:
        mine = [r for r in records if r[0] == worker]
        worker_span = max(r[2] for r in mine) - min(r[1] for r in mine)
        span += worker_span
        outside += worker_span - sum(r[2] - r[1] for r in mine)
    return {"decodes": decodes, "texts/decode": texts / decodes, "tokens/decode": tokens / decodes,
            "decode ms/text": 1000 * decode_s / texts, "decode s": decode_s, "step s": step_s,
            "in step, not decode s": step_s - decode_s, "outside step s": outside, "worker span s": span,
            "workers": len({r[0] for r in records})}


# -- the baselines -------------------------------------------------------------------------

# Llama.embed in a child (so that a run beside other work can be stopped): argv MODEL N_BATCH
# THREADS TEXTS.json SAMPLE.json OUT.json; times embed() alone, after a warm-up.
LLAMA_EMBED = r"""
import json, sys, time
import llama_cpp
model, n_batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[4]) as handle:
    texts = json.load(handle)
with open(sys.argv[5]) as handle:
    sample = json.load(handle)
llm = llama_cpp.Llama(model_path=model, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                      n_threads=threads, n_threads_batch=threads, n_ctx=n_batch, n_batch=n_batch,
                      n_ubatch=n_batch, verbose=False)
llm.embed(texts[:8], normalize=True)  # warm
start = time.perf_counter()
vectors = llm.embed(texts, normalize=True)
elapsed = time.perf_counter() - start
assert len(vectors) == len(texts)
with open(sys.argv[6], "w") as handle:
    json.dump({"elapsed": elapsed, "dims": sorted({len(v) for v in vectors}),
               "vectors": {str(i): vectors[i] for i in sample}}, handle)
"""


def llama_embed_arm(model: str, texts: list[str], n_batch: int, sample: list[int], base: str, watch: Watch) -> dict:
    paths = [os.path.join(base, name) for name in ("llama-texts.json", "llama-sample.json", "llama-out.json")]
    for path, value in zip(paths, (texts, sample)):
        with open(path, "w") as handle:
            json.dump(value, handle)
    _, rss, other, done = timed_child([PYTHON, "-c", LLAMA_EMBED, model, str(n_batch), str(nrvna.cpu_count()),
                                       *paths], watch=watch)
    assert done.returncode == 0, done.stderr[-800:]
    with open(paths[2]) as handle:
        out = json.load(handle)
    return {"total": out["elapsed"], "processing": out["elapsed"], "other": other, "rss": rss,
            "dims": set(out["dims"]), "vectors": {int(i): v for i, v in out["vectors"].items()}}


def post_json(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return json.loads(response.read())


def server_arm(binary: str, model: str, texts: list[str], slots: int, ubatch: int, clients: int, flags: list[str],
               sample: list[int], watch: Watch) -> dict:
    proc, port = start_server(binary, model, slots, "--embeddings", "--pooling", "mean", "-ub", str(ubatch),
                              "-b", str(ubatch), *flags)
    try:
        post_json(port, "/v1/embeddings", {"input": texts[:PACK]})  # warm
        chunks = [list(range(i, min(i + PACK, len(texts)))) for i in range(0, len(texts), PACK)]
        vectors: dict[int, list[float]] = {}
        dims, lock = set(), threading.Lock()

        def ask(chunk: list[int]) -> None:
            try:
                reply = post_json(port, "/v1/embeddings", {"input": [texts[i] for i in chunk]})
            except OSError:
                if watch.aborted:  # the server was stopped
                    return
                raise
            data = sorted(reply["data"], key=lambda d: d["index"])
            assert len(data) == len(chunk), len(data)
            with lock:
                for i, item in zip(chunk, data):
                    dims.add(len(item["embedding"]))
                    if i in sample:
                        vectors[i] = item["embedding"]

        watch.begin(proc.kill)
        try:
            elapsed = concurrently(chunks, clients, ask)
        finally:
            other = watch.end()
        if watch.aborted:
            raise Aborted
        return {"total": elapsed, "processing": elapsed, "rss": peak_rss_mb(proc.pid), "other": other,
                "dims": dims, "vectors": vectors}
    finally:
        proc.terminate()
        proc.wait()


# -- export memory -------------------------------------------------------------------------

def timed_child(command: list[str], env: dict[str, str] | None = None, watch: Watch | None = None
                ) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Run ``command`` under /usr/bin/time: its wall seconds, peak RSS MB, the other work's
    cores meanwhile (with ``watch``, which may stop it: Aborted), and its result. (Not
    os.wait4's ru_maxrss: Linux carries a process's peak over exec, so a child forked from
    this process, which holds models, would report this process's size.)"""
    with tempfile.NamedTemporaryFile("r") as report, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", report.name, *command], env=env,
                                stdout=out, stderr=err, start_new_session=True)
        if watch is not None:
            watch.begin(lambda: os.killpg(proc.pid, signal.SIGKILL))
        try:
            proc.wait()
        except BaseException:  # this benchmark was stopped: so is its child
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            other = watch.end() if watch is not None else float("nan")
        elapsed = time.perf_counter() - start
        if watch is not None and watch.aborted:
            raise Aborted
        rss_kb = report.read().split()[-1]
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())
    return elapsed, int(rss_kb) / 1024, other, done


def run_child(*args: str) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, peak RSS MB and the result of ``python ARGS``."""
    elapsed, rss, _, done = timed_child([PYTHON, *args])
    return elapsed, rss, done


def export_memory(script: str, module: ModuleType, base: str, jobs: int, dims: int = 384) -> list[list]:
    """Queue ``jobs`` one-text embed jobs for real, finish them by hand (no model) with a
    fabricated vector each, and export them: openai and f32 (seconds, peak RSS)."""
    ws = os.path.join(base, "export-ws")
    lines = os.path.join(base, "export.jsonl")
    with open(lines, "w") as handle:
        for i in range(jobs):
            handle.write(json.dumps({"embed": f"short text number {i}", "custom_id": f"e-{i}"}) + "\n")
    submit_s, _, done = run_child(script, "submit", ws, "--file", lines, "--tag", "exp")
    assert done.returncode == 0, done.stderr[-800:]
    ids = done.stdout.decode().split()
    assert len(ids) == jobs
    rng = random.Random(7)
    raw = [rng.gauss(0, 1) for _ in range(dims)]
    norm = math.sqrt(sum(x * x for x in raw))
    line = "[" + ",".join("{:.9g}".format(x / norm) for x in raw) + "]\n"  # as nrvna writes a vector
    start = time.perf_counter()
    for job_id in ids:
        src = os.path.join(ws, module.READY, job_id)
        with open(os.path.join(src, "result.txt"), "w") as handle:
            handle.write(line)
        with open(os.path.join(src, "meta.json"), "w") as handle:
            json.dump({"id": job_id, "started": time.time(), "finished": time.time(), "finish_reason": "stop",
                       "model": "all-MiniLM-L6-v2-f16.gguf", "prompt_tokens": 7, "generated_tokens": 0,
                       "attempts": 1}, handle)
        os.rename(src, os.path.join(ws, module.OUTPUT, job_id))
    finish_s = time.perf_counter() - start
    rows = [[f"submit --file, {jobs:,} embed lines, tag (setup)", submit_s, jobs / submit_s, float("nan"), ""],
            [f"finish {jobs:,} jobs by hand (setup: fabricated {dims}-float result.txt)", finish_s, jobs / finish_s,
             float("nan"), ""]]
    for form in ("openai", "f32"):
        out = os.path.join(base, f"export.{form}")
        seconds, rss, done = run_child(script, "export", ws, "--tag", "exp", "--format", form, "-o", out)
        assert done.returncode == 0, done.stderr[-800:]
        if form == "openai":
            with open(out) as handle:
                count = sum(1 for _ in handle)
            assert count == jobs, count
            check = f"{count:,} lines, {os.path.getsize(out) / 1e6:.0f} MB"
        else:
            assert os.path.getsize(out) == jobs * dims * 4, os.path.getsize(out)
            check = f"{jobs:,} x {dims} float32, {os.path.getsize(out) / 1e6:.0f} MB"
        rows.append([f"export --tag --format {form} -o FILE", seconds, jobs / seconds, rss, check])
        os.remove(out)
    return rows


# -- main ----------------------------------------------------------------------------------

def median_run(runs: list[dict], count: int) -> dict:
    """The median run by texts/s (of an even number, the slower of the middle two)."""
    ordered = sorted(runs, key=lambda r: count / r["total"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "all-MiniLM-L6-v2-f16.gguf"))
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every arm")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--server-arms", default="2:512:2,4:512:4,8:512:8,4:2048:4",
                        help="llama-server arms as SLOTS:UBATCH:CLIENTS[:EXTRA FLAGS], comma-separated")
    parser.add_argument("--llama-batch", type=int, default=512, help="Llama.embed's n_ctx = n_batch = n_ubatch")
    parser.add_argument("--variants", default="NRVNA_BATCH=1024;NRVNA_BATCH=2048;NRVNA_WORKERS=1",
                        help="extra nrvna rows: ';'-separated, each ','-separated VAR=VALUE settings ('' for none); "
                             "nrvna=PATH runs another nrvna.py (a patched copy, say); a leading + runs "
                             "the row in every round despite --variant-rounds")
    parser.add_argument("--variant-rounds", type=int, default=99,
                        help="run the extra nrvna rows (and the profiled run) in this many rounds only")
    parser.add_argument("--profile", action="store_true", help="also a profiled run of nrvna's defaults each round")
    parser.add_argument("--export-jobs", type=int, default=100_000)
    parser.add_argument("--no-export", action="store_true", help="skip the export memory test")
    parser.add_argument("--idle-wait", type=float, default=300,
                        help="before each arm, wait up to this many seconds for the machine to be idle")
    parser.add_argument("--quiet", type=float, default=10,
                        help="seconds the machine must have been idle before an arm starts")
    parser.add_argument("--max-other", type=float, default=0.25,
                        help="an arm during which other processes used more cores than this is run again")
    parser.add_argument("--retries", type=int, default=2, help="how many times at most (the last run is kept)")
    parser.add_argument("--nrvna", default=os.path.join(ROOT, "nrvna.py"), help="the nrvna.py to run")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the workspaces
    script = os.path.abspath(args.nrvna)
    module = load_nrvna(script)
    binary = llama_server(args.server)
    tokenizer = Tokenizer(args.model)
    texts, counts = make_texts(tokenizer, args.texts, args.seed, args.min_tokens, args.max_tokens)
    del tokenizer
    tokens = sum(counts)
    sample = list(range(0, len(texts), max(1, len(texts) // 50)))

    servers = {}
    for arm in args.server_arms.split(","):
        slots, ubatch, clients, *extra = arm.split(":", 3)
        flags = extra[0].split() if extra else []
        options = "".join(" " + f for f in flags)
        name = f"llama-server -np {slots} -ub {ubatch}{options}, {clients} clients x {PACK} inputs"
        servers[name] = (int(slots), int(ubatch), int(clients), flags)
    variants, every_round = {}, set()
    for variant in filter(None, (v.strip() for v in args.variants.split(";"))):
        name = f"nrvna, {variant.lstrip('+').replace(',', ' ')}"
        variants[name] = dict(item.split("=", 1) for item in variant.lstrip("+").split(","))
        if variant.startswith("+"):
            every_round.add(name)
    llama_name = f"Llama.embed, n_batch {args.llama_batch}, {nrvna.cpu_count()} threads"
    nrvna_name = "nrvna, defaults"
    profile_name = "nrvna, defaults (profiled)"
    # nrvna's defaults between the llama-server arms, so the ratio that matters compares runs
    # minutes apart at most; Llama.embed first, the extra nrvna rows last.
    server_names = list(servers)
    half = (len(server_names) + 1) // 2
    order = [llama_name, *server_names[:half], nrvna_name, *server_names[half:], *variants]
    if args.profile:
        order.append(profile_name)
    runs: dict[str, list[dict]] = {name: [] for name in order}
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    export_rows: list[list] = []

    def run_arm(name: str, watch: Watch) -> dict:
        if name == llama_name:
            return llama_embed_arm(args.model, texts, args.llama_batch, sample, base, watch)
        if name in servers:
            return server_arm(binary, args.model, texts, *servers[name], sample, watch)
        if name in (nrvna_name, profile_name):
            return nrvna_arm(script, module, args.model, base, texts, {}, name == profile_name, sample, watch)
        settings = dict(variants[name])
        other = settings.pop("nrvna", None)
        return nrvna_arm(os.path.abspath(other) if other else script, module, args.model, base, texts, settings,
                         True, sample, watch)

    try:
        for round_no in range(args.rounds):
            for name in order:
                if ((name in variants and name not in every_round) or name == profile_name) \
                        and round_no >= args.variant_rounds:
                    continue
                for attempt in range(args.retries + 1):
                    waited = wait_idle(args.idle_wait, args.quiet)
                    began = time.perf_counter()
                    # The last attempt runs to the end whatever the other load (which it reports).
                    watch = Watch(args.max_other if attempt < args.retries else None)
                    try:
                        result = run_arm(name, watch)
                    except Aborted:
                        print(f"round {round_no + 1}: {name}: stopped after {time.perf_counter() - began:.0f} s: "
                              f"other work took over {args.max_other} cores; run again", flush=True)
                        continue
                    result["waited"] = waited
                    print(f"round {round_no + 1}: {name}: {len(texts) / result['total']:.1f} texts/s "
                          f"({time.perf_counter() - began:.0f} s; other load {result['other']:.2f} cores; "
                          f"waited {waited:.0f} s for an idle machine)", flush=True)
                    break
                runs[name].append(result)
        if not args.no_export:
            export_rows = export_memory(script, module, base, args.export_jobs)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    n = len(texts)
    dims = {d for arm in runs.values() for r in arm for d in r["dims"]}
    assert len(dims) == 1, dims
    reference = {i: v for r in runs[llama_name] for i, v in r["vectors"].items()}
    medians = {name: median_run(arm, n) for name, arm in runs.items()}
    best_server = max(server_names, key=lambda k: n / medians[k]["total"])
    server_rate = n / medians[best_server]["total"]
    llama_rate = n / medians[llama_name]["total"]

    def per_round(name: str, key: str = "total") -> str:
        ratios = [(n / runs[name][r][key]) / max(n / runs[s][r]["total"] for s in server_names)
                  for r in range(args.rounds)]
        return ", ".join(f"{x:.2f}" for x in ratios)

    rows = []
    for name in order:
        arm, median = runs[name], medians[name]
        rates = sorted(n / r["total"] for r in arm)
        is_nrvna = name.startswith("nrvna")
        cos = min(cosine(r["vectors"][i], reference[i]) for r in arm for i in sample) if name != llama_name else 1.0
        processing = n / median["processing"] if is_nrvna else float("nan")
        rows.append([name, n / median["total"], f"{rates[0]:.3g}-{rates[-1]:.3g}", tokens / median["total"],
                     processing, tokens / median["processing"] if is_nrvna else float("nan"),
                     median.get("load", float("nan")), median.get("rss", float("nan")),
                     (n / median["total"]) / server_rate, (n / median["total"]) / llama_rate,
                     processing / server_rate if is_nrvna else float("nan"),
                     processing / llama_rate if is_nrvna else float("nan"), f"{cos:.6f}",
                     max(r["other"] for r in arm)])
    print(f"machine: {machine()}; model {os.path.basename(args.model)} ({dims.pop()} dims); {n:,} texts of "
          f"{min(counts)}-{max(counts)} tokens (mean {statistics.mean(counts):.0f}, {tokens:,} in all), seed "
          f"{args.seed}")
    print(f"median of {args.rounds} interleaved rounds per arm (texts/s range across rounds alongside); "
          "nrvna 'incl. load' = daemon start to exit (Python start, model load, drain), 'processing' = first "
          "job claimed to last job finished; the baselines are warm")
    print(table(["arm", "texts/s", "texts/s range", "tokens/s", "nrvna processing texts/s", "processing tokens/s",
                 "nrvna load s", "peak RSS MB", "vs best server", "vs Llama.embed",
                 "processing vs best server", "processing vs Llama.embed", "min cosine vs Llama.embed",
                 "other load, cores (max)"], rows))
    print(f"\nbest llama-server arm: {best_server} ({server_rate:.1f} texts/s)")
    print(f"nrvna defaults vs best llama-server, round by round: incl. load {per_round(nrvna_name)}; "
          f"processing {per_round(nrvna_name, 'processing')} (target >= 1.0)")
    llama_ratios = [(n / runs[nrvna_name][r]["total"]) / (n / runs[llama_name][r]["total"]) for r in range(args.rounds)]
    print(f"nrvna defaults vs Llama.embed, round by round (incl. load): "
          f"{', '.join(f'{x:.2f}' for x in llama_ratios)} (target >= 2.0)")
    profiled = [(name, r["profile"]) for name in order for r in runs[name] if "profile" in r]
    if profiled:
        keys = ["workers", "decodes", "texts/decode", "tokens/decode", "decode ms/text", "decode s",
                "in step, not decode s", "outside step s", "worker span s"]
        print("\nprofiled nrvna runs (every round): decode = llama_decode; step = _Embedder.step (the decode, "
              "reading and writing the vectors); outside step = a worker's span minus its steps (claims, "
              "tokenizing, finishing jobs, waiting), summed over workers")
        print(table(["arm", *keys], [[name, *(p[k] for k in keys)] for name, p in profiled]))
    if export_rows:
        print()
        print(table(["export step", "seconds", "jobs/s", "peak RSS MB", "check"], export_rows))
        print("target: a 100,000-line export's peak RSS under 50 MB")


if __name__ == "__main__":
    main()
