"""Real coding agents against `fastdecode serve` (docs/agents.md), the check behind `make agents`.

Installs the agents with npm into a cache folder (Claude Code, which speaks the Anthropic Messages API, Codex CLI,
which speaks the OpenAI Responses API, and opencode, which speaks Chat Completions), serves gemma3-270m (32k context:
Claude Code's first request is about 20k tokens, Codex's about 9k) on a free loopback port, and runs each one
non-interactively (`claude -p`, `codex exec`, `opencode run`) on a one-file task in a scratch folder with a scratch
HOME. An agent passes when it reports no API error and the server logged its request with the tools in it and refused
none; the tiny model's answer is not judged. Writes the server log and each agent's output into the scratch folder.

    python bench/agents.py [--agents claude,codex,opencode] [--threads 2] [--timeout 1800]
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

TASK = "Fix the bug in calc.py"
BUGGY = "def add(a, b):\n    return a - b\n"
OUTPUT_LIMIT = re.compile(r"exceeded the \d+ output token maximum|Incomplete response returned, reason: max_output_tokens")
CODEX_CONFIG = """model = "{model}"
model_provider = "fastdecode"
model_reasoning_effort = "low"

[model_providers.fastdecode]
name = "fastdecode"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
stream_idle_timeout_ms = 1800000  # no byte goes out before the first token of a long prefill
"""


def cache_dir() -> Path:
    home = os.environ.get("FASTDECODE_HOME") or Path.home() / ".cache" / "fastdecode"
    return Path(home) / "agents"


def install(cache: Path, package: str, binary: str) -> Path:
    path = cache / "node_modules" / ".bin" / binary
    if not path.exists():
        if shutil.which("npm") is None:
            sys.exit(f"npm is needed to install {package} (apt-get install nodejs npm)")
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(cache), package], check=True)
    version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    print(f"{binary} {version.stdout.strip()}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, threads: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "fastdecode.server", "-m", model, "--port", str(port), "--threads", str(threads), "--max-seq-len", "32768", "--request-timeout", "3600", "--log-level", "info"]
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


def without(prefixes: tuple, home: Path) -> dict:
    """This environment with a scratch HOME and none of the agent's own variables (keys, base URLs)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(prefixes)}, "HOME": str(home)}


def claude_env(home: Path, port: int, model: str) -> dict:
    return {**without(("ANTHROPIC_", "CLAUDE_"), home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": "local", "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "API_TIMEOUT_MS": "1800000",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",  # a tiny model may ramble to the end of its context
            # Claude Code aborts and resends a stream that is silent for 5 minutes, and no byte goes out before
            # the first token: a 20k-token prefill on a busy CPU takes longer.
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "1800000",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}


OPENCODE_CONFIG = """{{
  "$schema": "https://opencode.ai/config.json",
  "provider": {{"fastdecode": {{
    "npm": "@ai-sdk/openai-compatible", "name": "fastdecode",
    "options": {{"baseURL": "http://127.0.0.1:{port}/v1", "apiKey": "local", "timeout": false}},
    "models": {{"{model}": {{"name": "{model}", "limit": {{"context": 32768, "output": 512}}}}}}}}}},
  "model": "fastdecode/{model}", "small_model": "fastdecode/{model}", "autoupdate": false, "share": "disabled"
}}
"""


def codex_env(home: Path, port: int, model: str) -> dict:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(model=model, port=port))
    return without(("OPENAI_", "CODEX_"), home)


def opencode_env(home: Path, port: int, model: str) -> dict:
    (home / ".config" / "opencode").mkdir(parents=True, exist_ok=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(OPENCODE_CONFIG.format(model=model, port=port))
    return without(("OPENCODE_", "OPENAI_", "XDG_"), home)


class Agent:
    """How to run one agent: its package, command line (after the binary) and environment, and the server log
    lines of its requests (groups: tools, prompt tokens) and of refusals. Every agent but Claude Code exits non-zero
    on an API error."""

    def __init__(self, name: str, package: str, binary: str, args: list[str], env, requests: str, endpoint: str):
        self.name, self.package, self.binary, self.args, self.env = name, package, binary, args, env
        self.requests, self.refused = re.compile(requests), re.compile(rf'"POST {endpoint}[^"]*" (4\d\d|5\d\d)')

    def command(self, path: Path, args) -> list[str]:
        turns = ["--max-turns", str(args.max_turns)] if self.name == "claude" else []
        return [str(path), *self.args, TASK, *turns]


AGENTS = {"claude": Agent("claude", "@anthropic-ai/claude-code", "claude", ["-p"], claude_env,
                          r"messages: \d+ turns, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/messages"),
          "codex": Agent("codex", "@openai/codex", "codex", ["exec", "--skip-git-repo-check"], codex_env,
                         r"responses: \d+ input items, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/responses"),
          "opencode": Agent("opencode", "opencode-ai", "opencode", ["run"], opencode_env,
                            r"chat: \d+ messages, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/chat/completions")}


def run_agent(agent: Agent, args, scratch: Path) -> str | None:
    """One agent against its own server; None when it passes, else why not."""
    path = install(cache_dir(), agent.package, agent.binary)
    work, home = scratch / agent.name / "work", scratch / agent.name / "home"
    work.mkdir(parents=True)
    home.mkdir()
    (work / "calc.py").write_text(BUGGY)
    port = free_port()
    log = scratch / agent.name / "serve.log"
    server = start_server(args.model, port, args.threads, log)
    try:
        start = time.monotonic()
        try:
            run = subprocess.run(agent.command(path, args), cwd=work, env=agent.env(home, port, args.model),
                                 capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
            output, code = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as e:
            output, code = f"{e.stdout or ''}{e.stderr or ''}\n(timed out after {args.timeout} s)", None
        seconds = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(30)
    (scratch / agent.name / "agent.out").write_text(output)
    served = log.read_text(errors="replace")
    seen, refused = agent.requests.findall(served), agent.refused.findall(served)
    # A tiny model may ramble to the output limit; the agent then reports that (Claude Code as an "API Error", Codex
    # as an incomplete response and exit code 1), which shows the reply's end was understood, not a protocol fault.
    # `claude -p --max-turns 1` also exits 1 when the model wanted another turn.
    rambled = bool(OUTPUT_LIMIT.search(output))
    api_error = code is None or (not rambled and ("API Error" in output or (agent.name != "claude" and code != 0)))
    if rambled:
        print(f"{agent.name}: the model reached its output limit (model behaviour, not a protocol fault)")
    print(f"{agent.name} ran {seconds:.0f} s, exit code {code}; requests with tools: "
          f"{', '.join(f'{t} tools / {p} tokens' for t, p in seen) or 'none'}; refused: {refused or 'none'}")
    print(f"output: {output.strip()[-500:]}")
    if api_error or not seen or refused:
        return ("it reported an API error, failed or timed out" if api_error else
                "the server never saw its tools" if not seen else f"HTTP {refused}")
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds Claude Code may take")
    parser.add_argument("--max-turns", type=int, default=1, help="Claude Code's; 1: one request, enough to check "
                        "the protocol")
    parser.add_argument("--agents", default=",".join(AGENTS), help=f"comma-separated, of {', '.join(AGENTS)}")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="fastdecode-agents-"))
    failed = {}
    for name in args.agents.split(","):
        if (why := run_agent(AGENTS[name], args, scratch)) is not None:
            failed[name] = why
    print(f"logs in {scratch}")
    if failed:
        sys.exit("FAIL: " + "; ".join(f"{name}: {why}" for name, why in failed.items()))
    print("PASS")


if __name__ == "__main__":
    main()
