"""Shared helpers for nrvna's benchmarks (not part of the test suite)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nrvna  # noqa: E402

PYTHON = sys.executable  # the real interpreter, not a pyenv shim (that adds ~25 ms per start)


def daemon(ws: str, *args: str, runner: str = "lambda job: 'ok'",
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """`nrvna daemon` in a child process with an injected runner expression (no model)."""
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import nrvna; "
            f"sys.exit(nrvna.main(['daemon', '-', {ws!r}, *{list(args)!r}], runner={runner}))")
    full_env = {**os.environ, "NRVNA_LOG_LEVEL": "warn", **(env or {})}
    return subprocess.Popen([PYTHON, "-c", code], env=full_env)


def plant_jobs(ws: str, count: int, prefix: str = "bench") -> list[str]:
    """Queue `count` jobs fast for a benchmark's setup (no fsync: setup is not measured)."""
    nrvna.ensure_workspace(ws)
    ready = os.path.join(ws, nrvna.READY)
    stamp = int(time.time())
    ids = []
    for i in range(count):
        job_id = f"{stamp}_{os.getpid()}_{i}"
        os.mkdir(os.path.join(ready, job_id))
        with open(os.path.join(ready, job_id, "prompt.txt"), "w") as handle:
            handle.write(f"{prefix} {i}")
        ids.append(job_id)
    return ids


def count(ws: str, sub: str) -> int:
    with os.scandir(os.path.join(ws, sub)) as entries:
        return sum(1 for _ in entries)


def wait_for_count(ws: str, sub: str, target: int, timeout: float = 600, poll: float = 0.01) -> float:
    """Block until `sub` holds `target` entries; return the time.monotonic() it happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if count(ws, sub) >= target:
            return time.monotonic()
        time.sleep(poll)
    raise TimeoutError(f"{sub} did not reach {target} entries")


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{nrvna.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table, ready for the README."""
    rows = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


# The start of a child script (``python -c``) that loads the nrvna.py its first argument names as
# the module nrvna: a profiled daemon wraps that module's methods, then runs its main().
LOAD_NRVNA = r"""
import importlib.util, json, os, sys, threading, time
spec = importlib.util.spec_from_file_location("nrvna", sys.argv[1])
nrvna = importlib.util.module_from_spec(spec)
sys.modules["nrvna"] = nrvna
spec.loader.exec_module(nrvna)
"""


def ratio_rows(names: Sequence[str], runs: dict[str, list[float]], best: list[float]) -> list[list[Any]]:
    """Per arm: its median, its range, its ratio to ``best`` round by round, and that ratio's median."""
    import statistics

    rows = []
    for name in names:
        ratios = [v / b for v, b in zip(runs[name], best)]
        rows.append([name, statistics.median(runs[name]), f"{min(runs[name]):.0f}-{max(runs[name]):.0f}",
                     ", ".join(f"{x:.2f}" for x in ratios), statistics.median(ratios)])
    return rows


def default_model() -> str:
    """The first models/*.gguf (the SmolLM2 test model after the quick start), or ""."""
    import glob

    return (sorted(glob.glob(os.path.join(ROOT, "models", "*.gguf"))) or [""])[0]


def gpu_offload() -> list[str]:
    """llama-server's flags for the layers nrvna offloads: on a GPU every arm offloads the same
    layers, NRVNA_GPU_LAYERS (-1: all), which nrvna reads too; none where it is unset."""
    layers = os.environ.get("NRVNA_GPU_LAYERS")
    return ["-ngl", "999" if layers == "-1" else layers] if layers else []


def llama_server(binary: str | None) -> str:
    """``binary``, or llama-server built by bench/build_llama_server.sh (cached)."""
    return binary or subprocess.run(["bash", os.path.join(ROOT, "bench", "build_llama_server.sh")],
                                    capture_output=True, text=True, check=True).stdout.strip()
