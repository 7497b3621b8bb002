"""A mixed soak of `fastdecode serve`: clients at once for minutes over the three agent APIs (Chat Completions,
Anthropic Messages, Responses), streamed and not, some of them leaving mid-stream on purpose, all greedy. Then every
prompt again alone, one at a time. It passes when nothing was lost (no 5xx, no broken connection but those left on
purpose), every finished reply equals the same request's solo reply, and the server's memory stayed flat.

    python bench/soak.py [--minutes 5] [--clients 8] [--model smollm2-135m] [--out bench/results/soak.json]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fastdecode.agents.server import LaunchedServer, free_port

KEY = "soak"
PROMPTS = ["Write a Python function that reverses a linked list.", "What does `git rebase -i` do?",
           "Fix: `for i in range(len(xs)): xs.remove(xs[i])`", "Explain Python's GIL in two sentences.",
           "Write a bash loop over *.txt files that counts lines.", "What is a race condition?",
           "Give a SQL query for the 3 newest rows of `events`.", "Rename `tmp` to something clearer: `tmp = a + b`",
           "Write a regex for an ISO date.", "How do I read a JSON file in Rust?",
           "Write a unit test for `def add(a, b): return a + b`.", "What does HTTP 429 mean?"]
APIS = ("chat", "messages", "responses")


def request(api: str, model: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                        "temperature": 0, "stream": stream}
    if api == "messages":
        return "/v1/messages", {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                "stream": stream}
    return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0,
                             "stream": stream}


def reply_text(api: str, body: dict) -> str:
    if api == "chat":
        return body["choices"][0]["message"]["content"] or ""
    if api == "messages":
        return "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
    return "".join(c.get("text", "") for item in body["output"] if item["type"] == "message"
                   for c in item["content"])


def delta_text(api: str, event: dict) -> str:
    if api == "chat":
        return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices", []))
    if api == "messages":
        return event.get("delta", {}).get("text", "") if event.get("type") == "content_block_delta" else ""
    return event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""


def run_one(client: httpx.Client, api: str, model: str, prompt: str, max_tokens: int, stream: bool,
            leave_after: int | None = None) -> str | None:
    """The reply's text; None when the client left on purpose. Raises on a 5xx or a broken connection."""
    path, body = request(api, model, prompt, max_tokens, stream)
    if not stream:
        r = client.post(path, json=body)
        r.raise_for_status()
        return reply_text(api, r.json())
    text, events = "", 0
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("type") in ("error", "response.failed") or (api == "chat" and "error" in event):
                raise RuntimeError(f"error event: {event}")
            text += delta_text(api, event)
            events += 1
            if leave_after is not None and events >= leave_after:
                return None  # closing the response drops the connection mid-stream
    return text


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--leave-share", type=float, default=0.15, help="requests whose client leaves mid-stream")
    parser.add_argument("--serve-args", default="--threads 2")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args()

    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = LaunchedServer(args.model, free_port(), KEY, args.serve_args.split(), log).start()
    endpoint = server.wait_ready()
    headers = {"Authorization": f"Bearer {KEY}"}
    done: list[tuple[str, str, str]] = []  # (api, prompt, text)
    failures: list[str] = []
    left = [0]
    rss = [rss_kb(server.process.pid)]
    deadline = time.monotonic() + args.minutes * 60
    lock = threading.Lock()

    def client(seed: int):
        rng = random.Random(seed)
        with httpx.Client(base_url=endpoint.url, headers=headers, timeout=300) as c:
            while time.monotonic() < deadline:
                api, prompt, stream = rng.choice(APIS), rng.choice(PROMPTS), rng.random() < 0.7
                leave = rng.randint(1, 6) if stream and rng.random() < args.leave_share else None
                try:
                    text = run_one(c, api, endpoint.model, prompt, args.max_tokens, stream, leave)
                except Exception as e:  # a 5xx, an error event or a broken connection: lost work
                    with lock:
                        failures.append(f"{api} {'stream' if stream else 'json'}: {type(e).__name__}: {e}"[:300])
                    continue
                with lock:
                    if text is None:
                        left[0] += 1
                    else:
                        done.append((api, prompt, text))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(10)
        rss.append(rss_kb(server.process.pid))
    try:
        with httpx.Client(base_url=endpoint.url, headers=headers, timeout=300) as c:
            solo = {(api, p): run_one(c, api, endpoint.model, p, args.max_tokens, False)
                    for api, p in sorted({(api, p) for api, p, _ in done})}
    finally:
        server.stop()
    mismatches = [(api, p) for api, p, text in done if text != solo[(api, p)]]
    result = {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": args.model, "minutes": args.minutes, "clients": args.clients, "serve_args": args.serve_args,
        "requests": len(done) + left[0] + len(failures), "finished": len(done), "left_on_purpose": left[0],
        "lost": len(failures), "failures": failures[:20], "mismatches": len(mismatches),
        "mismatched": sorted(set(mismatches))[:20],
        "rss_mb_every_10s": [round(kb / 1024) for kb in rss]}  # the first before any request
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("failures", "mismatched", "rss_mb_every_10s")}))
    print(f"RSS (MB, every 10 s): {result['rss_mb_every_10s']}")
    ok = not failures and not mismatches
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
