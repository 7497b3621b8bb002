"""Replicas against one engine with the same cores: `fastdecode serve --replicas 2 --threads 1` (routed by session and
prefix, and round-robin as the baseline) against `fastdecode serve --threads 2`, all three servers up at once.

1. Agent sessions: S concurrent sessions of T turns each resend their growing conversation (a ~1.4k-token system
   prompt, the replies, a ~250-token tool result a turn; bench/agent_session.py's), with Claude Code's session
   header unless --no-session-header. The single server answers first; the clusters replay the same conversations
   (its replies), so every request is the same and every greedy reply must equal the single server's. Reported: the
   prefix-cache hit rate from turn 2 (cached / prompt tokens) and TTFT.
2. Throughput: U independent users, each R requests of a random P-token prompt and O output tokens (greedy,
   ignore_eos), closed loop; output tok/s of all of them, the three servers in alternate runs.
3. The ingress's cost: one user's requests for one token of a cached prompt, one after another; the median latency
   of each server. A replica has one thread, so the hop's cost is the cluster's against one engine with one thread
   (`--latency-only` measures just that, beside the others).

    python bench/cluster.py                        # SmolLM2-135M, 8 sessions x 6 turns, 8 users, 3 runs
    python bench/cluster.py --runs 5 --no-session-header
    python bench/cluster.py --latency-only         # writes bench/results/cluster-latency.{json,md}

Writes bench/results/cluster.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.agent_session import TASKS, system_prompt, tool_results  # noqa: E402
from bench.common import command_line, fmt_range, git_state, machine, markdown_table, stats, write_json  # noqa: E402
from fastdecode.lab.local_server import LocalServer  # noqa: E402

SERVERS = {"one engine x 2 threads": ["--threads", "2"],
           "2 replicas x 1 thread, session+prefix": ["--replicas", "2", "--threads", "1"],
           "2 replicas x 1 thread, round-robin": ["--replicas", "2", "--threads", "1", "--routing", "round-robin"]}
SINGLE = next(iter(SERVERS))
ONE_THREAD = {"one engine x 1 thread": ["--threads", "1"]}  # a replica's engine alone: the hop's reference


class Server:
    def __init__(self, name: str, model: str, args: list[str]):
        self.name = name
        self.server = LocalServer(model, serve_args=tuple(args)).__enter__()
        self.model = self.server.model
        self.client = httpx.Client(base_url=self.server.base_url, timeout=600)
        self.command = self.server.command_line()

    def chat(self, messages: list[dict], max_tokens: int, session: str | None) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        headers = {"x-claude-code-session-id": session} if session else {}
        t0, ttft, text, usage = time.perf_counter(), None, "", {}
        with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    if delta and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += delta
                usage = chunk.get("usage") or usage
        return {"text": text, "ttft_s": ttft or time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}

    def completion(self, prompt: list[int], max_tokens: int) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        self.client.post("/v1/completions", json=body).raise_for_status()

    def close(self):
        self.client.close()
        self.server.__exit__(None, None, None)


def in_parallel(jobs) -> float:
    """Runs each job on its own thread -> the wall time of all of them."""
    threads = [threading.Thread(target=job) for job in jobs]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def agent_sessions(servers: dict[str, Server], a) -> dict:
    """Per server, per session, per turn: the reply and its figures; the single server's replies grow every
    conversation."""
    out = {name: [[None] * a.turns for _ in range(a.sessions)] for name in servers}
    conversations = [[{"role": "system", "content": system_prompt()}, {"role": "user", "content": TASKS[s % 2]}]
                     for s in range(a.sessions)]
    tools = [tool_results(s, a.turns) for s in range(a.sessions)]

    def session(name: str, s: int):
        server, messages = servers[name], conversations[s]
        for t in range(a.turns):
            asked = messages if name == SINGLE else histories[s][t]
            out[name][s][t] = server.chat(asked, a.max_tokens, f"session-{s}" if a.session_header else None)
            if name == SINGLE:
                histories[s].append(list(messages))
                messages += [{"role": "assistant", "content": out[name][s][t]["text"]},
                             {"role": "user", "content": tools[s][t]}]

    histories = [[] for _ in range(a.sessions)]
    for name in servers:  # the single server first: its replies make the conversations the others replay
        in_parallel([lambda s=s, name=name: session(name, s) for s in range(a.sessions)])
        print(f"  agent sessions on {name}: done", flush=True)
    return out


def throughput(server: Server, a, run: int) -> float:
    rng = np.random.default_rng(a.seed + run)
    work = [[[int(x) for x in rng.integers(100, 40000, a.prompt_tokens)] for _ in range(a.requests)]
            for _ in range(a.users)]
    seconds = in_parallel([lambda reqs=reqs: [server.completion(ids, a.output_tokens) for ids in reqs]
                           for reqs in work])
    return a.users * a.requests * a.output_tokens / seconds


def request_latency(server: Server, n: int = 20) -> list[float]:
    prompt = list(range(1000, 1064))
    server.completion(prompt, 1)  # cached from now on
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        server.completion(prompt, 1)
        times.append(time.perf_counter() - t0)
    return times


def in_ms(s: dict) -> dict:
    return {**s, **{k: s[k] * 1000 for k in ("min", "median", "max")}}


def latency_only(a):
    """Phase 3 alone, with one engine on one thread beside the others, `--runs` rounds in alternation."""
    names = [*SERVERS, *ONE_THREAD]
    servers, latency = {}, {name: [] for name in names}
    try:
        for name, args in {**SERVERS, **ONE_THREAD}.items():
            servers[name] = Server(name, a.model, a.serve_args.split() + args)
        for _ in range(a.runs):
            for name in names:
                latency[name] += request_latency(servers[name])
    finally:
        for server in servers.values():
            server.close()
    summary = {name: stats(latency[name]) for name in names}
    reference = summary["one engine x 1 thread"]["median"]
    rows = [[name, fmt_range(in_ms(s), ".1f"), f"{1000 * (s['median'] - reference):+.1f}"]
            for name, s in summary.items()]
    result = {"benchmark": "cluster-latency", **git_state(), "command": command_line(), "machine": machine(),
              "model": a.model, "servers": {n: s.command for n, s in servers.items()}, "latency_s": summary}
    out = Path(a.out + "-latency")
    write_json(out.with_suffix(".json"), result)
    lines = [f"# A 1-token request of a cached 64-token prompt ({a.model}), {a.runs} x 20 in a row per server", "",
             f"`{command_line()}` at {result['commit'][:10]}{' (dirty)' if result['dirty'] else ''}", "",
             markdown_table(["server", "latency (ms, median (min-max))", "vs one engine x 1 thread (ms)"], rows)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--session-header", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="--speculate none --kv-disk-gb 0 --max-seq-len 8192")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cluster"))
    p.add_argument("--latency-only", action="store_true")
    a = p.parse_args()
    if a.latency_only:
        return latency_only(a)

    print("starting the servers ...", flush=True)
    servers = {}
    try:
        for name, args in SERVERS.items():
            servers[name] = Server(name, a.model, a.serve_args.split() + args)
        sessions = agent_sessions(servers, a)
        tok_s = {name: [] for name in servers}
        for run in range(a.runs):  # alternate runs: each server's r-th run meets the same machine state
            for name, server in servers.items():
                tok_s[name].append(throughput(server, a, run))
                print(f"  throughput run {run + 1} {name}: {tok_s[name][-1]:.1f} tok/s", flush=True)
        latency = {name: request_latency(server) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()

    rows, summary = [], {}
    for name in servers:
        later = [turn for s in sessions[name] for turn in s[1:]]
        equal = sum(sessions[name][s][t]["text"] == sessions[SINGLE][s][t]["text"]
                    for s in range(a.sessions) for t in range(a.turns))
        summary[name] = {
            "hit_rate_from_turn_2": sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later),
            "replies_equal_to_single": equal, "replies": a.sessions * a.turns,
            "ttft_from_turn_2_s": stats([t["ttft_s"] for t in later]),
            "throughput_tok_s": stats(tok_s[name]), "request_latency_s": stats(latency[name])}
    for name, s in summary.items():
        s["hit_rate_over_single"] = s["hit_rate_from_turn_2"] / summary[SINGLE]["hit_rate_from_turn_2"]
        s["throughput_over_single"] = s["throughput_tok_s"]["median"] / summary[SINGLE]["throughput_tok_s"]["median"]
        s["ingress_overhead_ms"] = 1000 * (s["request_latency_s"]["median"]
                                           - summary[SINGLE]["request_latency_s"]["median"])
        rows.append([name, f"{100 * s['hit_rate_from_turn_2']:.1f}% ({100 * s['hit_rate_over_single']:.1f}%)",
                     f"{s['replies_equal_to_single']}/{s['replies']}",
                     fmt_range(in_ms(s["ttft_from_turn_2_s"]), ".0f"), fmt_range(s["throughput_tok_s"], ".1f"),
                     f"{s['throughput_over_single']:.3f}", f"{s['request_latency_s']['median'] * 1000:.1f}",
                     f"{s['ingress_overhead_ms']:+.1f}"])
    result = {"benchmark": "cluster", **git_state(), "command": command_line(), "machine": machine(),
              "model": a.model, "servers": {n: s.command for n, s in servers.items()}, "args": vars(a),
              "summary": summary,
              "sessions": {n: [[{k: v for k, v in t.items() if k != "text"} for t in s] for s in v]
                           for n, v in sessions.items()}}
    out = Path(a.out)
    write_json(out.with_suffix(".json"), result)
    headers = ["server", "hit rate from turn 2 (of one engine's)", "replies = one engine's",
               "TTFT from turn 2 (ms, min/med/max)", "tok/s, 8 users (min/med/max)", "x one engine", "1-token request (ms)", "vs one engine (ms)"]
    lines = [f"# Replicas against one engine ({a.model}, {a.sessions} sessions x {a.turns} turns, {a.users} users)",
             "", f"`{command_line()}` at {result['commit'][:10]}{' (dirty)' if result['dirty'] else ''}", "",
             markdown_table(headers, rows)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
