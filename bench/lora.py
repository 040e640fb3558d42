"""LoRA adapters per job (issue 61): the same jobs on the base model alone and spread over two adapters,
in nrvna and in llama.cpp's own llama-server, on the same model, machine, prompts and number of
generated tokens per job (end-of-generation ignored in every arm), every arm warm.

Two test adapters for the model, "tone" and "terse", are made with `scripts/lora_model.py adapter --kind delta`
(rank 4, two seeds) in a temporary folder. The jobs are bench/inference.py's prompts; in every arm but the
first, their adapters go base / tone / terse / base / ... line by line. Arms, in this order each round:

- nrvna base: `nrvna daemon MODEL WS` at its defaults, every job on the base model;
- llama-server -np 8 with 8 concurrent clients, started with `--lora TONE --lora TERSE --lora-init-without-apply`,
  each request naming its set in full (`"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]`);
- nrvna lora: `nrvna daemon MODEL WS --lora tone=TONE --lora terse=TERSE`, a job naming its adapter with
  the job parameter `lora` = [{"name": "tone"}] (base jobs name none);
- llama-server -np 16 with 16 clients, as -np 8;
- with `--arms` naming them: llama-server -np 8 and -np 16 without adapters ("np 8 base", "np 16 base"), the same
  jobs all on the base model (llama-server's own cost of the adapters); "nrvna tone": nrvna with the adapters,
  every job on tone (the adapter's own cost in nrvna, no switch of set).

An nrvna job ends at its rename into output/ (timed from the first submit), a llama-server job when its reply
arrives. Each arm's warm-up also runs one greedy job per adapter on one prompt: the adapters are applied when
the three texts differ (printed). Targets (issue 61): nrvna lora / nrvna base >= 0.9; nrvna lora / the better
llama-server arm >= 1.5. Ratios are taken round by round; nothing is asserted.

    python bench/lora.py [--model PATH] [--prompts 96] [--tokens 64] [--rounds 1] [--skip-server] [--server PATH]
                         [--arms "nrvna base,np 8,nrvna lora,np 16"]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

from common import default_model, llama_server, machine, PYTHON, ROOT, table
from inference import prompts
from vs_llama_server import concurrently, Daemon, peak_rss_mb, post, SAMPLING, start_server

import nrvna

ADAPTERS = {"tone": 611, "terse": 612}  # name: the seed scripts/lora_model.py makes it from
CYCLE = [None, *ADAPTERS]  # the adapter of job i is CYCLE[i % 3]; None: the base model
PROBE, PROBE_TOKENS = "Name three colours.", 24  # the warm-up's greedy job, once per adapter
# The order of a round: each nrvna arm between two others; the last three (llama-server without adapters,
# nrvna with every job on one adapter: the adapter's own cost, without switches) only when --arms names them.
ARMS = ("nrvna base", "np 8", "nrvna lora", "np 16", "np 8 base", "np 16 base", "nrvna tone")
DEFAULT_ARMS = ARMS[:4]
LABELS = {"nrvna base": "nrvna defaults, base model only", "nrvna lora": "nrvna defaults, --lora x2, jobs interleaved",
          "np 8": "llama-server -np 8, 8 clients, jobs interleaved",
          "np 16": "llama-server -np 16, 16 clients, jobs interleaved",
          "np 8 base": "llama-server -np 8, 8 clients, no adapters",
          "np 16 base": "llama-server -np 16, 16 clients, no adapters",
          "nrvna tone": "nrvna defaults, --lora x2, every job on tone"}


def gguf_py() -> list[str]:
    """``--gguf-py DIR`` for scripts/lora_model.py: nothing if gguf is installed, else the gguf-py folder of the
    llama.cpp sources bench/build_llama_server.sh unpacked."""
    if importlib.util.find_spec("gguf"):
        return []
    cache = os.environ.get("NRVNA_BENCH_CACHE", os.path.expanduser("~/.cache/nrvna-bench"))
    found = sorted(glob.glob(os.path.join(cache, "llama-server-*", "src", "gguf-py")))
    if not found:
        raise SystemExit("error: no gguf package and no llama.cpp sources: pip install gguf, "
                         "or run bash bench/build_llama_server.sh")
    return ["--gguf-py", found[-1]]


def make_adapters(model: str, folder: str) -> dict[str, str]:
    """The test adapters for ``model`` in ``folder``: {name: path}."""
    paths = {}
    for name, seed in ADAPTERS.items():
        paths[name] = os.path.join(folder, f"{name}.gguf")
        subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "lora_model.py"), "adapter", model, paths[name],
                        "--kind", "delta", "--seed", str(seed), "--name", name, *gguf_py()],
                       check=True, stdout=subprocess.DEVNULL)
    return paths


def nrvna_arm(model: str, base: str, texts: list[str], tokens: int, paths: dict[str, str] | None,
              only: str | None = None) -> dict:
    """nrvna's daemon at its defaults; with ``paths``, given the adapters and the jobs spread over them (with
    ``only``, every job on that adapter)."""
    args = [arg for name, path in (paths or {}).items() for arg in ("--lora", f"{name}={path}")]
    daemon = Daemon(model, base, {}, args=args)
    try:
        names = CYCLE if paths else [None]
        probes = [{"lora": [{"name": name}]} if name else {} for name in names]
        ids = [daemon.work.publish(PROBE, max_tokens=PROBE_TOKENS, temperature=0, **probe) for probe in probes]
        for job_id in ids:
            assert daemon.flow.wait(job_id, 300) is nrvna.Status.Done, daemon.flow.get(job_id).error
        outputs = [daemon.flow.get(job_id).result for job_id in ids]
        each = [probes[i % len(probes)] for i in range(len(texts))] if paths else None
        if only:
            each = [{"lora": [{"name": only}]}] * len(texts)
        result = daemon.run(texts, tokens, each=each)  # nrvna's default sampling is SAMPLING
        return {**result, "applied": len(set(outputs)) == len(outputs) if paths else None}
    finally:
        daemon.close()


def server_lora(name: str | None) -> list[dict]:
    """A request's ``lora`` field naming its set in full: llama-server applies every adapter it was started
    with, at the scale of its ``--lora`` flag (1.0), to a request without the field or with an empty one."""
    return [{"id": i, "scale": 1.0 if adapter == name else 0.0} for i, adapter in enumerate(ADAPTERS)]


def server_arm(binary: str, model: str, texts: list[str], tokens: int, slots: int,
               paths: dict[str, str] | None) -> dict:
    """llama-server -np ``slots``, as many concurrent clients; with ``paths``, given the adapters and the jobs
    spread over them."""
    flags = [arg for path in (paths or {}).values() for arg in ("--lora", path)]
    proc, port = start_server(binary, model, slots, *flags, *(["--lora-init-without-apply"] if paths else []))
    own = (lambda name: {"lora": server_lora(name)}) if paths else (lambda name: {})
    try:
        body = {"max_tokens": tokens, "ignore_eos": True, **SAMPLING}
        probe = {"messages": [{"role": "user", "content": PROBE}], "max_tokens": PROBE_TOKENS, "temperature": 0}
        outputs = [post(port, {**probe, **own(name)})["choices"][0]["message"]["content"]
                   for name in (CYCLE if paths else [None])]
        latencies, generated, lock = [], [0], threading.Lock()

        def ask(job: tuple[str, str | None]) -> None:
            start = time.perf_counter()
            reply = post(port, {**body, "messages": [{"role": "user", "content": job[0]}], **own(job[1])})
            with lock:
                latencies.append(time.perf_counter() - start)
                generated[0] += reply["usage"]["completion_tokens"]

        jobs = [(text, CYCLE[i % len(CYCLE)]) for i, text in enumerate(texts)]
        elapsed = concurrently(jobs, slots, ask)
        assert generated[0] == tokens * len(texts), generated
        return {"tok/s": generated[0] / elapsed, "jobs/s": len(texts) / elapsed,
                "p50 s": statistics.median(latencies), "rss": peak_rss_mb(proc.pid),
                "applied": len(set(outputs)) == len(outputs) if paths else None}
    finally:
        proc.terminate()
        proc.wait()


def report(runs: dict[str, list[dict]], rounds: int) -> None:
    """The table of arms (median round by tok/s) and the two ratios of issue 61, round by round."""
    def best(names: list[str], r: int) -> float:
        return max(runs[name][r]["tok/s"] for name in names)

    rows = []
    for name, arm in runs.items():
        if not arm:
            continue
        ordered = sorted(arm, key=lambda run: run["tok/s"])
        median = ordered[len(ordered) // 2]
        rows.append([LABELS[name], median["tok/s"], f"{ordered[0]['tok/s']:.0f}-{ordered[-1]['tok/s']:.0f}",
                     median["jobs/s"], median["p50 s"], median["rss"],
                     "-" if arm[0]["applied"] is None else "yes" if all(run["applied"] for run in arm) else "NO"])
    print(table(["arm", "tok/s", "tok/s range", "jobs/s", "p50 job latency s", "peak RSS MB",
                 "adapters change the text"], rows))
    for top, bottom, label in (
            (["nrvna lora"], ["nrvna base"], "nrvna lora / nrvna base: {} (target >= 0.9)"),
            (["nrvna tone"], ["nrvna base"], "nrvna tone (every job on one adapter) / nrvna base: {}"),
            (["nrvna lora"], ["np 8", "np 16"], "nrvna lora / the better llama-server arm: {} (target >= 1.5)"),
            (["np 8", "np 16"], ["np 8 base", "np 16 base"], "llama-server, the better arm with adapters / "
                                                             "without: {}"),
            (["nrvna base"], ["np 8 base", "np 16 base"], "nrvna base / the better llama-server arm without: {}")):
        tops, bottoms = [name for name in top if runs[name]], [name for name in bottom if runs[name]]
        if tops and bottoms:
            each = [best(tops, r) / best(bottoms, r) for r in range(rounds)]
            print(label.format(f"{statistics.median(each):.2f}x, round by round {', '.join(f'{x:.2f}' for x in each)}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the arms")
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--skip-server", action="store_true", help="no llama-server arms")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"the arms to run, of {', '.join(ARMS)}")
    args = parser.parse_args()
    arms = [arm for arm in args.arms.split(",") if not (args.skip_server and arm.startswith("np "))]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arm {sorted(unknown)[0]!r}: the arms are {', '.join(ARMS)}")
    binary = "" if all(arm.startswith("nrvna") for arm in arms) else llama_server(args.server)
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {args.prompts} prompts x {args.tokens} "
          f"tokens; adapters {', '.join(ADAPTERS)} (rank 4 deltas); {args.rounds} interleaved round(s)", flush=True)
    texts = prompts(args.prompts)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    try:
        paths = make_adapters(args.model, base)
        for _ in range(args.rounds):
            for name in (arm for arm in ARMS if arm in arms):
                if name.startswith("np "):
                    slots = int(name.split()[1])
                    result = server_arm(binary, args.model, texts, args.tokens, slots,
                                        None if name.endswith(" base") else paths)
                else:
                    result = nrvna_arm(args.model, base, texts, args.tokens, None if name == "nrvna base" else paths,
                                       "tone" if name == "nrvna tone" else None)
                runs[name].append(result)
                print(f"  {name}: {result['tok/s']:.1f} tok/s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(runs, args.rounds)


if __name__ == "__main__":
    main()
