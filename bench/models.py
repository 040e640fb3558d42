"""Several models behind one workspace: nrvna against llama-server's router mode on one batch
that interleaves three models line by line; same models, jobs, sampling and machine, model
loads counted on both sides (issue 31's benchmark).

Models: SmolLM2-135M-Instruct (chat A); chat B, by default a second file of the same weights
(the router and nrvna each load it as a model of its own, so a swap costs what a real one of
that size does), or with `--chat-b host` issue 31's own: a random-weight model of 1 layer of
width 64 with SmolLM2's vocabulary (bench/random_model.py --shape host, cached as
host_bound.py caches it), whose decode and load cost little; all-MiniLM-L6-v2 (embeddings C,
made by scripts/embed_model.py when missing). The batch:
JOBS lines per model in file order A, B, C, A, B, C, ... as OpenAI Batch lines naming their
model (nrvna gets the same jobs as its own JSONL lines, which may say ignore_eos): a chat line
generates TOKENS tokens (end-of-generation ignored, temperature 0.8, top_k 40, top_p 0.9, min_p
0.05), an embedding line embeds 2 texts.

Arms:
- llama-server in router mode: `--models-dir` holding A and B, a `--models-preset` adding C
  with `embeddings` and `pooling = mean`, `--models-max 2` and `--models-max 3`, children with
  -np 8; 8 concurrent clients send the lines in file order. Loads: the router's "spawning server
  instance" log lines.
- nrvna, one daemon serving all three: the file submitted once, then `nrvna daemon MODELS_DIR WS
  --max-loaded N --drain` with N = 1, 2 and 3 (room for one model, two, all three); it drains one
  model's backlog before it switches. Loads: the daemon's "Loading model" log lines.
- nrvna, one `--drain` daemon per model in a row (A, B, C), each loading its model once.
Every job's meta.json must name the model its line named.

    python bench/models.py [--jobs 50] [--tokens 32] [--server PATH] [--chat GGUF] [--chat-b GGUF|host]
        [--embed GGUF]
    python bench/models.py --load-ahead ROUNDS   # nrvna alone: NRVNA_LOAD_AHEAD 1 against 0,
        # room for 2 and 3 models, ROUNDS interleaved rounds (the next model loaded while one runs)

--chat and --embed replace SmolLM2 and MiniLM (bench/gpu.sh gives a random-weight model of
SmolLM2's shape, as SmolLM2 itself cannot travel there). Where NRVNA_GPU_LAYERS is set, both
sides offload those layers (the router passes -ngl to its children).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from common import gpu_offload, llama_server, machine, PYTHON, ROOT, table
from host_bound import host_model
from vs_llama_server import SAMPLING, concurrently, free_port

import nrvna

WORDS = ("river stone lantern harbor meadow copper violin orchard glacier compass ember thistle "
         "falcon quarry ribbon saddle").split()


def text(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


CHAT = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
EMBED = os.path.join(ROOT, "models", "all-MiniLM-L6-v2-f16.gguf")


def make_models(base: str, chat: str = CHAT, embed: str = EMBED, chat_b: str = "") -> dict[str, str]:
    """A models directory with chat-a.gguf, chat-b.gguf and minilm.gguf: hard links, else copies,
    of ``chat``, ``chat_b`` (default: ``chat`` again, one file each, so neither side can tell they
    hold the same weights) and ``embed``."""
    if embed == EMBED and not os.path.exists(embed):
        subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "embed_model.py")], check=True)
    folder = os.path.join(base, "models")
    os.mkdir(folder)
    paths = {}
    for name, source in (("chat-a", chat), ("chat-b", chat_b or chat), ("minilm", embed)):
        paths[name] = os.path.join(folder, f"{name}.gguf")
        try:
            os.link(source, paths[name])
        except OSError:
            shutil.copyfile(source, paths[name])
    return paths


def batch_lines(jobs: int, tokens: int) -> list[dict]:
    lines = []
    for i in range(jobs):
        for name in ("chat-a", "chat-b"):
            lines.append({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": name, "max_tokens": tokens, "ignore_eos": True, **SAMPLING,
                                   "messages": [{"role": "user", "content": f"Tell me about {text(i, 4)}."}]}})
        lines.append({"custom_id": f"minilm-{i}", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": "minilm", "input": [text(2 * i), text(2 * i + 1)]}})
    return lines


def router_arm(binary: str, paths: dict[str, str], lines: list[dict], most: int, base: str) -> dict:
    chats = os.path.join(base, f"router-{most}")
    os.mkdir(chats)
    for name in ("chat-a", "chat-b"):
        os.symlink(paths[name], os.path.join(chats, f"{name}.gguf"))
    preset = os.path.join(base, f"router-{most}.ini")
    with open(preset, "w") as handle:
        handle.write(f"version = 1\n\n[minilm]\nmodel = {paths['minilm']}\nembeddings = true\npooling = mean\n")
    port, cores = free_port(), nrvna.cpu_count()
    log_path = os.path.join(base, f"router-{most}.log")
    launched = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, "--models-dir", chats, "--models-preset", preset, "--models-max", str(most),
                                 "--host", "127.0.0.1", "--port", str(port), "-np", "8", "-c", "8192", "-t", str(cores),
                                 "-tb", str(cores), "--no-webui", *gpu_offload()], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the router did not start (see {log_path})") from None
                time.sleep(0.05)
        start = time.perf_counter() - launched
        lock, done = threading.Lock(), [0]

        def send(line: dict) -> None:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{line['url']}",
                                             data=json.dumps(line["body"]).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=900) as response:
                reply = json.loads(response.read())
            if line["url"] == "/v1/embeddings":
                assert len(reply["data"]) == 2, reply
            else:
                assert reply["usage"]["completion_tokens"] == line["body"]["max_tokens"], reply["usage"]
            with lock:
                done[0] += 1

        elapsed = concurrently(lines, 8, send)
        assert done[0] == len(lines)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with open(log_path, errors="replace") as handle:
        spawned = re.findall(r"spawning server instance with name=(\S+)", handle.read())
    return {"seconds": elapsed, "jobs/s": len(lines) / elapsed, "loads": len(spawned), "start": start,
            "by model": {name: spawned.count(name) for name in sorted(set(spawned))}}


def nrvna_arm(paths: dict[str, str], lines: list[dict], base: str, most: int = 0) -> dict:
    """``most`` > 0: one daemon serving the three models with --max-loaded ``most``; 0: one
    daemon per model, in a row."""
    ws = os.path.join(base, f"ws-{most}")
    batch = os.path.join(base, f"batch-{most}.jsonl")
    with open(batch, "w") as handle:  # the same jobs as nrvna's own lines (ignore_eos is no OpenAI field)
        for line in lines:
            body = dict(line["body"], custom_id=line["custom_id"])
            if line["url"] == "/v1/embeddings":
                body["embed"] = True
            handle.write(json.dumps(body) + "\n")
    env = {**os.environ, "NRVNA_MODELS_DIR": os.path.dirname(paths["chat-a"]), "NRVNA_LOG_LEVEL": "info"}
    os.environ["NRVNA_MODELS_DIR"] = env["NRVNA_MODELS_DIR"]  # submit resolves names as the daemons will
    start = time.perf_counter()
    ids = nrvna.Work(ws, strict_models=True).submit_file(batch)
    loads, serving = 0, 0.0
    runs = [[os.path.dirname(paths["chat-a"]), "--max-loaded", str(most)]] if most else \
        [[name] for name in ("chat-a", "chat-b", "minilm")]
    for models in runs:
        daemon = subprocess.run([PYTHON, os.path.join(ROOT, "nrvna.py"), "daemon", *models, ws, "--drain"], env=env,
                                capture_output=True, text=True)
        # Exit 1 for each daemon but the last: it stops with the next daemons' jobs queued.
        assert daemon.returncode == (0 if models is runs[-1] else 1), daemon.stderr[-2000:]
        loads += daemon.stderr.count("Loading model")
        serving += log_span(daemon.stderr, "Server started", "Queue drained")
    elapsed = time.perf_counter() - start
    flow = nrvna.Flow(ws)
    for job_id, line in zip(ids, lines):
        job = flow.get(job_id)
        assert job.status is nrvna.Status.Done, (job_id, job.error)
        assert job.meta["model"] == f"{line['body']['model']}.gguf", (job.meta["model"], line["custom_id"])
    return {"seconds": elapsed, "jobs/s": len(lines) / elapsed, "loads": loads, "serving": serving}


def load_ahead(paths: dict[str, str], lines: list[dict], base: str, rounds: int) -> None:
    """nrvna's one-daemon arms with NRVNA_LOAD_AHEAD=1 against 0, rounds interleaved, the order
    turned each round; seconds from the submit to the daemon's exit."""
    runs: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for most in (2, 3):
            for ahead in ("1", "0") if r % 2 else ("0", "1"):
                os.environ["NRVNA_LOAD_AHEAD"] = ahead
                result = nrvna_arm(paths, lines, tempfile.mkdtemp(dir=base), most)
                runs.setdefault((most, ahead), []).append(result["seconds"])
                print(f"round {r + 1}: room for {most}, NRVNA_LOAD_AHEAD={ahead}: {result['seconds']:.2f} s, "
                      f"{result['loads']} loads", file=sys.stderr)
    os.environ.pop("NRVNA_LOAD_AHEAD")
    rows = []
    for most in (2, 3):
        off, on = runs[(most, "0")], runs[(most, "1")]
        rows.append([f"room for {most}", statistics.median(off), statistics.median(on),
                     ", ".join(f"{a / b:.2f}" for a, b in zip(off, on)),
                     statistics.median(off) / statistics.median(on)])
    print(table(["nrvna, one daemon", "seconds, each model at its turn", "seconds, the next loaded ahead",
                 "speed-up, round by round", "speed-up of the medians"], rows))


def header(args: argparse.Namespace, lines: list[dict]) -> str:
    second = f"chat-b {os.path.basename(args.chat_b)}" if args.chat_b else "chat-b a second file of it"
    return (f"machine: {machine()}; GPU layers {os.environ.get('NRVNA_GPU_LAYERS', '0')}; chat model "
            f"{os.path.basename(args.chat)}, {second}; {len(lines)} lines")


def log_span(log: str, first: str, last: str) -> float:
    """Seconds between the log lines holding ``first`` and ``last`` (their timestamps)."""
    stamps = {}
    for line in log.splitlines():
        for mark in (first, last):
            if mark in line and mark not in stamps:
                stamps[mark] = time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S")) + float(line[20:24])
    return stamps[last] - stamps[first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50, help="lines per model")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per chat line")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--chat", default=CHAT, help="the chat model (chat-a, and chat-b unless --chat-b)")
    parser.add_argument("--chat-b", default="", help="chat-b's model; 'host': issue 31's 1-layer random model "
                        "with --chat's vocabulary (default: a second file of --chat)")
    parser.add_argument("--embed", default=EMBED, help="the embedding model")
    parser.add_argument("--load-ahead", type=int, metavar="ROUNDS", help="only nrvna: NRVNA_LOAD_AHEAD 1 against 0")
    args = parser.parse_args()
    binary = llama_server(args.server) if not args.load_ahead else ""
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        if args.chat_b:
            args.chat_b = os.path.abspath(host_model(args.chat, None) if args.chat_b == "host" else args.chat_b)
        paths = make_models(base, os.path.abspath(args.chat), os.path.abspath(args.embed), args.chat_b)
        lines = batch_lines(args.jobs, args.tokens)
        if args.load_ahead:
            print(f"{header(args, lines)}; {args.load_ahead} interleaved rounds")
            return load_ahead(paths, lines, base, args.load_ahead)
        arms = [(f"nrvna: one daemon, --max-loaded {most}", lambda most=most: nrvna_arm(paths, lines, base, most), "")
                for most in (1, 2, 3)]
        arms.append(("nrvna: one --drain daemon per model, in a row", lambda: nrvna_arm(paths, lines, base), ""))
        arms += [(f"llama-server router, --models-max {most}",
                  lambda most=most: router_arm(binary, paths, lines, most, base),
                  os.path.join(base, f"router-{most}.log")) for most in (2, 3)]
        results = {}
        for name, arm, log in arms:  # an arm that fails is reported and left out; the others still run
            try:
                results[name] = arm()
            except (AssertionError, RuntimeError, OSError) as exc:
                print(f"models.py: {name} failed: {exc!r}"[:3000], file=sys.stderr)
                if log and os.path.exists(log):
                    with open(log, errors="replace") as handle:
                        print(f"the end of its log:\n{handle.read()[-1500:]}", file=sys.stderr)
        if not results:
            raise SystemExit("models.py: every arm failed")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{header(args, lines)} ({args.jobs} per model: 2 chat models x {args.tokens} tokens, "
          "1 embedding model x 2 texts), interleaved line by line")
    rows = [[name, r["seconds"], r["jobs/s"], r.get("serving", r["seconds"]),
             len(lines) / r.get("serving", r["seconds"]),
             r["loads"]] for name, r in results.items()]
    print(table(["arm", "seconds", "jobs/s", "serving s", "serving jobs/s", "model loads"], rows))
    print("seconds: nrvna from the submit to the daemon's exit, its start (Python, llama.cpp, the first model)"
          " included; the router from the first request to the last reply, its start excluded.\n"
          "serving: nrvna from the daemon's 'Server started' to its 'Queue drained' (the first model's load"
          " excluded, the others' included); the router's the same as its seconds (every load included).")
    for most in (2, 3):  # the same room for models on both sides
        ours_name, theirs_name = f"nrvna: one daemon, --max-loaded {most}", f"llama-server router, --models-max {most}"
        if ours_name not in results or theirs_name not in results:
            continue
        ours, theirs = results[ours_name], results[theirs_name]
        print(f"room for {most} models: nrvna {ours['jobs/s']:.2f} jobs/s ({ours['loads']} loads) against the router's "
              f"{theirs['jobs/s']:.2f} ({theirs['loads']} loads): {ours['jobs/s'] / theirs['jobs/s']:.2f}x; serving "
              f"{len(lines) / ours['serving'] / theirs['jobs/s']:.2f}x; with the router's start ({theirs['start']:.2f} "
              "s) "
              f"counted as nrvna's is: {(theirs['seconds'] + theirs['start']) / ours['seconds']:.2f}x")
    for name, r in results.items():
        if "by model" in r:
            print(f"{name}: loads by model {r['by model']}")


if __name__ == "__main__":
    main()
