"""Real coding agents against `fastdecode serve` (docs/agents.md), the check behind `make agents`.

Installs Claude Code with npm into a cache folder, serves gemma3-270m (32k context: Claude Code's first request is
about 20k tokens) on a free loopback port, and runs `claude -p` on a one-file task in a scratch folder with a scratch
HOME. Passes when Claude Code reports no API error and the server logged its request with the tools in it; the tiny
model's answer is not judged. Writes the server log and Claude Code's output into the scratch folder.

    python bench/agents.py [--threads 2] [--timeout 1800]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CLAUDE_PACKAGE = "@anthropic-ai/claude-code"
TASK = "Fix the bug in calc.py"
BUGGY = "def add(a, b):\n    return a - b\n"
TOOLS_LINE = re.compile(r"messages: \d+ turns, ([1-9]\d*) tools, (\d+) prompt tokens")


def cache_dir() -> Path:
    home = os.environ.get("FASTDECODE_HOME") or Path.home() / ".cache" / "fastdecode"
    return Path(home) / "agents"


def install_claude(cache: Path) -> Path:
    claude = cache / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        if shutil.which("npm") is None:
            sys.exit("npm is needed to install Claude Code (apt-get install nodejs npm)")
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(cache), CLAUDE_PACKAGE],
                       check=True)
    version = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=60)
    print(f"claude {version.stdout.strip()}")
    return claude


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, threads: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "fastdecode.server", "-m", model, "--port", str(port), "--quant", "int4",
               "--threads", str(threads), "--max-seq-len", "32768", "--request-timeout", "3600", "--log-level", "info"]
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # the first start may build the native kernels
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.terminate()
    sys.exit(f"the server did not come up in 600 s; see {log}")


def claude_env(home: Path, port: int, model: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    return {**env, "HOME": str(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": "local", "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "API_TIMEOUT_MS": "1800000",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",  # a tiny model may ramble to the end of its context
            # Claude Code aborts and resends a stream that is silent for 5 minutes, and no byte goes out before
            # the first token: a 20k-token prefill on a busy CPU takes longer.
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "1800000",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds Claude Code may take")
    parser.add_argument("--max-turns", type=int, default=1, help="1: one request, enough to check the protocol")
    args = parser.parse_args()

    claude = install_claude(cache_dir())
    scratch = Path(tempfile.mkdtemp(prefix="fastdecode-agents-"))
    work, home = scratch / "work", scratch / "home"
    work.mkdir()
    home.mkdir()
    (work / "calc.py").write_text(BUGGY)
    port = free_port()
    log = scratch / "serve.log"
    server = start_server(args.model, port, args.threads, log)
    try:
        start = time.monotonic()
        try:
            run = subprocess.run([str(claude), "-p", TASK, "--max-turns", str(args.max_turns)], cwd=work,
                                 env=claude_env(home, port, args.model), capture_output=True, text=True,
                                 timeout=args.timeout)
            output, code = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as e:
            output, code = f"{e.stdout or ''}{e.stderr or ''}\n(timed out after {args.timeout} s)", None
        seconds = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(30)
    (scratch / "claude.out").write_text(output)
    served = log.read_text(errors="replace")
    seen = TOOLS_LINE.findall(served)
    refused = re.findall(r'"POST /v1/messages[^"]*" (4\d\d|5\d\d)', served)
    api_error = "API Error" in output or code is None
    print(f"claude -p ran {seconds:.0f} s, exit code {code}; requests with tools: "
          f"{', '.join(f'{t} tools / {p} tokens' for t, p in seen) or 'none'}; refused: {refused or 'none'}")
    print(f"output: {output.strip()[:500]}")
    print(f"logs in {scratch}")
    if api_error or not seen or refused:
        sys.exit("FAIL: " + ("Claude Code reported an API error or timed out" if api_error else
                             "the server never saw Claude Code's tools" if not seen else f"HTTP {refused}"))
    print("PASS")


if __name__ == "__main__":
    main()
