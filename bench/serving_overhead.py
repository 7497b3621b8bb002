"""What serving costs: the same requests run by the engine in-process and through `fastdecode serve`.

U users each send R requests one after another (closed loop), each a random prompt of P tokens and an output of O
tokens (greedy, ignore_eos, so every way runs the same tokens). Three ways, in alternate runs, each in a fresh
process:
    engine   the engine stepped in-process, nothing else running (the ceiling for this machine and batch)
    stream   `LLM.stream` from a thread per user, the engine on its own thread (the server's slots, without HTTP)
    server   `fastdecode serve`, each request one `curl` process streaming /v1/completions (a client that costs
             next to nothing)
    baseline the server way on git revision --baseline's package (an A/B of a change to the serving path)
The gap between engine and server is what the HTTP layer costs the batch; the gap at 1 user against U users is what
it costs the concurrency sweep's ratios.

    python bench/serving_overhead.py                  # 1 and 8 users, 3 requests each, 3 runs
    python bench/serving_overhead.py --users 1,4,8 --runs 5

Writes bench/results/serving_overhead.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (command_line, fmt_range, git_state, machine, markdown_table, package_at, stats,  # noqa: E402
                    write_json)

WAYS = ("engine", "stream", "server", "baseline")


def workload(users: int, a) -> list[list[tuple[list[int], int]]]:
    """Per user, its requests: (prompt ids, output tokens); prompt and output lengths drawn around the given ones."""
    rng = np.random.default_rng(a.seed + users)
    around = lambda n: int(rng.integers(n // 2, n * 3 // 2))  # noqa: E731
    return [[([int(t) for t in rng.integers(100, 40000, around(a.prompt_tokens))], around(a.output_tokens))
             for _ in range(a.requests)] for _ in range(users)]


def run_users(work, one) -> float:
    """Each user's requests in turn on its own thread -> output tokens per second over the whole."""
    threads = [threading.Thread(target=lambda reqs=reqs: [one(ids, n) for ids, n in reqs]) for reqs in work]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(n for reqs in work for _, n in reqs) / (time.perf_counter() - start)


def child(way: str, users: int, a) -> float:
    work = workload(users, a)
    if way == "baseline":  # `python -m` imports the package of the working directory first
        os.chdir(package_at(a.baseline))
    if way in ("server", "baseline"):
        from fastdecode.lab.local_server import LocalServer

        with LocalServer(a.model, "none", ("--threads", str(a.threads)), 600.0) as server:
            url = f"{server.base_url}/v1/completions"

            def one(ids, n):
                body = json.dumps({"model": a.model, "prompt": ids, "max_tokens": n, "temperature": 0,
                                   "ignore_eos": True, "stream": True})
                subprocess.run(["curl", "-sSN", "--fail", url, "-H", "Content-Type: application/json", "-d", body],
                               stdout=subprocess.DEVNULL, check=True)
            one(work[0][0][0][:8], 4)  # warm: the first request pays one-time costs
            return run_users(work, one)
    from fastdecode import LLM, SamplingParams

    llm = LLM(a.model, threads=a.threads, speculate="none")
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    try:
        if way == "stream":
            llm.generate(work[0][0][0][:8], params(4))  # warm: the first request pays one-time costs
            return run_users(work, lambda ids, n: sum(len(c.token_ids) for c in llm.stream(ids, params(n))))
        engine = llm.engine
        engine.background = False  # this thread steps it (before any request starts the engine's own thread)
        warm = engine.add_request(work[0][0][0][:8], params(4))
        while not warm.finished:
            engine.pump()
        queues = [list(reqs) for reqs in work]

        def next_request(u):  # user u's next request into the engine, None when it has sent all
            if not queues[u]:
                return None
            ids, n = queues[u].pop(0)
            return engine.add_request(ids, params(n))
        live = [next_request(u) for u in range(len(queues))]
        start, total = time.perf_counter(), 0
        while any(s is not None for s in live):
            engine.pump()
            for u, s in enumerate(live):
                if s is not None and s.finished:
                    total += s.num_output
                    live[u] = next_request(u)
        return total / (time.perf_counter() - start)
    finally:
        llm.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--users", default="1,8")
    p.add_argument("--requests", type=int, default=3, help="per user")
    p.add_argument("--prompt-tokens", type=int, default=400, help="each prompt: from half to 1.5x this")
    p.add_argument("--output-tokens", type=int, default=350, help="each output: from half to 1.5x this")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ways", default="engine,stream,server",
                   help="of engine, stream, server, baseline (engine always runs)")
    p.add_argument("--baseline", default="", help="the git revision of the baseline way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args()
    if a.child:
        way, users = a.child.split(":")
        print(json.dumps({"tok_s": child(way, int(users), a)}))
        return
    if not shutil.which("curl"):
        raise SystemExit("error: the server way needs curl")
    levels = [int(u) for u in a.users.split(",")]
    ways = [w for w in WAYS if w == "engine" or w in a.ways.split(",")]
    if "baseline" in ways and not a.baseline:
        raise SystemExit("error: the baseline way needs --baseline REV")
    runs = {(way, u): [] for u in levels for way in ways}
    # No KV disk tier: every run sends the same seeded prompts, and a tier kept between runs would serve later runs
    # (and the ways that run later) prefixes that the first computed.
    env = {**os.environ, "FASTDECODE_KV_DISK_GB": "0"}
    forward = ["--model", a.model, "--threads", str(a.threads), "--requests", str(a.requests), "--prompt-tokens",
               str(a.prompt_tokens), "--output-tokens", str(a.output_tokens), "--seed", str(a.seed),
               "--baseline", a.baseline]
    for r in range(a.runs):
        for u in levels:
            for way in ways if r % 2 == 0 else ways[::-1]:  # the ways take turns, each first in half the runs
                out = subprocess.run([sys.executable, __file__, *forward, "--child", f"{way}:{u}"], check=True,
                                     capture_output=True, text=True, env=env).stdout
                runs[(way, u)].append(json.loads(out.splitlines()[-1])["tok_s"])
                print(f"run {r + 1}/{a.runs}, {u} users, {way}: {runs[(way, u)][-1]:.1f} tok/s", file=sys.stderr)
    rows = [{"way": way, "users": u, "tok_s": stats(runs[(way, u)]),
             "of_engine": stats([s / e for s, e in zip(runs[(way, u)], runs[("engine", u)])])}
            for u in levels for way in ways]
    report = {"benchmark": "serving_overhead", **git_state(), "baseline": a.baseline or None,
              "command": command_line(), "machine": machine(),
              "model": a.model, "threads": a.threads, "requests_per_user": a.requests,
              "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens, "rows": rows}
    write_json(a.out / "serving_overhead.json", report)
    cells = [[r["way"], str(r["users"]), fmt_range(r["tok_s"]), fmt_range(r["of_engine"], ".2f")] for r in rows]
    md = (f"# Serving overhead ({a.model}, {a.threads} threads)\n\n"
          + markdown_table(["way", "users", "output tok/s", "x engine (same run)"], cells)
          + f"\n\n- `{report['command']}` at {report['commit'][:10]}{' (dirty)' if report['dirty'] else ''}; "
            f"{report['machine']['cpu']}.\n- Median (min-max) of {a.runs} runs, the ways in alternate order.\n")
    (a.out / "serving_overhead.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
