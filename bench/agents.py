"""Real coding agents through `fastdecode launch` (docs/agents.md), the check behind `make agents`.

Installs the agents with npm into a cache folder (Claude Code, which speaks the Anthropic Messages API, Codex CLI,
which speaks the OpenAI Responses API, and opencode, which speaks Chat Completions) and runs each one as a user would:
`fastdecode launch AGENT -m gemma3-270m -p TASK` in a scratch folder, with nothing set by hand. Launch starts the
server (32k context by default: Claude Code's first request is about 20k tokens, Codex's about 9k), runs the agent
non-interactively (`claude -p`, `codex exec`, `opencode run`) and stops the server. Each agent runs with a scratch
HOME that holds configuration files of the user's own; they must be byte for byte the same after the run. An agent
passes when it reports no API error, the server logged its request with the tools in it and refused none, and the
user's files are unchanged; the tiny model's answer is not judged. Writes the server log and each agent's output into
the scratch folder.

    python bench/agents.py [--agents claude,codex,opencode] [--threads 2] [--timeout 1800]
    python bench/agents.py --threads 1 --serve-args '--replicas 2'   # through two engine replicas on Ray Serve
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastdecode.agents.server import free_port

TASK = "Fix the bug in calc.py"
BUGGY = "def add(a, b):\n    return a - b\n"
OUTPUT_LIMIT = re.compile(r"exceeded the \d+ output token maximum|Incomplete response returned, reason: max_output_tokens")
# What a user may already have: launch must leave each file as it was.
USER_CONFIG = {".claude/settings.json": '{\n  "theme": "dark",\n  "includeCoAuthoredBy": false\n}\n',
               ".codex/config.toml": 'model = "o4-mini"\n\n[profiles.work]\nmodel = "o3"\n',
               # (with the "$schema" line that opencode adds itself to a file that lacks it)
               ".config/opencode/opencode.json": '{\n  "$schema": "https://opencode.ai/config.json",\n  '
                                                 '"model": "anthropic/claude-sonnet-4",\n  "autoupdate": false\n}\n'}


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


class Agent:
    """An agent's package and the server log lines of its requests (groups: tools, prompt tokens) and refusals.
    Every agent but Claude Code exits non-zero on an API error."""

    def __init__(self, name: str, package: str, requests: str, endpoint: str):
        self.name, self.package = name, package
        self.requests, self.refused = re.compile(requests), re.compile(rf'"POST {endpoint}[^"]*" (4\d\d|5\d\d)')


AGENTS = {"claude": Agent("claude", "@anthropic-ai/claude-code",
                          r"messages: \d+ turns, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/messages"),
          "codex": Agent("codex", "@openai/codex",
                         r"responses: \d+ input items, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/responses"),
          "opencode": Agent("opencode", "opencode-ai",
                            r"chat: \d+ messages, ([1-9]\d*) tools, (\d+) prompt tokens", "/v1/chat/completions")}


def launch_env(home: Path, bin_dir: Path) -> dict:
    """This environment with a scratch HOME, the agents on PATH and none of their own variables (keys, base URLs),
    as a user who never configured them has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_",
                                                                     "OPENCODE_", "XDG_"))}
    # HOME moves, the model and kernel caches stay.
    return {**env, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
            "FASTDECODE_HOME": str(Path(os.environ.get("FASTDECODE_HOME") or Path.home() / ".cache" / "fastdecode"))}


def run_agent(agent: Agent, args, scratch: Path) -> str | None:
    """One agent through `fastdecode launch`; None when it passes, else why not."""
    path = install(cache_dir(), agent.package, agent.name)
    work, home = scratch / agent.name / "work", scratch / agent.name / "home"
    work.mkdir(parents=True)
    (work / "calc.py").write_text(BUGGY)
    subprocess.run(["git", "init", "-q", str(work)], check=True)  # a project, as users have (Codex wants one)
    for relative, text in USER_CONFIG.items():
        (home / relative).parent.mkdir(parents=True, exist_ok=True)
        (home / relative).write_text(text)
    port = free_port()
    env = launch_env(home, path.parent)
    log = Path(env["FASTDECODE_HOME"]) / "logs" / f"serve-{port}.log"  # where launch's server writes
    log.unlink(missing_ok=True)
    turns = ["--", "--max-turns", str(args.max_turns)] if agent.name == "claude" else []
    command = [sys.executable, "-m", "fastdecode", "launch", agent.name, "-m", args.model, "--port", str(port),
               "--serve-args", f"--threads {args.threads} --request-timeout 3600 {args.serve_args}",
               "--output-tokens", str(args.output_tokens), "-p", TASK, *turns]  # a tiny model may ramble on
    start = time.monotonic()
    try:
        run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout,
                             stdin=subprocess.DEVNULL)
        output, code = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{e.stdout or ''}{e.stderr or ''}\n(timed out after {args.timeout} s)", None
    seconds = time.monotonic() - start
    (scratch / agent.name / "agent.out").write_text(output)
    served = log.read_text(errors="replace") if log.exists() else ""
    if log.exists():
        shutil.copy(log, scratch / agent.name / "serve.log")
    seen, refused = agent.requests.findall(served), agent.refused.findall(served)
    changed = [r for r, text in USER_CONFIG.items() if (home / r).read_text() != text]
    # A tiny model may ramble to the output limit; the agent then reports that (Claude Code as an "API Error", Codex
    # as an incomplete response and exit code 1), which shows the reply's end was understood, not a protocol fault.
    # `claude -p --max-turns 1` also exits 1 when the model wanted another turn.
    rambled = bool(OUTPUT_LIMIT.search(output))
    api_error = code is None or (not rambled and ("API Error" in output or (agent.name != "claude" and code != 0)))
    if rambled:
        print(f"{agent.name}: the model reached its output limit (model behaviour, not a protocol fault)")
    print(f"{agent.name} ran {seconds:.0f} s, exit code {code}; requests with tools: "
          f"{', '.join(f'{t} tools / {p} tokens' for t, p in seen) or 'none'}; refused: {refused or 'none'}; "
          f"user configuration changed: {changed or 'none'}")
    print(f"output: {output.strip()[-500:]}")
    if api_error or not seen or refused or changed:
        return ("it reported an API error, failed or timed out" if api_error else
                "the server never saw its tools" if not seen else f"HTTP {refused}" if refused else
                f"launch changed {changed}")
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds Claude Code may take")
    parser.add_argument("--max-turns", type=int, default=1, help="Claude Code's; 1: one request, enough to check "
                        "the protocol")
    parser.add_argument("--output-tokens", type=int, default=512, help="the agents' reply ceiling")
    parser.add_argument("--agents", default=",".join(AGENTS), help=f"comma-separated, of {', '.join(AGENTS)}")
    parser.add_argument("--serve-args", default="", help="more `fastdecode serve` options, e.g. '--replicas 2' "
                        "(--threads is then each replica's)")
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
