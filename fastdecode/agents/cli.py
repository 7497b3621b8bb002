"""`fastdecode launch claude|codex|opencode`: a coding agent on a local model in one command."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import click

from fastdecode.agents.profiles import AGENTS, Agent, ConfigError, Endpoint, read_json, write_json
from fastdecode.agents.server import LaunchedServer, free_port, port_free, running
from fastdecode.console import err
from fastdecode.errors import FastdecodeError
from fastdecode.loading.catalog import fastdecode_home

AGENT_MODEL = "gemma3-270m"  # the smallest registered model whose context (32k) holds an agent's first request


@click.command("launch", context_settings={"ignore_unknown_options": True})
@click.argument("agent_name", metavar="AGENT", type=click.Choice(sorted(AGENTS)))
@click.option("-m", "--model", default=AGENT_MODEL, show_default=True,
              help="Registered name, GGUF file or Hugging Face directory; also the model id the agent sends.")
@click.option("-p", "--prompt", default=None,
              help="Run the agent once on PROMPT, non-interactively (claude -p, codex exec, opencode run).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="A server already serving MODEL here is used; else one is started here (or on a free port).")
@click.option("--api-key", envvar="FASTDECODE_API_KEY", default=None,
              help="The server's key (or FASTDECODE_API_KEY): sent by the agent, and required by a started server.")
@click.option("--serve-args", default="", help="More `fastdecode serve` options for a started server, one string.")
@click.option("--output-tokens", type=click.IntRange(min=1), default=None,
              help="The longest reply the agent asks for (default: a quarter of the context, at most 8192).")
@click.option("--config", "write_config", is_flag=True,
              help="Also write the settings into the agent's own configuration, so that it uses this server "
                   "without `fastdecode launch` (Claude Code's ~/.claude/settings.json, Codex's ~/.codex/config.toml "
                   "profile `fastdecode`, opencode's opencode.json).")
@click.option("--restore", is_flag=True, help="Take out what --config wrote, then exit.")
@click.argument("agent_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(agent_name, model, prompt, port, api_key, serve_args, output_tokens, write_config, restore,
                   agent_args):
    """Run a coding agent (Claude Code, Codex CLI or opencode) against a local model: starts `fastdecode serve` (or
    uses one already serving the model), points the agent at it for this run only, and stops the server when the
    agent exits. Arguments after `--` go to the agent; `-p` among them means its non-interactive form.

    \b
    fastdecode launch claude
    fastdecode launch codex -m model.gguf -p "Fix the bug in calc.py"
    fastdecode launch opencode -- run "Explain main.py"
    """
    agent = AGENTS[agent_name]
    home = Path.home()
    record_path = fastdecode_home() / "launch" / f"{agent.name}.json"
    record = {}
    edit_config(lambda: record.update(read_json(record_path)))  # what an earlier --config found there
    if restore:
        edit_config(lambda: agent.restore_config(home, record))
        record_path.unlink(missing_ok=True)
        err.print(f"restored {agent.config_path(home)}")
        return
    binary = find_agent(agent)
    server, endpoint = connect(model, port, api_key, shlex.split(serve_args))
    endpoint = replace(endpoint, reply_tokens=output_tokens)
    try:
        if write_config:
            edit_config(lambda: agent.write_config(endpoint, home, record))
            write_json(record_path, record)
            err.print(f"[dim]wrote {agent.config_path(home)} (`fastdecode launch {agent.name} --restore` takes it "
                      f"out)[/dim]")
        command = [binary, *agent.args(endpoint), *agent_arguments(agent, prompt, list(agent_args))]
        err.print(f"[cyan]{agent.title} on {endpoint.model} ({endpoint.url}, context {endpoint.context:,} "
                  f"tokens; dashboard {endpoint.url}/)[/cyan]")
        code = run_agent(command, agent.env(endpoint, dict(os.environ)))
    finally:
        if server is not None:
            server.stop()
            err.print(f"[dim]stopped the server (its log: {server.log})[/dim]")
    sys.exit(code)


def find_agent(agent: Agent) -> str:
    """On PATH, or where `make agents` installs them."""
    found = shutil.which(agent.name)
    local = fastdecode_home() / "agents" / "node_modules" / ".bin" / agent.name
    if found is None and local.exists():
        found = str(local)
    if found is None:
        raise FastdecodeError(f"{agent.title} ({agent.name}) is not on PATH; install it with: {agent.install_hint()}")
    return found


def connect(model: str, port: int, key: str | None, serve_args: list[str]) -> tuple[LaunchedServer | None, Endpoint]:
    """The server on `port` if it serves `model`, else a new one (on a free port if `port` is taken)."""
    url = f"http://127.0.0.1:{port}"
    endpoint = running(url, model, key)
    if endpoint is not None:
        err.print(f"[dim]using the server at {url}[/dim]")
        return None, endpoint
    if not port_free(port):
        port = free_port()
        err.print(f"[dim]{url} does not serve {model}: starting one on port {port}[/dim]")
    server = LaunchedServer(model, port, key, serve_args,
                            fastdecode_home() / "logs" / f"serve-{port}.log").start()
    try:
        with err.status(f"starting fastdecode serve -m {model}") as status:
            endpoint = server.wait_ready(lambda line: status.update(f"starting fastdecode serve -m {model}: "
                                                                    f"[dim]{line[-100:]}[/dim]"))
    except BaseException:
        server.stop()
        raise
    return server, endpoint


def agent_arguments(agent: Agent, prompt: str | None, args: list[str]) -> list[str]:
    """The user's arguments; `-p PROMPT` (launch's own, or first after `--`) becomes the agent's batch form (Codex's
    own -p means --profile, opencode's means --password)."""
    if prompt is not None:
        return [*agent.batch_args(prompt), *args]
    if args[:1] in (["-p"], ["--print"]) and agent.name != "claude":
        return [*agent.batch_command.split()[1:], *args[1:]]
    return args


def run_agent(command: list[str], env: dict) -> int:
    """In this terminal until it exits; a Ctrl-C is the agent's to handle (interactive agents cancel a turn with
    it), so this process waits on."""
    process = subprocess.Popen(command, env=env)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def edit_config(edit) -> None:
    try:
        edit()
    except (ConfigError, OSError) as e:
        raise FastdecodeError(str(e)) from None
