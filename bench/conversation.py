"""Conversations (issue 45): what a turn costs when its history is computed once, kept in memory,
saved on disk across a daemon's death, or computed again every turn.

Method. One conversation of T turns (default 10): a fixed system message, then user messages of
U tokens each (default 600; numbered sentences drawn from a word list, each message distinct),
every answer exactly A tokens (default 64: temperature 0, repeat penalty off, end of generation
ignored), so the last turn's prompt is about T x (U + A + 10) tokens (about 6,800 on SmolLM2,
whose training context is 8,192). Message sizes are counted with the model's own tokenizer
(llama_cpp, vocabulary only). Every nrvna daemon runs with NRVNA_SEQS=1 and NRVNA_MAX_CTX=8192 (a
sequence holds the whole conversation) and its other defaults. Arms, each on a fresh workspace:

  a. nrvna --parent chain: each turn a child of the last (its history comes from the parent), one
     warm daemon;
  b. the same chain with the daemon SIGKILLed and started again before every turn (the saved KV
     state on disk must give the history back);
  c. the whole conversation sent again each turn as one `messages` job (no parent), the state
     store off (NRVNA_CACHE_DISK=0), the daemon restarted before every turn: the baseline, a full
     recompute every turn;
  d. as c on one warm daemon (the in-memory prefix cache only);
  e. llama-server, one slot of 8,192 tokens, `cache_prompt: true`, warm: the whole conversation
     sent each turn, its slot keeping the last prompt;
  f. as e with llama-server restarted before every turn (it forgets).

A restart is never timed: a turn's clock starts when its daemon is ready (model loaded and a raw
2-token warm-up job done, so nothing in memory matches the conversation) or its server answers
/health and a warm-up. Where the store is on (a, b) the next turn waits until the state the last
turn left is written (a user's next message rarely comes within the second): the save is the
daemon's background work, and a SIGKILL during it would lose it. A turn's latency is submit to
result: an nrvna job's rename into output/ (its directory's ctime), a llama-server reply's
arrival. Prompt tokens computed come from nrvna's meta.json (`prompt_computed`, and
`prompt_reused` {memory, disk} where the daemon writes it) and llama-server's `timings.prompt_n`.
Each arm's answers are compared turn by turn with c's and with a's (a history computed in
pieces may round differently from one computed whole; one restored from disk must not differ
from one kept in memory). Rounds run the arms in turn (reversed every other round); figures are
medians over rounds, and ratios are to arm c's in the same round.

--check: issue 45's two acceptance checks instead.
  1. Turn 1 of about 7,900 prompt tokens (8-token answer); the daemon SIGKILLed once its state is
     saved; then turn 2 (a child, about 60 new tokens) on a new daemon, each round on a fresh copy
     of that workspace (so no state a later turn 2 saved helps). Against a daemon that never
     stopped: turn 2's prompt_computed <= 5% of its prompt tokens; its time to first token,
     measured as the wall time of turn 2 with max_tokens 1 (median of the rounds; on the
     never-stopped daemon turn 1 is run again, untimed, before each, to put its cells back),
     <= 1.3x the never-stopped daemon's; turn 2 with 32 tokens at temperature 0 (on the
     never-stopped daemon right after turn 1) gives the same text. For reference, turn 2 is also
     timed once on a restarted daemon with the store off (a full recompute).
  2. A batch of L lines (default 200) sharing a system prompt of about 2,000 tokens (each line its
     own short user message, 4 tokens each), run once; the daemon SIGKILLed once its states are
     written and started again; the same lines again as new jobs on the same workspace. A job
     computed the system prompt when its prompt_computed is at least the system prompt's own token
     count; in the second run that must happen at most once.

    python bench/conversation.py [--model PATH] [--turns 10] [--turn-tokens 600] [--tokens 64]
                                 [--rounds 1] [--arms abcdef] [--server PATH]
    python bench/conversation.py --check [--check-tokens 7900] [--check-rounds 3]
                                 [--prefix-tokens 2000] [--lines 200]
    smoke:  --turns 3 --turn-tokens 100 --tokens 16;  --check --check-tokens 1000 --lines 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from typing import Any, Iterator, NamedTuple, Optional

from common import PYTHON, ROOT, default_model, gpu_offload, llama_server, machine, table
from vs_llama_server import free_port

import nrvna

# Greedy and unpenalized in every arm, so nrvna and llama-server draw the same tokens and any
# difference in text is a difference in the numbers the cache gave back.
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0, "ignore_eos": True}
SYSTEM = "You are a careful assistant. Read each message and answer it briefly."
WORDS = ("river stone lamp garden window copper winter harbor meadow lantern orchard candle valley "
         "bridge market forest island cotton silver ladder kettle mirror pepper saddle thunder violet "
         "anchor barley cabin desert engine feather granite hammer ivory jacket kitchen lemon marble "
         "needle oyster pillow quarry ribbon shadow timber umbrella velvet walnut yellow zephyr basket "
         "canyon dragon falcon glacier harvest insect jungle kingdom ledger magnet nectar").split()
CTX = 8192  # SmolLM2's training context: one sequence holds the whole conversation
STATE_SUFFIX, STATE_TEMP = ".kv", ".tmp-"


class Turn(NamedTuple):
    """One job or request: its latency (s), prompt tokens, those computed (None: not reported),
    those reused from memory and from disk (None: not reported), its text, its job ID, and
    meta.json's finished - started (s; None for llama-server)."""

    latency: float
    prompt_tokens: int
    computed: Optional[int]
    memory: Optional[int]
    disk: Optional[int]
    text: str
    id: str = ""
    run: Optional[float] = None


# -- text of known token counts ----------------------------------------------------------------


class Texts:
    """Deterministic messages of a given size in the model's tokens (its vocabulary alone)."""

    def __init__(self, model: str) -> None:
        import llama_cpp

        # vocab_only loads no weights; llama.cpp still prints a context warning on fd 2.
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
                self.llama = llama_cpp.Llama(model, vocab_only=True, verbose=False)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        self.train_ctx = int(self.llama.metadata.get(f"{self.llama.metadata.get('general.architecture', 'llama')}"
                                                     ".context_length", CTX))

    def tokens(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def count(self, text: str) -> int:
        return len(self.tokens(text))

    def message(self, label: str, size: int, ask: str) -> str:
        """About ``size`` tokens: numbered sentences of random words (seeded by ``label``, so
        each label gives its own text, the same every run), cut to fit, then ``ask``."""
        budget = max(1, size - self.count(" " + ask))
        sentences = _sentences(label)
        parts: list[str] = []
        while self.count(" ".join(parts)) < budget:
            parts.extend(next(sentences) for _ in range(budget // 14 + 1))  # ~14 tokens a sentence
        cut = self.llama.detokenize(self.tokens(" ".join(parts))[:budget]).decode("utf-8", "ignore").strip()
        return f"{cut} {ask}"


def _sentences(label: str) -> Iterator[str]:
    rng = random.Random(label)  # a str seed is hashed (sha512): the same words on every run
    number = 0
    while True:
        number += 1
        yield f"{label}, sentence {number}: the " + " ".join(rng.choice(WORDS) for _ in range(8)) + "."


def conversation(texts: Texts, turns: int, size: int) -> list[str]:
    return [texts.message(f"Message {i + 1}", size, f"In one line: what does message {i + 1} mention first?")
            for i in range(turns)]


# -- saved states on disk ----------------------------------------------------------------------


def states_folder(ws: str) -> str:
    return os.environ.get("NRVNA_CACHE_DIR") or os.path.join(ws, "states")


def saved_states(ws: str) -> dict[str, int]:
    """The workspace's saved state files and their sizes ({} while the store is absent)."""
    try:
        with os.scandir(states_folder(ws)) as entries:
            return {e.name: e.stat().st_size for e in entries if e.name.endswith(STATE_SUFFIX)
                    and not e.name.startswith(".")}
    except OSError:
        return {}


def saving(ws: str) -> bool:
    try:
        return any(name.startswith(STATE_TEMP) for name in os.listdir(states_folder(ws)))
    except OSError:
        return False


def min_state_tokens() -> int:
    """NRVNA_CACHE_MIN_TOKENS as the daemon reads it (0 where this nrvna.py has no such setting)."""
    try:
        return int(nrvna.setting_default("cache_min_tokens"))
    except (AttributeError, KeyError, ValueError, TypeError):
        return 0


def settle(ws: str, before: dict[str, int], limit: float, tokens: int) -> bool:
    """Wait until the state a job of ``tokens`` tokens left is written: the state files differ
    from ``before``, no temporary is being written, and nothing changed for 0.3 s. False after
    ``limit`` seconds without one (no store, or it kept nothing); no wait for a job shorter
    than the smallest state saved. Not timed: it stands for the pause before a user's next turn."""
    if tokens < min_state_tokens():
        return False
    deadline = time.monotonic() + limit
    last, since = saved_states(ws), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = saved_states(ws)
        if now != last:
            last, since = now, time.monotonic()
        elif last != before and not saving(ws) and time.monotonic() - since >= 0.3:
            return True
    return False


# -- nrvna and llama-server ----------------------------------------------------------------------


class Daemon:
    """An nrvna daemon on ``ws``, ready when built: its model loaded and a raw 2-token warm-up job
    done (raw, so that no cell of it matches a chat prompt)."""

    def __init__(self, model: str, ws: str, env: dict[str, str]) -> None:
        self.ws = ws
        self.proc = subprocess.Popen([PYTHON, os.path.join(ROOT, "nrvna.py"), "daemon", model, ws],
                                     env={**os.environ, "NRVNA_LOG_LEVEL": "warn", **env})
        self.work, self.flow = nrvna.Work(ws), nrvna.Flow(ws)
        try:
            self.turn("warm up", raw=True, max_tokens=2, temperature=0.0)
        except BaseException:
            self.kill()
            raise

    def turn(self, prompt: str, limit: float = 1800, **params: Any) -> Turn:
        """One job, waited for; its figures. Raises naming the job's error if it failed."""
        start = time.time()
        job_id = self.work.publish(prompt, **params)
        deadline = time.monotonic() + limit
        while (state := self.flow.wait(job_id, 1)) not in (nrvna.Status.Done, nrvna.Status.Failed):
            if self.proc.poll() is not None:  # an exit at start (bad model, no llama_cpp) fails at once
                raise RuntimeError(f"the nrvna daemon exited ({self.proc.returncode}) before job {job_id} ended")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not end in {limit:.0f} s")
        job = self.flow.get(job_id)
        if state is nrvna.Status.Failed:
            raise RuntimeError(f"job {job_id} failed: {(job.error or '').strip()}")
        # The job ended at its rename into output/ (the directory's ctime, from the kernel's
        # coarse clock: a few ms early at most): Flow.wait's polling is the client's, not nrvna's.
        end = os.stat(os.path.join(self.ws, nrvna.OUTPUT, job_id)).st_ctime
        meta = job.meta
        reused = meta.get("prompt_reused") or {}
        run = meta["finished"] - meta["started"] if "started" in meta and "finished" in meta else None
        return Turn(end - start, int(meta.get("prompt_tokens") or 0), meta.get("prompt_computed"),
                    reused.get("memory"), reused.get("disk"), job.result or "", job_id, run)

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing flushed; the next daemon recovers the workspace."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


class Server:
    """llama-server with one slot of ``ctx`` tokens on every core, ready when built (answers
    /health and a raw warm-up completion)."""

    def __init__(self, binary: str, model: str, ctx: int) -> None:
        self.port = free_port()
        cores = nrvna.cpu_count()
        self.proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
                                      "-c", str(ctx), "-t", str(cores), "-tb", str(cores), "--no-webui",
                                      *gpu_offload()],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.2)
        _post(self.port, "/completion", {"prompt": "warm up", "n_predict": 2, "temperature": 0.0})

    def turn(self, messages: list[dict[str, str]], tokens: int) -> Turn:
        start = time.perf_counter()
        reply = _post(self.port, "/v1/chat/completions",
                      {"messages": messages, "max_tokens": tokens, "cache_prompt": True, **GREEDY})
        latency = time.perf_counter() - start
        timings = reply.get("timings", {})
        return Turn(latency, reply["usage"]["prompt_tokens"], timings.get("prompt_n"), timings.get("cache_n"), None,
                    reply["choices"][0]["message"]["content"] or "")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# -- the conversation arms -----------------------------------------------------------------------

ARMS = {
    "a": "nrvna --parent, warm daemon",
    "b": "nrvna --parent, SIGKILL + restart each turn",
    "c": "nrvna resend, store off, restart each turn",
    "d": "nrvna resend, store off, warm daemon",
    "e": "llama-server cache_prompt, warm",
    "f": "llama-server, restarted each turn",
}
BASELINE = "c"


# --defaults (issue 60): check 1's daemons at nrvna's defaults (no NRVNA_SEQS, NRVNA_MAX_CTX auto).
AT_DEFAULTS = False


def conversation_env(store: bool) -> dict[str, str]:
    env = {} if AT_DEFAULTS else {"NRVNA_SEQS": "1", "NRVNA_MAX_CTX": str(CTX)}
    if not store:
        env["NRVNA_CACHE_DISK"] = "0"
    return env


def nrvna_arm(arm: str, model: str, base: str, messages: list[str], tokens: int, state_wait: float) -> list[Turn]:
    """One conversation through nrvna: chained by parent (a, b) or resent whole (c, d)."""
    chained, restart, store = arm in "ab", arm in "bc", arm in "ab"
    env = conversation_env(store)
    ws = tempfile.mkdtemp(dir=base)
    history = [{"role": "system", "content": SYSTEM}]
    turns: list[Turn] = []
    daemon = None
    try:
        for message in messages:
            if daemon is None:
                daemon = Daemon(model, ws, env)  # ready before the turn's clock starts
            before = saved_states(ws)
            if chained:
                link = {"parent": turns[-1].id} if turns else {"system": SYSTEM}
                turn = daemon.turn(message, max_tokens=tokens, **GREEDY, **link)
            else:
                asked = [*history, {"role": "user", "content": message}]
                turn = daemon.turn(nrvna.render_messages(asked), messages=asked, max_tokens=tokens, **GREEDY)
            turns.append(turn)
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": turn.text}]
            if store:
                settle(ws, before, state_wait, turn.prompt_tokens + tokens)
            if restart:
                daemon.kill()
                daemon = None
    finally:
        if daemon is not None:
            daemon.close()
        shutil.rmtree(ws, ignore_errors=True)
    return turns


def server_arm(arm: str, binary: str, model: str, messages: list[str], tokens: int) -> list[Turn]:
    """One conversation through llama-server, the whole of it sent each turn (e warm, f restarted)."""
    history = [{"role": "system", "content": SYSTEM}]
    turns: list[Turn] = []
    server = None
    try:
        for message in messages:
            if server is None:
                server = Server(binary, model, CTX)
            history.append({"role": "user", "content": message})
            turns.append(server.turn(history, tokens))
            history.append({"role": "assistant", "content": turns[-1].text})
            if arm == "f":
                server.close()
                server = None
    finally:
        if server is not None:
            server.close()
    return turns


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cell(value: Optional[float], digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def run_conversation(args: argparse.Namespace, texts: Texts) -> None:
    arms = [a for a in args.arms if a in ARMS]
    if BASELINE not in arms:
        raise SystemExit(f"--arms must include {BASELINE} (the baseline)")
    messages = conversation(texts, args.turns, args.turn_tokens)
    estimate = texts.count(SYSTEM) + sum(texts.count(m) + args.tokens + 12 for m in messages) + 8
    if estimate > CTX:
        raise SystemExit(f"the conversation would reach about {estimate:,} tokens; a sequence holds {CTX:,}: "
                         "fewer --turns or smaller --turn-tokens or --tokens")
    binary = llama_server(args.server) if set(arms) & {"e", "f"} else ""
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    runs: dict[str, list[list[Turn]]] = {a: [] for a in arms}
    try:
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:  # no arm always first
                if arm in "ef":
                    runs[arm].append(server_arm(arm, binary, args.model, messages, args.tokens))
                else:
                    runs[arm].append(nrvna_arm(arm, args.model, base, messages, args.tokens, args.state_wait))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    last = runs[BASELINE][0][-1].prompt_tokens + args.tokens
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {args.turns} turns, user messages of "
          f"{args.turn_tokens} tokens, answers of {args.tokens} (temperature 0, end of generation ignored); "
          f"the conversation ends at {last:,} tokens (arm {BASELINE}); {args.rounds} round(s), medians")
    print("arms: " + "; ".join(f"{a}: {ARMS[a]}" for a in arms))
    print("\nturn latency, s (submit to result; restarts not counted)")
    rows = []
    for t in range(args.turns):
        rows.append([t + 1, runs[BASELINE][0][t].prompt_tokens,
                     *(_cell(_median([run[t].latency for run in runs[a]]), 2) for a in arms)])
    print(table(["turn", f"prompt tokens ({BASELINE})", *arms], rows))
    print("\nprompt tokens computed (memory / disk reused, where reported), first round")
    rows = []
    for t in range(args.turns):
        cells = []
        for a in arms:
            turn = runs[a][0][t]
            reuse = "" if turn.memory is None and turn.disk is None else f" ({_cell(turn.memory)} / {_cell(turn.disk)})"
            cells.append(_cell(turn.computed) + reuse)
        rows.append([t + 1, *cells])
    print(table(["turn", *arms], rows))
    print(f"\nper arm; ratios to arm {BASELINE} in the same round")
    rows = []
    for a in arms:
        totals = [sum(t.latency for t in run) for run in runs[a]]
        base_totals = [sum(t.latency for t in run) for run in runs[BASELINE]]
        ratios = [x / b for x, b in zip(totals, base_totals)]
        lasts = [run[-1].latency / b[-1].latency for run, b in zip(runs[a], runs[BASELINE])]
        first = runs[a][0]
        computed = [t.computed for t in first]
        disk = [t.disk for t in first if t.disk is not None]
        same = sum(x.text == y.text for x, y in zip(first, runs[BASELINE][0]))
        # Against a's too: a history computed in pieces rounds differently in the last bits from
        # one computed whole (bench/README.md, Reproducibility), so a small model's greedy text
        # may part from c's; a state restored from disk (b) must give a's exactly.
        same_a = sum(x.text == y.text for x, y in zip(first, runs["a"][0])) if "a" in runs else None
        rows.append([f"{a}: {ARMS[a]}", f"{statistics.median(totals):.2f}", f"{min(totals):.2f}-{max(totals):.2f}",
                     ", ".join(f"{x:.2f}" for x in ratios), f"{statistics.median(ratios):.2f}",
                     f"{_median([run[-1].latency for run in runs[a]]):.2f}", f"{statistics.median(lasts):.2f}",
                     "—" if None in computed else f"{sum(computed):,}", f"{sum(disk):,}" if disk else "—",
                     f"{same}/{args.turns}", "—" if same_a is None else f"{same_a}/{args.turns}"])
    print(table(["arm", "total s", "range", f"vs {BASELINE}, round by round", f"median vs {BASELINE}",
                 "last turn s", f"last turn vs {BASELINE}", "prompt computed", "from disk", f"text = {BASELINE}'s",
                 "text = a's"], rows))


# -- the acceptance checks -----------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def check_restore(args: argparse.Namespace, texts: Texts, base: str) -> list[list[str]]:
    """Check 1: turn 2 of a conversation of about --check-tokens after a SIGKILL (see the docstring)."""
    env = conversation_env(True)
    first = texts.message("Document", args.check_tokens - texts.count(SYSTEM) - 12,
                          "Summarise the document in one line.")
    second = texts.message("Follow-up", 40, "Which sentence came first?")
    turn1 = dict(system=SYSTEM, max_tokens=args.check_answer, **GREEDY)
    killed_ws = tempfile.mkdtemp(dir=base)
    daemon = Daemon(args.model, killed_ws, env)
    before = saved_states(killed_ws)
    try:
        t1 = daemon.turn(first, **turn1)
        saved = settle(killed_ws, before, args.state_wait, t1.prompt_tokens + args.check_answer)
    finally:
        daemon.kill()
    print(f"turn 1: {t1.prompt_tokens:,} prompt tokens, {args.check_answer}-token answer; state saved before the "
          f"SIGKILL: {'yes' if saved else 'none seen'} ({len(saved_states(killed_ws))} state files)")

    def restarted(tokens: int, store: bool = True) -> Turn:
        """Turn 2 on a new daemon over a fresh copy of the killed workspace (its states as the
        killed daemon left them, and nothing a later turn 2 saved)."""
        ws = tempfile.mkdtemp(dir=base)
        shutil.copytree(killed_ws, ws, symlinks=True, dirs_exist_ok=True)
        fresh = Daemon(args.model, ws, conversation_env(store))
        try:
            return fresh.turn(second, parent=t1.id, max_tokens=tokens, **GREEDY)
        finally:
            fresh.kill()
            shutil.rmtree(ws, ignore_errors=True)

    warm_ws = tempfile.mkdtemp(dir=base)
    warm = Daemon(args.model, warm_ws, env)
    killed: list[Turn] = []
    kept: list[Turn] = []
    try:
        w1 = warm.turn(first, **turn1)
        # The text first, right after turn 1, as a conversation goes on when nothing stops it:
        # running turn 1 again before it would recompute turn 1's last prompt token alone, and
        # a batch of another size rounds differently in the last bits (bench/README.md,
        # Reproducibility), which can change a greedy token of a small model.
        text_kept = warm.turn(second, parent=w1.id, max_tokens=args.check_text_tokens, **GREEDY).text
        for r in range(args.check_rounds):
            for which in ("kept", "killed") if r % 2 == 0 else ("killed", "kept"):
                if which == "kept":
                    warm.turn(first, **turn1)  # untimed: turn 1's cells (prompt and answer) back in the context
                    kept.append(warm.turn(second, parent=w1.id, max_tokens=1, **GREEDY))
                else:
                    killed.append(restarted(1))
    finally:
        warm.close()
    text_killed = restarted(args.check_text_tokens).text
    recompute = restarted(1, store=False)  # the reference: what the store saves after a restart

    worst = max(killed, key=lambda t: (t.computed if t.computed is not None else t.prompt_tokens) / t.prompt_tokens)
    share = (worst.computed if worst.computed is not None else worst.prompt_tokens) / worst.prompt_tokens
    ttft_killed, ttft_kept = statistics.median(t.latency for t in killed), statistics.median(t.latency for t in kept)
    run_killed, run_kept = _median([t.run for t in killed]), _median([t.run for t in kept])
    disk = _median([t.disk for t in killed])
    print(f"turn 2: {worst.prompt_tokens:,} prompt tokens; after the SIGKILL computed "
          f"{', '.join(_cell(t.computed) for t in killed)} (from disk {', '.join(_cell(t.disk) for t in killed)}); "
          f"never stopped computed {', '.join(_cell(t.computed) for t in kept)}")
    print("turn 2 with max_tokens 1, wall s per round: after the SIGKILL "
          f"{', '.join(f'{t.latency:.3f}' for t in killed)}; "
          f"never stopped {', '.join(f'{t.latency:.3f}' for t in kept)}")
    print(f"turn 1's answer equal on both daemons: {'yes' if w1.text == t1.text else 'NO'}")
    return [
        ["turn 2's prompt_computed after SIGKILL + restart (worst round)",
         f"{_cell(worst.computed)} of {worst.prompt_tokens:,} ({100 * share:.1f}%; from disk {_cell(disk)})", "<= 5%",
         _verdict(share <= 0.05)],
        [f"turn 2's time to first token (wall of turn 2 with max_tokens 1, median of {args.check_rounds})",
         f"{ttft_killed:.3f} s vs {ttft_kept:.3f} s never stopped ({ttft_killed / ttft_kept:.2f}x; meta finished - "
         f"started {_cell(run_killed, 3)} vs {_cell(run_kept, 3)} s; restarted with the store off, computing all "
         f"{recompute.prompt_tokens:,}: {recompute.latency:.3f} s)", "<= 1.3x",
         _verdict(ttft_killed <= 1.3 * ttft_kept)],
        [f"turn 2's text ({args.check_text_tokens} tokens, temperature 0) equals the never-stopped daemon's",
         "equal" if text_killed == text_kept else f"differs: {text_killed[:60]!r} vs {text_kept[:60]!r}", "equal",
         _verdict(text_killed == text_kept)],
    ]


def check_batch(args: argparse.Namespace, texts: Texts, base: str) -> list[list[str]]:
    """Check 2: a batch sharing a long system prompt, run, daemon killed and restarted, run again."""
    system = texts.message("Guide", args.prefix_tokens, "Answer every line in one word.")
    prefix = texts.count(system)
    lines = [f"Line {i}: in one word, what colour is a {WORDS[i % len(WORDS)]} {WORDS[(7 * i + 3) % len(WORDS)]}?"
             for i in range(args.lines)]
    # Every job must fit its sequence: NRVNA_MAX_CTX is 8 sequences of the longest job, rounded
    # up to 256 (a job may hold NRVNA_MAX_CTX / min(NRVNA_SEQS, 8) tokens), other settings default.
    need = -(-(prefix + max(texts.count(line) for line in lines) + 32 + args.line_tokens) // 256) * 256
    env = {"NRVNA_MAX_CTX": str(8 * need)}
    ws = tempfile.mkdtemp(dir=base)
    params = dict(system=system, max_tokens=args.line_tokens, **GREEDY)
    results = []
    for run in (1, 2):
        daemon = Daemon(args.model, ws, env)
        try:
            before = saved_states(ws)
            start = time.time()
            ids = [daemon.work.publish(line, **params) for line in lines]
            for job_id in ids:
                state = daemon.flow.wait(job_id, 3600)
                if state is not nrvna.Status.Done:
                    raise RuntimeError(f"batch job {job_id}: {state}")
            elapsed = max(os.stat(os.path.join(ws, nrvna.OUTPUT, j)).st_ctime for j in ids) - start
            metas = [daemon.flow.get(j).meta for j in ids]
            if run == 1:
                settle(ws, before, args.state_wait, prefix)
        finally:
            daemon.kill()
        computed = [m.get("prompt_computed") for m in metas]
        reused = [m.get("prompt_reused") or {} for m in metas]
        results.append([run, len(ids), f"{elapsed:.1f}", f"{sum(m['prompt_tokens'] for m in metas):,}",
                        "—" if None in computed else f"{sum(computed):,}",
                        f"{sum(r.get('memory', 0) for r in reused):,}" if any(reused) else "—",
                        f"{sum(r.get('disk', 0) for r in reused):,}" if any(reused) else "—",
                        "—" if None in computed else sum(c >= prefix for c in computed),
                        f"{sum(saved_states(ws).values()) / 1e6:.0f} MB in {len(saved_states(ws))}"])
    print(f"\nbatch: {args.lines} lines, system prompt {prefix:,} tokens (its text alone), {args.line_tokens} tokens "
          "each; "
          f"NRVNA_MAX_CTX={8 * need}, other settings default; SIGKILL and restart between the runs")
    print(table(["run", "jobs", "s", "prompt tokens", "computed", "from memory", "from disk",
                 "jobs that computed the system prompt", "states on disk after"], results))
    times = results[1][7]
    return [[f"second run: jobs that computed the {prefix:,}-token system prompt", str(times), "<= 1",
             "FAIL" if times == "—" else _verdict(times <= 1)]]


def run_checks(args: argparse.Namespace, texts: Texts) -> None:
    if args.check_tokens + 40 + args.check_answer + args.check_text_tokens + 40 > CTX:
        raise SystemExit(f"--check-tokens {args.check_tokens} leaves no room for turn 2 in {CTX:,} tokens")
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    form = "nrvna's defaults" if AT_DEFAULTS else f"NRVNA_SEQS=1, NRVNA_MAX_CTX={CTX}"
    print(f"machine: {machine()}; model {os.path.basename(args.model)}; {form} for check 1")
    try:
        rows = check_restore(args, texts, base)
        if not AT_DEFAULTS:  # check 2 sets NRVNA_MAX_CTX itself
            rows += check_batch(args, texts, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(table(["criterion (issue 45)", "figure", "limit", "result"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=600, help="tokens of each user message")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every arm, in turn")
    parser.add_argument("--arms", default="abcdef", help=f"which arms, of {''.join(ARMS)} (c, the baseline, always)")
    parser.add_argument("--state-wait", type=float, default=10.0,
                        help="seconds to wait for a turn's saved state before going on (untimed)")
    parser.add_argument("--check", action="store_true", help="issue 45's two acceptance checks instead")
    parser.add_argument("--defaults", action="store_true",
                        help="check 1 alone, every daemon at nrvna's defaults (issue 60: NRVNA_MAX_CTX auto)")
    parser.add_argument("--check-tokens", type=int, default=7900, help="check 1: turn 1's prompt tokens")
    parser.add_argument("--check-answer", type=int, default=8, help="check 1: turn 1's answer tokens")
    parser.add_argument("--check-text-tokens", type=int, default=32, help="check 1: turn 2's tokens for the text")
    parser.add_argument("--check-rounds", type=int, default=3, help="check 1: turn 2 measurements on each daemon")
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="check 2: the shared system prompt's tokens")
    parser.add_argument("--lines", type=int, default=200, help="check 2: lines per run")
    parser.add_argument("--line-tokens", type=int, default=4, help="check 2: tokens each line generates")
    args = parser.parse_args()
    global AT_DEFAULTS
    AT_DEFAULTS = args.defaults
    if not args.model:
        raise SystemExit("no model: give --model PATH (or run the quick start, which fetches SmolLM2)")
    texts = Texts(args.model)
    if texts.train_ctx < CTX:
        print(f"note: the model's training context is {texts.train_ctx:,} tokens, less than the {CTX:,} used here")
    if args.check:
        run_checks(args, texts)
    else:
        run_conversation(args, texts)


if __name__ == "__main__":
    main()
