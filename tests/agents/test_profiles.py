"""Each agent's settings for one run, and what --config writes into the agent's own files and --restore takes out."""
import json
import tomllib

import pytest

from fastdecode.agents.profiles import AGENTS, ConfigError, Endpoint

ENDPOINT = Endpoint("http://127.0.0.1:8123", "gemma3-270m", 32768, key="sk-team")


def test_claude_code_sends_every_model_alias_as_the_served_id_and_a_bearer_token():
    env = AGENTS["claude"].env(ENDPOINT, {"ANTHROPIC_API_KEY": "sk-ant-real", "API_TIMEOUT_MS": "5", "PATH": "/bin"})
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123" and env["ANTHROPIC_AUTH_TOKEN"] == "sk-team"
    assert "ANTHROPIC_API_KEY" not in env  # it would win over the token and send the user's real key here
    aliases = [k for k in env if k.endswith("_MODEL")]
    assert len(aliases) >= 5 and all(env[k] == "gemma3-270m" for k in aliases)
    assert env["API_TIMEOUT_MS"] == "5" and env["PATH"] == "/bin"  # the user's own settings win over our defaults
    assert int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == 8192


def test_codex_overrides_parse_as_toml_and_name_a_responses_provider():
    args = AGENTS["codex"].args(ENDPOINT)
    assert args[::2] == ["-c"] * (len(args) // 2)
    config = {}
    for override in args[1::2]:
        key, value = override.split("=", 1)
        config[key] = tomllib.loads(f"v = {value}")["v"]
    assert config["model_provider"] == "fastdecode" and config["model"] == "gemma3-270m"
    assert config["model_providers.fastdecode.base_url"] == "http://127.0.0.1:8123/v1"
    assert config["model_providers.fastdecode.wire_api"] == "responses"
    assert config["model_context_window"] == 32768
    assert AGENTS["codex"].env(ENDPOINT, {})["FASTDECODE_API_KEY"] == "sk-team"


def test_opencode_gets_its_provider_as_config_content():
    content = json.loads(AGENTS["opencode"].env(ENDPOINT, {})["OPENCODE_CONFIG_CONTENT"])
    provider = content["provider"]["fastdecode"]
    assert provider["options"]["baseURL"] == "http://127.0.0.1:8123/v1" and provider["options"]["apiKey"] == "sk-team"
    assert provider["models"]["gemma3-270m"]["limit"]["context"] == 32768
    assert content["model"] == content["small_model"] == "fastdecode/gemma3-270m"


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_by_hand_line_names_the_server(name):
    line = AGENTS[name].by_hand(ENDPOINT)
    assert "127.0.0.1:8123" in line and name in line.split()


USER_FILES = {
    "claude": (".claude/settings.json", json.dumps({"env": {"API_TIMEOUT_MS": "10"}, "theme": "dark"}, indent=2) + "\n"),
    "codex": (".codex/config.toml", 'model = "o4"\n\n[profiles.work]\nmodel = "o3"\n'),
    "opencode": (".config/opencode/opencode.json",
                 json.dumps({"model": "anthropic/claude", "provider": {"x": {"name": "x"}}}, indent=2) + "\n"),
}


@pytest.mark.parametrize("name", sorted(AGENTS))
@pytest.mark.parametrize("existing", [True, False])
def test_config_then_restore_leaves_the_users_file_as_it_was(name, existing, tmp_path, monkeypatch):
    monkeypatch.delenv("CODEX_HOME", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    agent, (relative, text) = AGENTS[name], USER_FILES[name]
    path = tmp_path / relative
    if existing:
        path.parent.mkdir(parents=True)
        path.write_text(text)
    record = {}
    agent.write_config(ENDPOINT, tmp_path, record)
    written = path.read_text()
    assert "127.0.0.1:8123" in written
    if name == "codex":
        parsed = tomllib.loads(written)
        assert parsed["profiles"]["fastdecode"]["model"] == "gemma3-270m"
        assert parsed["model"] == "o4" if existing else "model" not in parsed
    agent.write_config(ENDPOINT, tmp_path, record)  # again: still one copy, and the first values kept
    assert path.read_text().count("127.0.0.1:8123") == written.count("127.0.0.1:8123")
    record = json.loads(json.dumps(record))  # as stored between the two commands
    agent.restore_config(tmp_path, record)
    restored = path.read_text()
    if existing:
        assert restored == text
    else:
        assert restored.strip() in ("", "{}")


def test_a_config_file_with_comments_is_refused_not_rewritten(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    path = tmp_path / ".config/opencode/opencode.json"
    path.parent.mkdir(parents=True)
    path.write_text('{\n  // mine\n  "model": "x"\n}\n')
    with pytest.raises(ConfigError, match="not plain JSON"):
        AGENTS["opencode"].write_config(ENDPOINT, tmp_path, {})
    assert path.read_text() == '{\n  // mine\n  "model": "x"\n}\n'
