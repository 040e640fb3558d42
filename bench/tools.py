"""Tool calls (issue 47): nrvna against llama-server --jinja on chat lines that must call a tool.

64 OpenAI Batch lines (/v1/chat/completions bodies): a user request that suits one of 3 tools
(get_weather, search_products, send_email; every parameter required, no other allowed), the 3
tools, `tool_choice: "required"`, `parallel_tool_calls: false`, max_tokens 256, the other
benchmarks' sampling settings and a seed per line. Arms, in interleaved rounds, same model, lines
and seeds: nrvna with its defaults (the lines submitted as one file, `submit --file`, then `wait`,
then each job's calls read from `get --json`'s "tool_calls"); llama-server --jinja -np 16 with 16
concurrent clients posting the same bodies and reading choices[0].message.tool_calls; and
llama-server given the same lines without tools but with the calls' own schema (a call's name and
its tool's parameters, nrvna.tool_call_schema) as response_format, its answer read as the call:
the same constrained work, for a throughput baseline where llama-server makes no calls itself.

Every reply is scored here: valid when it holds exactly one call (parallel_tool_calls is false)
of type function, naming one of the tools, whose arguments are a JSON string whose object passes
jsonschema against that tool's parameters. The schemas use only keywords both converters enforce
(string maxLength, enum, integer type, required, additionalProperties: false; no number bounds,
which llama-server's converter drops). Reported per arm: jobs/s, valid %, replies with a call,
finish_reason "tool_calls", mean completion tokens, peak RSS; and nrvna / llama-server jobs/s per
round and its median (the issue's targets: valid 100% on both, jobs/s >= 1.0x llama-server's).

The model: by default a copy of SmolLM2-135M-Instruct whose chat template has Qwen2.5-Instruct's
tool section (scripts/thinking_model.py --style tools), made once into NRVNA_BENCH_CACHE
(~/.cache/nrvna-bench); --stock runs on SmolLM2 itself, whose template has no tool section.
SmolLM2 was never trained to call tools: what it writes is whatever it writes, and a reply that
is not a call counts against its arm.

    python bench/tools.py [--model PATH | --stock] [--rounds 3] [--lines 64] [--server PATH] [--server-only]
                          [--nrvna DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error

import jsonschema

from common import default_model, llama_server, machine, PYTHON, ROOT, table
from vs_llama_server import SAMPLING, Daemon, concurrently, peak_rss_mb, post, start_server

import nrvna

CACHE = os.environ.get("NRVNA_BENCH_CACHE", os.path.expanduser("~/.cache/nrvna-bench"))
CLIENTS = 16  # llama-server -np 16, 16 concurrent clients
MAX_TOKENS = 256


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", "The current weather in a city.",
          {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    _tool("search_products", "Search the shop's catalogue.",
          {"query": {"type": "string", "maxLength": 32}, "max_results": {"type": "integer"}}),
    _tool("send_email", "Send an email.",
          {"to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 60}}),
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
for _schema in SCHEMAS.values():
    jsonschema.Draft202012Validator.check_schema(_schema)

CITIES = ["Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Denver", "Lagos", "Perth", "Quito", "Seoul", "Rome"]
PRODUCTS = ["garden hose", "cordless drill", "olive oil", "jigsaw puzzle", "rain jacket", "desk lamp", "kettle",
            "road atlas", "chess set", "yoga mat", "honey"]
PEOPLE = ["ana@example.com", "bob@example.org", "chen@example.net", "dara@example.com", "eli@example.org",
          "fay@example.net", "gus@example.com", "hal@example.org", "ivy@example.net", "jo@example.com",
          "kim@example.org"]
TOPICS = ["the Monday meeting", "your invoice", "the team lunch", "a late delivery", "the new rota", "our offsite",
          "the budget draft", "a broken printer", "the holiday plan", "a password reset", "the quarterly report"]


def requests(count: int) -> list[tuple[str, str]]:
    """``count`` user requests, the tools in turn: (the tool that suits it, its text)."""
    out = []
    for i in range(count):
        j = i // 3 % len(CITIES)
        if i % 3 == 0:
            unit = "celsius" if i % 2 == 0 else "fahrenheit"
            out.append(("get_weather", f"What is the weather like in {CITIES[j]} right now, in {unit}?"))
        elif i % 3 == 1:
            out.append(("search_products", f"Find me up to {3 + j % 5} offers for a {PRODUCTS[j]} in the shop."))
        else:
            out.append(("send_email", f"Email {PEOPLE[j]} with the subject line: {TOPICS[j]}."))
    return out


def lines(count: int) -> list[dict]:
    """The OpenAI Batch lines: one /v1/chat/completions body each, seeded by its line."""
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": dict(SAMPLING, seed=i + 1, messages=[{"role": "user", "content": text}], tools=TOOLS,
                          tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS),
             "expected": tool}  # not sent: which tool suits the request
            for i, (tool, text) in enumerate(requests(count))]


def valid(calls: object) -> bool:
    """Whether ``calls`` (a reply's tool_calls) is exactly one call of one of TOOLS whose arguments
    are a JSON string of an object that passes that tool's parameters schema."""
    if not isinstance(calls, list) or len(calls) != 1 or not isinstance(calls[0], dict):
        return False
    call = calls[0]
    function = call.get("function")
    if call.get("type") != "function" or not isinstance(function, dict) or function.get("name") not in SCHEMAS:
        return False
    arguments = function.get("arguments")
    if not isinstance(arguments, str):  # OpenAI's form: the arguments as a JSON string
        return False
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[function["name"]])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def called(calls: object) -> str | None:
    """The name of the first call, if any."""
    try:
        return calls[0]["function"]["name"]  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        return None


def fixture(source: str) -> str:
    """SOURCE copied with the tools template (scripts/thinking_model.py --style tools), cached in
    CACHE by the source's path, size and mtime and the template's text."""
    script = os.path.join(ROOT, "scripts", "thinking_model.py")
    spec = importlib.util.spec_from_file_location("thinking_model", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    stat = os.stat(source)
    key = hashlib.sha256(f"{os.path.abspath(source)}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{module.TEMPLATES['tools']}".encode()).hexdigest()[:12]
    out = os.path.join(CACHE, f"tools-{key}.gguf")
    if not os.path.exists(out):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run([PYTHON, script, source, out, "--style", "tools"], check=True, stdout=subprocess.DEVNULL)
    return out


def nrvna_cli(root: str, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    """``python ROOT/nrvna.py ARGS``, its output captured."""
    return subprocess.run([PYTHON, os.path.join(root, "nrvna.py"), *args], capture_output=True, text=True, check=check)


class Refused(RuntimeError):
    """nrvna refused the lines, or failed jobs: the arm has no figure to give."""


def nrvna_arm(daemon: Daemon, work: list[dict], path: str, root: str) -> dict:
    """The lines as one file through ``submit --file``, then ``wait``, then each job's
    ``get --json`` (ROOT/nrvna.py's commands). Refused lines or failed jobs raise Refused, with
    nrvna's own words."""
    start = time.time()
    submitted = nrvna_cli(root, "submit", daemon.ws, "--file", path, "--tag", "tools")
    if submitted.returncode != 0:
        raise Refused(f"nrvna refused the lines (submit --file exit {submitted.returncode}):\n"
                      f"{submitted.stderr.strip()}")
    ids = submitted.stdout.split()
    if len(ids) != len(work):
        raise Refused(f"submit --file printed {len(ids)} IDs for {len(work)} lines")
    waited = nrvna_cli(root, "wait", daemon.ws, "--tag", "tools", "--quiet", "--timeout", "900")
    if waited.returncode not in (0, 1):
        raise Refused(f"nrvna wait exit {waited.returncode}: {waited.stderr.strip()}")
    # A job is done at its rename into output/ (as in structured.py): the client's polling is not nrvna's.
    finished = [os.path.join(daemon.ws, nrvna.OUTPUT, job_id) for job_id in ids]
    elapsed = max((os.stat(p).st_ctime for p in finished if os.path.exists(p)), default=time.time()) - start
    results, failures = [], []
    for job_id, line in zip(ids, work):
        got = json.loads(nrvna_cli(root, "get", daemon.ws, job_id, "--json", check=True).stdout)
        if got.get("status") != "done":
            failures.append(f"{line['custom_id']}: {got.get('status')}: {(got.get('error') or '').strip()}")
            continue
        meta = got.get("meta") or {}
        results.append({"calls": got.get("tool_calls"), "finish": meta.get("finish_reason"),
                        "tokens": meta.get("generated_tokens"), "expected": line["expected"]})
    if failures:
        raise Refused(f"nrvna failed {len(failures)} of {len(work)} jobs; the first: " + "; ".join(failures[:3]))
    if all(r["calls"] is None for r in results):
        print("note: no nrvna job's `get --json` has a \"tool_calls\" key: does this nrvna.py support tools?")
    return summarize(results, elapsed, peak_rss_mb(daemon.proc.pid))


def server_arm(binary: str, model: str, work: list[dict], schema: bool = False) -> dict:
    """llama-server --jinja -np 16, 16 clients posting the same bodies (``schema``: the calls'
    schema as response_format instead of the tools, its answer read as a call)."""
    proc, port = start_server(binary, model, CLIENTS, "--jinja")
    try:
        post(port, dict(work[0]["body"], max_tokens=8))  # warm up
        results, errors, lock = [], [], threading.Lock()

        def ask(line: dict) -> None:
            try:
                reply = post(port, line["body"])
            except urllib.error.HTTPError as err:
                with lock:
                    errors.append(f"{line['custom_id']}: HTTP {err.code}: {err.read().decode(errors='replace')[:300]}")
                return
            choice = reply["choices"][0]
            calls = as_calls(choice["message"].get("content")) if schema else choice["message"].get("tool_calls")
            with lock:
                results.append({"calls": calls, "finish": choice["finish_reason"],
                                "tokens": reply["usage"]["completion_tokens"], "expected": line["expected"],
                                "text": choice["message"].get("content")})

        elapsed = concurrently(schema_bodies(work) if schema else work, CLIENTS, ask)
        if errors:
            raise Refused(f"llama-server refused {len(errors)} of {len(work)} requests; the first: "
                          + "; ".join(errors[:3]))
        return summarize(results, elapsed, peak_rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait()


def schema_bodies(work: list[dict]) -> list[dict]:
    """The same lines for llama-server without tools: the calls' own schema (a call's name and
    its tool's parameters, as nrvna's grammar holds them) as response_format, so both sides make
    the same constrained object: the same work, where llama-server makes no calls of its own."""
    schema = nrvna.tool_call_schema(TOOLS, "required", False, nrvna.ToolFormat("<tool_call>", "</tool_call>"))
    out = []
    for line in work:
        body = {k: v for k, v in line["body"].items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "call", "schema": schema, "strict": True}}
        out.append(dict(line, body=body))
    return out


def as_calls(text: object) -> object:
    """A schema arm's answer (a call's JSON object) as tool_calls, for ``valid``."""
    try:
        call = json.loads(text)  # type: ignore[arg-type]
        return [{"type": "function", "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
    except (TypeError, ValueError, KeyError):
        return None


def summarize(results: list[dict], elapsed: float, rss: float) -> dict:
    count = max(1, len(results))
    tokens = [r["tokens"] for r in results if isinstance(r["tokens"], int)]
    return {"jobs/s": len(results) / elapsed, "elapsed": elapsed, "rss": rss,
            "valid": sum(valid(r["calls"]) for r in results) / count,
            "with_call": sum(bool(r["calls"]) for r in results) / count,
            "right_tool": sum(called(r["calls"]) == r["expected"] for r in results) / count,
            "finish_tool_calls": sum(r["finish"] == "tool_calls" for r in results) / count,
            "finish_length": sum(r["finish"] == "length" for r in results) / count,
            "tokens": statistics.mean(tokens) if tokens else None,
            "sample": next((r for r in results if not valid(r["calls"])), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF whose template has a tool section (default: SmolLM2 with the "
                                        "tools template, made once from --source)")
    parser.add_argument("--source", default=default_model(), help="the GGUF the default model is copied from")
    parser.add_argument("--stock", action="store_true", help="run on --source itself (SmolLM2: no tool section)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--server", help="llama-server binary (default: build it)")
    parser.add_argument("--server-only", action="store_true", help="the llama-server arm alone")
    parser.add_argument("--nrvna", metavar="DIR", default=ROOT, help="run DIR's nrvna.py (a checkout of another "
                                                                    "commit; default: this one's)")
    args = parser.parse_args()
    if args.stock and args.model:
        parser.error("--stock runs on --source: give one of --stock and --model")
    model = args.source if args.stock else args.model or fixture(args.source)
    binary = llama_server(args.server)
    work = lines(args.lines)
    base = tempfile.mkdtemp(prefix="nrvna-bench-", dir=os.environ.get("BENCH_DIR", ROOT))
    path = os.path.join(base, "lines.jsonl")
    with open(path, "w") as handle:
        for line in work:
            handle.write(json.dumps({k: v for k, v in line.items() if k != "expected"}) + "\n")
    nrvna_name = "nrvna, defaults" + ("" if os.path.samefile(args.nrvna, ROOT) else f" ({args.nrvna})")
    arms = ([] if args.server_only else [nrvna_name]) + [f"llama-server --jinja -np {CLIENTS}, {CLIENTS} clients",
                                                         "llama-server, the calls' schema as response_format"]
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    try:
        for r in range(args.rounds):
            for name in arms if r % 2 == 0 else arms[::-1]:  # nrvna first in round 1: a refusal shows at once
                if name.startswith("nrvna"):
                    daemon = Daemon(model, base, {}, root=args.nrvna)
                    try:
                        runs[name].append(nrvna_arm(daemon, work, path, args.nrvna))
                    finally:
                        daemon.close()
                else:
                    runs[name].append(server_arm(binary, model, work, schema="schema" in name))
    except Refused as err:
        raise SystemExit(f"tools.py: {err}") from None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for name in arms:
        ordered = sorted(runs[name], key=lambda run: run["jobs/s"])
        median = ordered[len(ordered) // 2]
        worst = lambda key, name=name: f"{100 * min(run[key] for run in runs[name]):.1f}%"  # noqa: E731
        rows.append([name, median["jobs/s"], f"{ordered[0]['jobs/s']:.3g}-{ordered[-1]['jobs/s']:.3g}", worst("valid"),
                     worst("with_call"), worst("right_tool"), worst("finish_tool_calls"), worst("finish_length"),
                     "?" if median["tokens"] is None else f"{median['tokens']:.0f}", median["rss"]])
    print(f"machine: {machine()}; model {os.path.basename(model)}{' (stock)' if args.stock else ''}; "
          f"{args.lines} lines, 3 tools, tool_choice required, parallel_tool_calls false, max_tokens {MAX_TOKENS}")
    print(f"median of {args.rounds} interleaved rounds by jobs/s; the percentages: the worst round")
    print(table(["arm", "jobs/s", "jobs/s range", "valid calls", "with a call", "the suited tool",
                 "finish tool_calls", "finish length", "mean completion tokens", "peak RSS MB"], rows))
    if not args.server_only:
        for other in arms[1:]:
            paired = [runs[arms[0]][r]["jobs/s"] / runs[other][r]["jobs/s"] for r in range(args.rounds)]
            print(f"\nnrvna defaults vs {other}: {statistics.median(paired):.2f}x jobs/s (per round: "
                  f"{', '.join(f'{x:.2f}x' for x in paired)}; target >= 1.0); valid calls target 100% on both")
    for name in arms:
        sample = runs[name][-1]["sample"]
        if sample:
            shown = {k: sample.get(k) for k in ("finish", "calls", "text") if sample.get(k) is not None}
            print(f"\n{name}, an invalid reply (last round): {json.dumps(shown)[:400]}")


if __name__ == "__main__":
    main()
