"""The schema suite: every JSON Schema in tests/data/schema_suite.jsonl (shapes of real tools, APIs, config files and
extraction records) sent to a fastdecode server as `response_format: json_schema` (strict), each reply checked with
`jsonschema` (Draft 2020-12, formats checked). A reply is *valid*, *invalid*, cut by `max_tokens` (*length*), or an
*error* (an HTTP error, or no reply). Sampled (temperature 0.7), with a fixed seed per schema, so a rerun on the same
tree asks the same questions.

    python bench/schema_suite.py --base-url http://127.0.0.1:8000 --api-key KEY --tree . --label llguidance
    python bench/schema_suite.py --start-server --tree /tmp/fd-old --label before-llguidance

--start-server runs `python -m fastdecode.server` with --tree as its working directory, so that tree's `fastdecode`
package is the one the server imports (logged and recorded), and stops it after. Writes
bench/results/schema_suite-LABEL.json (every reply) and .md (totals, and per feature tag).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import command_line, machine, markdown_table, write_json  # noqa: E402

SUITE = ROOT / "tests" / "data" / "schema_suite.jsonl"
OUTCOMES = ("valid", "invalid", "length", "error")
SERVE_ARGS = ["--quant", "int4", "--threads", "2", "--kv-disk-gb", "0"]
KEY = "schema-suite"  # the key --start-server gives its own server


def load_suite(path: Path = SUITE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- checking a reply -----------------------------------------------------------------------------------------------
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def is_date_time(value) -> bool:
    if not isinstance(value, str):
        return True
    if not RFC3339.match(value):
        return False
    try:  # the regex admits month 13 or 25 o'clock; fromisoformat does not
        datetime.datetime.fromisoformat(value.upper())
    except ValueError:
        return False
    return True


def is_uri(value) -> bool:
    """RFC 3986's absolute URI, roughly: a scheme, then no spaces or characters a URI never holds."""
    if not isinstance(value, str):
        return True
    try:
        scheme = urllib.parse.urlsplit(value).scheme
    except ValueError:  # an unbalanced IPv6 bracket
        return False
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*$", scheme)) and not re.search(r'[\s<>"{}|\\^`]', value)


def is_hostname(value) -> bool:
    if not isinstance(value, str):
        return True
    return 0 < len(value) <= 253 and all(HOSTNAME_LABEL.match(label) for label in value.rstrip(".").split("."))


def format_checker() -> jsonschema.FormatChecker:
    """Draft 2020-12's format checker, plus date-time, uri and hostname, which jsonschema checks only when optional
    packages (rfc3339-validator, rfc3987, fqdn) are installed: without them those formats would pass unchecked."""
    checker = jsonschema.FormatChecker()
    checker.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)  # this instance's own
    for name, check in (("date-time", is_date_time), ("uri", is_uri), ("hostname", is_hostname)):
        if name not in checker.checkers:
            checker.checks(name)(check)
    return checker


def schema_errors(instance, schema: dict, checker: jsonschema.FormatChecker) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"[:300]
            for e in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))]


def outcome(reply: dict, max_tokens: int) -> str:
    """valid, invalid, length (cut by max_tokens and not valid), or error (no reply, or one the server's request
    timeout cut). Any other `length` finish short of max_tokens is no honest one (a dead end reported as `length`):
    invalid."""
    if reply["http_error"] or reply["timed_out"]:
        return "error"
    if reply["valid"]:
        return "valid"
    if reply["finish_reason"] == "length" and (reply["completion_tokens"] or 0) >= max_tokens:
        return "length"
    return "invalid"


# --- asking ---------------------------------------------------------------------------------------------------------
def seed_for(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def request_body(entry: dict, model: str, max_tokens: int, temperature: float) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": entry["prompt"]}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed_for(entry["name"]),
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}}


def ask(client: httpx.Client, entry: dict, model: str, max_tokens: int, temperature: float,
        checker: jsonschema.FormatChecker) -> dict:
    """One schema's request and its reply, checked."""
    reply = {"name": entry["name"], "features": entry["features"], "finish_reason": None, "parsed": False,
             "valid": False, "errors": [], "http_error": None, "timed_out": False, "completion_tokens": None,
             "content": None, "speed": None}
    t0 = time.perf_counter()
    try:
        r = client.post("/v1/chat/completions", json=request_body(entry, model, max_tokens, temperature))
    except httpx.HTTPError as e:
        reply["http_error"] = f"{type(e).__name__}: {e}"[:300]
    else:
        if r.status_code != 200:
            reply["http_error"] = f"HTTP {r.status_code}: {r.text}"[:300]
        else:
            body = r.json()
            choice = body["choices"][0]
            reply["finish_reason"] = choice.get("finish_reason")
            reply["completion_tokens"] = (body.get("usage") or {}).get("completion_tokens")
            reply["speed"] = body.get("fastdecode")  # the server's own figures: queue, TTFT, output tok/s
            reply["timed_out"] = bool((reply["speed"] or {}).get("timed_out"))
            reply["content"] = content = choice["message"].get("content") or ""
            try:
                instance = json.loads(content)
            except ValueError as e:
                reply["errors"] = [f"not JSON: {e}"[:300]]
            else:
                reply["parsed"] = True
                reply["errors"] = schema_errors(instance, entry["schema"], checker)
                reply["valid"] = not reply["errors"]
    reply["seconds"] = round(time.perf_counter() - t0, 3)
    reply["outcome"] = outcome(reply, max_tokens)
    return reply


def served_model(client: httpx.Client) -> str:
    r = client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_suite(base_url: str, api_key: str | None, entries: list[dict], max_tokens: int = 384,
              temperature: float = 0.7, in_flight: int = 8, timeout_s: float = 600,
              on_reply=lambda reply: None) -> tuple[str, list[dict]]:
    """(the served model, every entry's reply in the suite's order), `in_flight` requests at a time; `on_reply(reply)`
    as each comes back."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    checker = format_checker()

    def one(entry):
        reply = ask(client, entry, model, max_tokens, temperature, checker)
        on_reply(reply)
        return reply

    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        model = served_model(client)
        with ThreadPoolExecutor(in_flight) as pool:
            return model, list(pool.map(one, entries))


# --- reporting ------------------------------------------------------------------------------------------------------
def tally(replies: list[dict]) -> dict:
    """{"total": Counter of outcomes, "features": {tag: Counter}}."""
    total, features = Counter(), defaultdict(Counter)
    for reply in replies:
        total[reply["outcome"]] += 1
        for tag in reply["features"]:
            features[tag][reply["outcome"]] += 1
    return {"total": total, "features": dict(sorted(features.items(), key=lambda kv: -sum(kv[1].values())))}


def failures(replies: list[dict]) -> list[str]:
    """One line per reply that is neither valid nor an honest `length` finish."""
    return [f"{r['name']} ({r['outcome']}, finish_reason={r['finish_reason']}): "
            f"{r['http_error'] or ('timed out; ' if r['timed_out'] else '') + '; '.join(r['errors'][:3])} | "
            f"reply: {(r['content'] or '')[:200]!r}"
            for r in replies if r["outcome"] not in ("valid", "length")]


def row(name: str, counts: Counter) -> list[str]:
    n = sum(counts.values())
    return [name, str(n), *(str(counts[o]) for o in OUTCOMES), f"{100 * counts['valid'] / n:.0f}%" if n else "-"]


def markdown(result: dict) -> str:
    t = tally(result["replies"])
    tokens = [r["completion_tokens"] for r in result["replies"] if r["completion_tokens"] is not None]
    headers = ["", "schemas", *OUTCOMES, "valid %"]
    dirty = " (with uncommitted changes)" if result["dirty"] else ""
    host = result.get("machine")
    load = f"; load average {host['load_avg_1m_at_start']:.1f} at the start on {host['cores']} cores" if host else ""
    setup = (f"Tree `{result['tree']}` at commit `{result['commit'][:10]}`{dirty}; model {result['model']}, "
             f"max_tokens {result['max_tokens']}, temperature {result['temperature']}, {result['in_flight']} "
             f"requests in flight, {result['wall_s']:.0f} s in all, {sum(tokens)} completion tokens{load}. "
             f"{result.get('note', '')}").strip()
    legend = ("*valid*: parses and passes `jsonschema` (Draft 2020-12, formats checked); *length*: not valid, cut "
              "after max_tokens tokens; *invalid*: not valid otherwise; *error*: no reply, or the server's request "
              "timeout ended it.")
    lines = [f"# Schema suite: {result['label']}", "", "```sh", result["command"], "```", "", setup, "", legend, "",
             markdown_table(headers, [row("all", t["total"])]), "", "## Per feature tag", "",
             markdown_table(headers, [row(tag, counts) for tag, counts in t["features"].items()])]
    bad = failures(result["replies"])
    if bad:
        lines += ["", f"## Not valid ({len(bad)}; the first 20)", ""] + [f"- {line}" for line in bad[:20]]
    return "\n".join(lines) + "\n"


# --- the server -----------------------------------------------------------------------------------------------------
def tree_state(tree: Path) -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip(),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}


def package_file(tree: Path) -> str:
    """The `fastdecode/__init__.py` a Python started in `tree` imports: `python -m` puts its working directory first
    on sys.path, ahead of the editable install's finder."""
    return subprocess.run([sys.executable, "-c", "import fastdecode; print(fastdecode.__file__)"], cwd=tree,
                          capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def started_server(tree: Path, model: str):
    """`python -m fastdecode.server` run from `tree`, on a free port, stopped on leaving."""
    from fastdecode.agents.server import LaunchedServer, free_port

    log = Path(tempfile.mkdtemp(prefix="schema-suite-")) / "serve.log"
    with contextlib.chdir(tree):  # the child inherits the working directory, hence its package
        server = LaunchedServer(model, free_port(), KEY, SERVE_ARGS, log).start()
    try:
        print(f"starting the server from {tree} (log: {log}); a first start may build the native kernels",
              file=sys.stderr)
        server.wait_ready()
        yield server
    finally:
        server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="names the result files: schema_suite-LABEL.{json,md}")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--start-server", action="store_true", help="start (and stop) a server from --tree")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout the server runs (for its commit)")
    parser.add_argument("--model", default="smollm2-135m", help="what --start-server serves")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="only the first N schemas (a smoke run)")
    parser.add_argument("--suite", type=Path, default=SUITE)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--note", default="", help="a sentence for the report (what else ran on the machine)")
    args = parser.parse_args()

    tree = args.tree.resolve()
    entries = load_suite(args.suite)[:args.limit]
    result = {"label": args.label, "command": command_line(), "machine": machine(), "note": args.note,
              "tree": str(tree), **tree_state(tree), "max_tokens": args.max_tokens, "temperature": args.temperature,
              "in_flight": args.in_flight}
    with contextlib.ExitStack() as stack:
        base_url, api_key = args.base_url, args.api_key
        if args.start_server:
            result["fastdecode_file"] = package_file(tree)
            print(f"the server imports {result['fastdecode_file']}", file=sys.stderr)
            server = stack.enter_context(started_server(tree, args.model))
            base_url, api_key = server.base_url, KEY
        t0 = time.perf_counter()
        done = iter(range(1, len(entries) + 1))
        result["model"], replies = run_suite(
            base_url, api_key, entries, args.max_tokens, args.temperature, args.in_flight,
            on_reply=lambda r: print(f"[{next(done)}/{len(entries)}] {r['name']}: {r['outcome']}, "
                                     f"{r['completion_tokens']} tokens, {r['seconds']:.1f} s", file=sys.stderr))
        result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["replies"] = replies
    result["totals"] = dict(tally(replies)["total"])
    write_json(args.out / f"schema_suite-{args.label}.json", result)
    text = markdown(result)
    (args.out / f"schema_suite-{args.label}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
