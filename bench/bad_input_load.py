"""Normal users beside a bounded load of the worst inputs the server takes or refuses: does anyone wait?

Four normal users send short chat requests in a loop while four attackers send, in turn, the heaviest requests
the caps allow (16 stop strings of 1,024 characters, a JSON schema of 1,000 keys, 1,024 logit-bias entries, a
long prompt) and ones the caps refuse (a stop string too long, a schema over its key cap, a 7 MB prompt, a body
over the size limit, malformed JSON), for --seconds. Reports the normal requests' queue wait (the server's
`fastdecode.queue_s`: admission to the engine), their time to first token and end to end against the same
requests run alone first, the attackers' status codes, and /health polled throughout. The issue's bound: queue
wait under one second beyond a request's own work, nothing lost, no 5xx, /health green.

    python bench/bad_input_load.py                   # SmolLM2-135M, 60 s of load
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.agent_session import ROOT, Server  # noqa: E402
from bench.common import command_line, git_state, machine, markdown_table, write_json  # noqa: E402

NORMAL = [{"role": "user", "content": "Name three prime numbers."}]


def attacks(model: str) -> list[tuple[str, bytes]]:
    """(name, raw body) of each attack, valid (heavy) first, then refused ones."""
    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": NORMAL, "max_tokens": 32, **fields}).encode()
    keys = {f"k{i:03d}_" + "x" * 8: {"type": "string"} for i in range(1000)}
    schema = {"type": "json_schema", "json_schema": {"name": "big", "schema": {"type": "object", "properties": keys}}}
    over = dict(keys, **{f"z{i}": {"type": "string"} for i in range(10)})
    return [
        ("16 stop strings of 1,024 chars", body(stop=[chr(65 + i) * 1024 for i in range(16)])),
        ("schema of 1,000 keys", body(response_format=schema)),
        ("1,024 logit-bias entries", body(logit_bias={str(t): 1 for t in range(1000, 2024)})),
        ("long prompt (about 3k tokens)", body(messages=[{"role": "user", "content": "word " * 3000}])),
        ("stop string of 1,025 chars", body(stop=["x" * 1025])),
        ("schema of 1,010 keys", body(response_format={**schema, "json_schema": {
            "name": "big", "schema": {"type": "object", "properties": over}}})),
        ("7 MB prompt", body(messages=[{"role": "user", "content": "a " * 3_500_000}])),
        ("9 MB body", b'{"model": "x", "messages": [' + b" " * (9 << 20) + b"]}"),
        ("malformed JSON", b'{"model": "' + model.encode() + b'", "messages": ['),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--attackers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bad_input_load"))
    a = p.parse_args()

    server = Server("fastdecode", a.model, a.serve_args.split() + ["--threads", str(a.threads)])
    base = server.server.base_url
    stop = threading.Event()
    normal, codes, health, failures = [], collections.defaultdict(collections.Counter), [], []

    def normal_once() -> dict:
        t0 = time.perf_counter()
        r = server.stream(NORMAL, a.max_tokens)
        return {"ttft_s": r["times"][0] if r["times"] else None, "e2e_s": time.perf_counter() - t0,
                "queue_s": r["fastdecode"].get("queue_s"), "text": r["text"]}

    def user():
        while not stop.is_set():
            try:
                normal.append(normal_once())
            except Exception as e:  # noqa: BLE001 -- a lost request is what this measures
                failures.append(repr(e))

    def attacker(i: int):
        cases = attacks(server.server.model)
        with httpx.Client(base_url=base, timeout=600) as client:
            k = i
            while not stop.is_set():
                name, raw = cases[k % len(cases)]
                k += 1
                try:
                    r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
                    codes[name][r.status_code] += 1
                except httpx.HTTPError as e:
                    codes[name][type(e).__name__] += 1

    def poll_health():
        with httpx.Client(base_url=base, timeout=10) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    health.append((client.get("/health").status_code, time.perf_counter() - t0))
                except httpx.HTTPError as e:
                    health.append((type(e).__name__, time.perf_counter() - t0))
                time.sleep(1.0)

    try:
        normal_once()  # warm-up
        alone = [normal_once() for _ in range(5)]
        threads = [threading.Thread(target=user) for _ in range(a.users)]
        threads += [threading.Thread(target=attacker, args=(i,)) for i in range(a.attackers)]
        threads.append(threading.Thread(target=poll_health))
        for t in threads:
            t.start()
        time.sleep(a.seconds)
        stop.set()
        for t in threads:
            t.join()
    finally:
        server.close()

    def summary(rows, key):
        xs = [r[key] for r in rows if r[key] is not None]
        return {"n": len(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None
    five_xx = {name: dict(c) for name, c in codes.items() if any(isinstance(s, int) and s >= 500 for s in c)}
    out = {"benchmark": "bad_input_load", **git_state(), "command": command_line(), "machine": machine(),
           "server": server.command, "seconds": a.seconds, "users": a.users, "attackers": a.attackers,
           "alone": {k: summary(alone, k) for k in ("ttft_s", "e2e_s", "queue_s")},
           "under_load": {k: summary(normal, k) for k in ("ttft_s", "e2e_s", "queue_s")},
           "normal_requests": len(normal), "normal_lost": failures,
           "same_text_as_alone": sum(r["text"] == alone[0]["text"] for r in normal),
           "attacks": {name: {str(k): v for k, v in c.items()} for name, c in codes.items()},
           "five_xx": five_xx, "health": {"polls": len(health), "ok": sum(s == 200 for s, _ in health),
                                          "slowest_s": max((t for _, t in health), default=None)}}
    out["verdict"] = {"queue_wait_under_1s": (out["under_load"]["queue_s"] or {}).get("max", 9e9) < 1.0,
                      "nothing_lost": not failures, "no_5xx": not five_xx,
                      "health_green": out["health"]["ok"] == out["health"]["polls"] > 0}
    write_json(Path(a.out).with_suffix(".json"), out)
    rows = [[phase, str(s["n"]), f"{s['queue_s']['median']:.3f} / {s['queue_s']['max']:.3f}",
             f"{s['ttft_s']['median']:.3f} / {s['ttft_s']['max']:.3f}",
             f"{s['e2e_s']['median']:.3f} / {s['e2e_s']['max']:.3f}"]
            for phase, s in (("alone", {**out["alone"], "n": len(alone)}),
                             ("beside the attackers", {**out["under_load"], "n": len(normal)}))]
    lines = [f"# Normal users beside the worst inputs ({a.model})", "",
             f"`{command_line()}` at {out['commit'][:10]}{' (dirty)' if out['dirty'] else ''}", "",
             markdown_table(["normal requests", "n", "queue s (median / max)", "TTFT s (median / max)",
                             "end to end s (median / max)"], rows), "",
             markdown_table(["attack", "status codes"],
                            [[name, ", ".join(f"{k}: {v}" for k, v in c.items())]
                             for name, c in out["attacks"].items()]),
             "", f"- {a.users} users and {a.attackers} attackers for {a.seconds:.0f} s; normal requests lost: "
             f"{len(failures)}; replies equal to the one alone: {out['same_text_as_alone']} of {len(normal)}.",
             f"- /health: {out['health']['ok']} of {out['health']['polls']} polls answered 200, slowest "
             f"{out['health']['slowest_s']:.3f} s.", f"- Verdict: {out['verdict']}.", ""]
    Path(a.out).with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
