"""`fastdecode launch` end to end, with stand-ins for the agents: each is a script named like the agent that reads
the settings launch gave it, as the agent would, and sends one request to the server they name."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from fastdecode.agents.profiles import Endpoint
from fastdecode.agents.server import LaunchedServer, free_port, port_free
from fastdecode.cli import main
from fastdecode.loading.catalog import fastdecode_home

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, sys, tomllib
    import httpx
    args, env = sys.argv[1:], os.environ
    if "ANTHROPIC_BASE_URL" in env:  # Claude Code
        r = httpx.post(env["ANTHROPIC_BASE_URL"] + "/v1/messages", timeout=300,
                       headers={{"Authorization": "Bearer " + env["ANTHROPIC_AUTH_TOKEN"]}},
                       json={{"model": env["ANTHROPIC_DEFAULT_HAIKU_MODEL"], "max_tokens": 4,
                              "messages": [{{"role": "user", "content": "hi"}}]}})
    elif "OPENCODE_CONFIG_CONTENT" in env:  # opencode
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        options = config["provider"]["fastdecode"]["options"]
        r = httpx.post(options["baseURL"] + "/chat/completions", timeout=300,
                       headers={{"Authorization": "Bearer " + options["apiKey"]}},
                       json={{"model": config["model"].split("/", 1)[1], "max_tokens": 4,
                              "messages": [{{"role": "user", "content": "hi"}}]}})
    else:  # Codex: -c key=TOML value
        overrides = {{}}
        while args[:1] == ["-c"]:
            key, value = args[1].split("=", 1)
            overrides[key] = tomllib.loads("v = " + value)["v"]
            args = args[2:]
        r = httpx.post(overrides["model_providers.fastdecode.base_url"] + "/responses", timeout=300,
                       headers={{"Authorization": "Bearer " + env[overrides["model_providers.fastdecode.env_key"]]}},
                       json={{"model": overrides["model"], "max_output_tokens": 4, "input": "hi"}})
    with open(env["STAND_IN_OUT"], "w") as f:
        json.dump({{"args": args, "status": r.status_code}}, f)
    sys.exit(3)
    """)


@pytest.fixture
def stand_ins(tmp_path):
    """A bin folder with the three stand-ins, a HOME holding the user's own Claude Code settings, the environment."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    for name in ("claude", "codex", "opencode"):
        path = bin_dir / name
        path.write_text(STAND_IN.format(python=sys.executable))
        path.chmod(0o755)
    (home / ".claude").mkdir(parents=True)
    (home / ".claude" / "settings.json").write_text('{"theme": "dark"}\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "FASTDECODE_HOME": str(fastdecode_home()), "STAND_IN_OUT": str(tmp_path / "out.json")}
    env.pop("FASTDECODE_API_KEY", None)
    return env, home, tmp_path / "out.json"


def launch(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastdecode", "launch", *args], env=env, capture_output=True,
                          text=True, timeout=900)


def test_launch_starts_a_server_runs_the_agent_and_stops_the_server(smollm2_path, stand_ins):
    env, home, out = stand_ins
    port = free_port()
    run = launch(env, "claude", "-m", str(smollm2_path), "--port", str(port), "--serve-args", "--threads 2",
                 "--", "-p", "Fix the bug")
    assert run.returncode == 3, run.stderr  # the agent's own exit code
    seen = json.loads(out.read_text())
    assert seen == {"args": ["-p", "Fix the bug"], "status": 200}
    assert port_free(port), "the server launch started is still running"
    assert (home / ".claude" / "settings.json").read_text() == '{"theme": "dark"}\n'


@pytest.fixture(scope="module")
def running_server(smollm2_path, tmp_path_factory):
    server = LaunchedServer(str(smollm2_path), free_port(), None, ["--threads", "2"],
                            tmp_path_factory.mktemp("serve") / "serve.log").start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("agent, args, expected", [
    ("codex", ["-p", "Fix the bug"], ["exec", "Fix the bug"]),
    ("opencode", ["--", "-p", "Fix the bug"], ["run", "Fix the bug"]),  # -p after --: still the batch form
])
def test_launch_uses_a_server_already_serving_the_model(running_server, stand_ins, agent, args, expected):
    env, home, out = stand_ins
    run = launch(env, agent, "-m", running_server.model, "--port", str(running_server.port), *args)
    assert run.returncode == 3, run.stderr
    assert "using the server" in run.stderr
    assert json.loads(out.read_text()) == {"args": expected, "status": 200}
    assert running_server.process.poll() is None, "launch stopped a server it did not start"
    assert not (home / ".codex").exists() and not (home / ".config").exists()  # nothing written


def test_a_missing_agent_is_one_line_naming_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("fastdecode.agents.cli.fastdecode_home", lambda: tmp_path)
    result = CliRunner().invoke(main, ["launch", "codex"])
    assert result.exit_code == 2
    assert "npm install -g @openai/codex" in result.output and "Traceback" not in result.output


def test_config_writes_the_agents_own_settings_and_restore_takes_them_out(monkeypatch, tmp_path):
    home = tmp_path / "home"
    settings = home / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text('{\n  "theme": "dark"\n}\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr("fastdecode.agents.cli.fastdecode_home", lambda: tmp_path / "fastdecode")
    monkeypatch.setattr("fastdecode.agents.cli.find_agent", lambda agent: "true")
    monkeypatch.setattr("fastdecode.agents.cli.connect", lambda *a: (None, Endpoint("http://127.0.0.1:8000", "m", 4096)))
    result = CliRunner().invoke(main, ["launch", "claude", "--config", "-p", "hi"])
    assert result.exit_code == 0, result.output
    assert json.loads(settings.read_text())["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000"
    result = CliRunner().invoke(main, ["launch", "claude", "--restore"])
    assert result.exit_code == 0 and settings.read_text() == '{\n  "theme": "dark"\n}\n'
    assert not (tmp_path / "fastdecode" / "launch" / "claude.json").exists()
