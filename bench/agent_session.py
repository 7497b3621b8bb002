"""A coding agent's session, replayed: every turn resends the whole, growing conversation (a long system prompt, the
replies so far, a tool result per turn), as Claude Code, Codex or aider do. Reports time to first token and cached
prompt tokens per turn for `fastdecode serve` with its prefix cache and without it (--no-prefix-cache), and for
llama-cpp-python (in process; it reuses the longest common prefix of its previous call), side by side in one run.

Every engine sees the same conversation: the replies are the first engine's, so prompts match token for token.

    python bench/agent_session.py                      # SmolLM2-135M, 10 turns, 2 sessions
    python bench/agent_session.py --peers ''           # fastdecode only
    python bench/agent_session.py --tp 2 --threads 1 --serve-args '--speculate none' --peers ''  # 2 ranks (torchrun)
    python bench/agent_session.py --model ~/.cache/fastdecode/shapes/qwen3-30b-a3b-Q4_0.gguf --serve-args \
        '--speculate none' --no-compare-no-cache --peers ''   # one server: a model that fits in memory once
    python bench/agent_session.py --restart --model ~/.cache/fastdecode/shapes/qwen2.5-coder-1.5b-Q4_0.gguf \
        --serve-args '' --out bench/results/agent_restart-1.5b    # new sessions' first turns around a restart
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import command_line, fmt, git_state, machine, markdown_table, stats, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NO_CACHE = "fastdecode --no-prefix-cache"
TASKS = ["Find why the scheduler can preempt a sequence twice in one step and fix it.",
         "Add a --max-batch option to the bench command and document it."]


def system_prompt(tokens_hint: int = 1400) -> str:
    """An agent's instructions and tool list: about 1.4k tokens of this repository's own docs."""
    text = "You are a coding agent working in the fastdecode repository. Use the tools to read and edit files.\n\n"
    text += "Tools: read_file(path), edit_file(path, old, new), run(command), search(pattern).\n\n"
    for doc in ("docs/server.md", "docs/speculative.md", "docs/lab.md"):
        text += (ROOT / doc).read_text()
        if len(text) > tokens_hint * 4:
            break
    return text[:tokens_hint * 4]


def tool_results(session: int, turns: int) -> list[str]:
    """A ~250-token slice of a source file per turn, as a read_file tool would return it."""
    files = sorted((ROOT / "fastdecode").rglob("*.py"))
    out = []
    for turn in range(turns):
        path = files[(7 * session + 3 * turn) % len(files)]
        lines = path.read_text().splitlines()[:40]
        out.append(f"Tool result for read_file({path.relative_to(ROOT)}):\n" + "\n".join(lines)[:1000])
    return out


class Server:
    """`fastdecode serve` on a free port, measured from the client: TTFT is request sent -> first content token."""

    def __init__(self, name: str, model: str, serve_args: list[str]):
        from fastdecode.lab.local_server import LocalServer

        self.name = name
        self.server = LocalServer(model, serve_args=tuple(serve_args)).__enter__()
        self.client = httpx.Client(base_url=self.server.base_url + "/v1", timeout=600)
        self.command = self.server.command_line()

    def stream(self, messages: list[dict], max_tokens: int, **extra) -> dict:
        """One streamed chat completion -> {"times": seconds from the request to each content chunk, "text", "usage",
        "fastdecode" (the server's own figures)}."""
        body = {"model": self.server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **extra}
        t0, out = time.perf_counter(), {"times": [], "text": "", "usage": {}, "fastdecode": {}}
        with self.client.stream("POST", "/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    if delta:
                        out["times"].append(time.perf_counter() - t0)
                    out["text"] += delta
                out["usage"] = chunk.get("usage") or out["usage"]
                out["fastdecode"] = chunk.get("fastdecode") or out["fastdecode"]
        return out

    def turn(self, messages: list[dict], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        r = self.stream(messages, max_tokens)
        return {"ttft_s": r["times"][0] if r["times"] else time.perf_counter() - t0, "text": r["text"],
                "prompt_tokens": r["usage"].get("prompt_tokens"),
                "cached_tokens": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
                "engine_ttft_s": r["fastdecode"].get("ttft_s")}

    def close(self):
        self.client.close()
        self.server.__exit__(None, None, None)


class LlamaCpp:
    """llama-cpp-python in process, as its users run it: one Llama object that keeps its KV cache between calls."""

    def __init__(self, model: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        from fastdecode.loading.catalog import resolve

        self.name = "llama.cpp"
        self.llm = Llama(model_path=str(resolve(model)), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.command = f"llama_cpp.Llama({resolve(model).name}, n_ctx={n_ctx}, n_threads={threads})"

    def turn(self, messages: list[dict], max_tokens: int) -> dict:
        t0, ttft, text = time.perf_counter(), None, ""
        for chunk in self.llm.create_chat_completion(messages, max_tokens=max_tokens, temperature=0, stream=True):
            delta = chunk["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta
        return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": text,
                "prompt_tokens": None, "cached_tokens": None, "engine_ttft_s": None}

    def close(self):
        self.llm.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="per rank with --tp")
    p.add_argument("--tp", type=int, default=1, help="ranks of a tensor-parallel server (torchrun; docs/parallel.md)")
    p.add_argument("--serve-args", default="--quant int4 --speculate none",
                   help="arguments for both fastdecode servers (the threads are added)")
    p.add_argument("--peers", default="llama.cpp", help="comma-separated: llama.cpp, or '' for none")
    p.add_argument("--compare-no-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="also a server without the prefix cache (every engine holds the model at once)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_session"))
    p.add_argument("--restart", action="store_true",
                   help="new Claude-Code-shaped sessions' first turns: cold, from RAM, and after a restart from the "
                        "disk tier (bench/agent_restart.py)")
    p.add_argument("--repeats", type=int, default=1, help="(--restart) cold/RAM/restart rounds, each from an empty "
                   "KV folder")
    p.add_argument("--max-seq-len", type=int, default=32768, help="(--restart) the servers' context")
    p.add_argument("--schema-chars", type=int, default=64_000, help="(--restart) characters of the 24 tools' "
                   "schemas (Claude Code's: about 64k)")
    p.add_argument("--drop-caches", action="store_true", help="(--restart, root) empty the page cache before the "
                   "restarted server starts")
    a = p.parse_args()
    if a.restart:
        sys.path.insert(0, str(ROOT / "bench"))
        from agent_restart import run as run_restart

        return run_restart(a)

    # No disk tier: a session replayed earlier (the same prompts) would come back from disk, not be prefilled
    # (--restart measures that tier).
    serve = a.serve_args.split() + ["--threads", str(a.threads), "--max-seq-len", "8192", "--kv-disk-gb", "0"]
    serve += ["--tp", str(a.tp)] if a.tp > 1 else []
    print("starting the servers ...", flush=True)
    engines = [Server("fastdecode", a.model, serve)]
    if a.compare_no_cache:
        engines.append(Server(NO_CACHE, a.model, serve + ["--no-prefix-cache"]))
    if "llama.cpp" in a.peers.split(","):
        try:
            engines.append(LlamaCpp(a.model, a.threads, 8192))
        except ImportError:
            print("llama-cpp-python is not installed (make bench-deps): measuring fastdecode only", flush=True)
    rows = []
    try:
        for session in range(a.sessions):
            messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": TASKS[session % 2]}]
            results = tool_results(session, a.turns)
            for turn in range(1, a.turns + 1):
                row = {"session": session, "turn": turn}
                for e in engines:  # interleaved: every engine answers this turn before the next turn
                    row[e.name] = e.turn(messages, a.max_tokens)
                rows.append(row)
                first = row[engines[0].name]
                print(f"session {session} turn {turn}: prompt {first['prompt_tokens']} tokens, " + ", ".join(
                    f"{e.name} {row[e.name]['ttft_s'] * 1000:.0f} ms" for e in engines), flush=True)
                messages += [{"role": "assistant", "content": first["text"]},
                             {"role": "user", "content": results[turn - 1]}]
    finally:
        for e in engines:
            e.close()

    names = [e.name for e in engines]
    late = [r for r in rows if r["turn"] >= 3]
    summary = {n: stats([r[n]["ttft_s"] for r in late]) for n in names}
    result = {"benchmark": "agent_session", **git_state(), "command": command_line(), "machine": machine(),
              "model": a.model, "engines": {e.name: e.command for e in engines}, "turns": a.turns,
              "sessions": a.sessions, "max_tokens": a.max_tokens,
              "rows": [{k: ({kk: vv for kk, vv in v.items() if kk != "text"} if isinstance(v, dict) else v)
                        for k, v in r.items()} for r in rows],
              "ttft_from_turn_3": summary}
    ratios = {"cache_over_no_cache_from_turn_3": NO_CACHE, "fastdecode_over_llama_cpp_from_turn_3": "llama.cpp"}
    for key, peer in ratios.items():
        if peer in names:
            result[key] = stats([r[names[0]]["ttft_s"] / r[peer]["ttft_s"] for r in late])
    out = Path(a.out)
    write_json(out.with_suffix(".json"), result)
    headers = ["session", "turn", "prompt tokens", "cached"] + [f"TTFT {n} (ms)" for n in names]
    table = [[str(r["session"]), str(r["turn"]), str(r[names[0]]["prompt_tokens"]),
              str(r[names[0]]["cached_tokens"])] + [fmt(r[n]["ttft_s"] * 1000, ".0f") for n in names] for r in rows]
    lines = [f"# Agent session replay ({a.model})", "", f"`{command_line()}` at {result['commit'][:10]}"
             f"{' (dirty)' if result['dirty'] else ''}", "", markdown_table(headers, table), "",
             "From turn 3 on, median TTFT: " + ", ".join(f"{n} {summary[n]['median'] * 1000:.0f} ms" for n in names)
             + "."]
    if NO_CACHE in names:
        lines[-1] += f" With the cache / without: {result['cache_over_no_cache_from_turn_3']['median']:.3f} (median)."
    if "llama.cpp" in names:
        lines[-1] += f" fastdecode / llama.cpp: {result['fastdecode_over_llama_cpp_from_turn_3']['median']:.2f}."
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
