"""New Claude-Code-shaped sessions around a server restart: `python bench/agent_session.py --restart`.

Every new Claude Code session starts with the same ~20k tokens (a system prompt and 24 tool schemas) before the
user's first words. This replays new sessions' first turns through the Anthropic Messages API, as Claude Code sends
them, against `fastdecode serve`: one cold (nothing cached), one from the engine's RAM cache (a second session on the
same server), then the server is stopped and started again and one more session's first turn comes from the disk
tier (engine/kv_disk.py). Each repeat starts from an empty KV folder of its own. Each session's billing header
differs, as Claude Code's does with the first message (the restarted one also names a newer version); the server leaves
it out of the prompt.

The prompt is shaped like the one Claude Code 2.1.197 sends (docs/agents.md), not copied: a billing header block, a
~6k-character harness prompt and 24 tools named as Claude Code's, whose descriptions are this repository's docs
(~64k characters of schema in all; --schema-chars makes it shorter, for a model whose cold prefill of it would take
too long). --drop-caches (root) empties the page cache before the restarted server starts,
so its blocks (and its weights) come from the disk itself, as after a reboot.

Writes JSON (with the commit) and a markdown table; disk read GB/s is the KV bytes the restarted turn read over the
time this process takes to read and check the same files (a lower bound on what the server's read reached).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import httpx

from common import command_line, fmt, git_state, machine, markdown_table, stats, write_json

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ["Agent", "Bash", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree", "ExitWorktree",
         "NotebookEdit", "Read", "ReportFindings", "ScheduleWakeup", "SendMessage", "Skill", "TaskCreate", "TaskGet",
         "TaskList", "TaskOutput", "TaskStop", "TaskUpdate", "WebFetch", "WebSearch", "Workflow", "Write"]
TASKS = ["Find why the scheduler can preempt a sequence twice in one step and fix it.",
         "Add a --max-batch option to the bench command and document it.",
         "Explain how the prefix cache decides which block to evict.",
         "Write a test for the detokenizer's handling of a stop string split across tokens."]


def docs_text() -> str:
    return "\n\n".join((ROOT / "docs" / name).read_text() for name in sorted(os.listdir(ROOT / "docs"))
                       if name.endswith(".md"))


def claude_code_request(task: str, version: str, schema_chars: int = 64_000, max_tokens: int = 16) -> dict:
    """A Messages request shaped like Claude Code's first one of a session."""
    text = docs_text()
    harness = "You are an interactive agent that helps users with software engineering tasks.\n\n" + text[:6000]
    per_tool = schema_chars // len(TOOLS)
    tools = []
    for i, name in enumerate(TOOLS):
        at = 6000 + i * per_tool
        tools.append({"name": name, "description": text[at:at + per_tool - 300], "input_schema": {
            "type": "object", "additionalProperties": False, "required": ["target"],
            "properties": {"target": {"type": "string", "description": f"What {name} acts on."},
                           "options": {"type": "object", "description": "Settings of this call."},
                           "timeout": {"type": "number", "description": "Seconds before it gives up."}}}})
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK."},
              {"type": "text", "text": harness, "cache_control": {"type": "ephemeral"}}]
    user = [{"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-06.\n</system-reminder>"},
            {"type": "text", "text": task}]
    return {"model": "", "max_tokens": max_tokens, "system": system, "tools": tools, "stream": True,
            "messages": [{"role": "user", "content": user}]}


def first_turn(server, body: dict) -> dict:
    """One streamed Messages request -> TTFT (request sent -> first text or tool delta) and the server's figures."""
    body = {**body, "model": server.model}
    t0, ttft, usage, ours = time.perf_counter(), None, {}, {}
    with httpx.Client(base_url=server.base_url, timeout=3600) as client:
        with client.stream("POST", "/v1/messages", json=body, headers={"x-api-key": "bench"}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "content_block_delta" and ttft is None:
                    ttft = time.perf_counter() - t0
                if event["type"] == "message_delta":
                    usage, ours = event.get("usage", {}), event.get("fastdecode", {})
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0),
            "cached_tokens": usage.get("cache_read_input_tokens"), "disk_cached_tokens": ours.get("disk_cached_tokens"),
            "engine_ttft_s": ours.get("ttft_s")}


def read_rate(kv_dir: Path, drop: bool) -> dict:
    """Reads and checks every block file as the tier does (the file, a CRC-32 of it) -> bytes and GB/s."""
    if drop:
        drop_caches()
    files = sorted(kv_dir.rglob("*.kv"))
    t0, size = time.perf_counter(), 0
    for path in files:
        data = path.read_bytes()
        zlib.crc32(data)
        size += len(data)
    seconds = time.perf_counter() - t0
    return {"files": len(files), "bytes": size, "seconds": seconds, "gb_s": size / seconds / 1e9 if seconds else 0}


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run(args) -> None:
    from fastdecode.lab.local_server import LocalServer

    serve = args.serve_args.split() + ["--threads", str(args.threads), "--max-seq-len", str(args.max_seq_len)]
    rows = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fastdecode-kv-") as kv_dir:
            os.environ["FASTDECODE_KV_DIR"] = kv_dir  # the servers' disk tier: empty at each repeat
            row = {"repeat": repeat}
            with LocalServer(args.model, serve_args=tuple(serve)) as server:
                row["command"] = server.command_line()
                row["cold"] = first_turn(server, claude_code_request(TASKS[0], "2.1.197.8f6", args.schema_chars))
                print(f"repeat {repeat}: cold {row['cold']['ttft_s']:.2f} s, "
                      f"{row['cold']['prompt_tokens']} prompt tokens", flush=True)
                row["ram"] = first_turn(server, claude_code_request(TASKS[1], "2.1.197.82c", args.schema_chars))
                print(f"repeat {repeat}: from RAM {row['ram']['ttft_s']:.2f} s", flush=True)
            if args.drop_caches:
                drop_caches()
            with LocalServer(args.model, serve_args=tuple(serve)) as server:  # the restart
                row["disk"] = first_turn(server, claude_code_request(TASKS[2], "2.1.201.3a0", args.schema_chars))
            print(f"repeat {repeat}: after the restart {row['disk']['ttft_s']:.2f} s "
                  f"({row['disk']['disk_cached_tokens']} tokens from disk)", flush=True)
            row["read"] = read_rate(Path(kv_dir), args.drop_caches)
            rows.append(row)
        os.environ.pop("FASTDECODE_KV_DIR", None)

    summary = {k: stats([r[k]["ttft_s"] for r in rows]) for k in ("cold", "ram", "disk")}
    result = {"benchmark": "agent_session_restart", **git_state(), "command": command_line(), "machine": machine(),
              "model": args.model, "serve": rows[0]["command"], "drop_caches": args.drop_caches, "rows": rows,
              "ttft": summary, "disk_over_cold": stats([r["disk"]["ttft_s"] / r["cold"]["ttft_s"] for r in rows])}
    out = Path(args.out)  # (a name such as agent_restart-1.5b has no suffix to replace)
    write_json(out.with_name(out.name + ".json"), result)
    headers = ["repeat", "prompt tokens", "TTFT cold (s)", "TTFT from RAM (s)", "TTFT after restart (s)",
               "from disk (tokens)", "disk / cold", "KV files read (GB/s)"]
    table = [[str(r["repeat"]), str(r["cold"]["prompt_tokens"]), fmt(r["cold"]["ttft_s"], ".2f"),
              fmt(r["ram"]["ttft_s"], ".2f"), fmt(r["disk"]["ttft_s"], ".2f"), str(r["disk"]["disk_cached_tokens"]),
              fmt(r["disk"]["ttft_s"] / r["cold"]["ttft_s"], ".3f"),
              f"{r['read']['bytes'] / 1e9:.2f} GB at {r['read']['gb_s']:.2f}"] for r in rows]
    lines = [f"# New Claude-Code-shaped sessions around a restart ({Path(args.model).name})", "",
             f"`{command_line()}` at {result['commit'][:10]}{' (dirty)' if result['dirty'] else ''}; "
             f"server: `{result['serve']}`", "", markdown_table(headers, table), "",
             "Median TTFT: " + ", ".join(f"{k} {summary[k]['median']:.2f} s" for k in summary)
             + f"; after the restart / cold: {result['disk_over_cold']['median']:.3f}."]
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
