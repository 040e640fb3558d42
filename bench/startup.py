"""Client start-up: wall time of `python nrvna.py submit WS "hi"` against `python -c pass`,
of `python -m nrvna submit WS "hi"` run in the folder holding nrvna.py (the vendored file,
from the bytecode Python caches in __pycache__/), and of the installed entry point (`python -c
"import nrvna; nrvna.main()"`, which runs from cached bytecode like the `nrvna` console
script). Medians over N runs, same process. A script run as `python FILE` is compiled whole on
every run: Python caches bytecode only for imported modules.

    python bench/startup.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import py_compile
import shutil
import statistics
import subprocess
import tempfile
import time

from common import PYTHON, ROOT, machine, table


def timed(cmd: list[str], runs: int, env: dict[str, str]) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, env=env, check=True)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    try:
        copy = os.path.join(base, "vendored")
        os.makedirs(copy)
        shutil.copy(os.path.join(ROOT, "nrvna.py"), copy)
        py_compile.compile(os.path.join(copy, "nrvna.py"))  # what pip install does
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        ws = os.path.join(base, "ws")
        script = os.path.join(copy, "nrvna.py")
        baseline = timed([PYTHON, "-c", "pass"], args.runs, env)
        as_script = timed([PYTHON, script, "submit", ws, "hi"], args.runs, env)
        as_dash_m = timed([PYTHON, "-m", "nrvna", "submit", ws, "hi"], args.runs, {**env, "PYTHONPATH": copy})
        as_module = timed([PYTHON, "-c", f"import sys; sys.path.insert(0, {copy!r}); import nrvna; "
                                         f"sys.exit(nrvna.main(['submit', {ws!r}, 'hi']))"], args.runs, env)
        print(f"machine: {machine()}")
        print(table(["command", "median ms", "vs python -c pass"], [
            ["python -c pass", baseline * 1000, 1.0],
            ["python nrvna.py submit ws hi", as_script * 1000, as_script / baseline],
            ["python -m nrvna submit ws hi (cached bytecode)", as_dash_m * 1000, as_dash_m / baseline],
            ["nrvna submit ws hi (entry point, cached bytecode)", as_module * 1000, as_module / baseline],
        ]))
        print(f"\ntarget <= 1.5x: script {as_script / baseline:.2f}x, -m {as_dash_m / baseline:.2f}x, "
              f"entry point {as_module / baseline:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
