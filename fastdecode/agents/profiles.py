"""How each coding agent connects to a fastdecode server: its environment and arguments for one run (nothing written
to disk), and the settings `--config` writes into the agent's own configuration for later runs (and `--restore`
takes out again). docs/agents.md says what each agent sends and why these settings."""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

LONG_MS = "1800000"  # a 20k-token first prompt prefills for minutes on a CPU; agents' own timeouts are shorter
NO_KEY = "fastdecode"  # what an agent sends when the server wants no key (some refuse to run without one)
MARK_BEGIN = "# >>> fastdecode launch: `fastdecode launch codex --restore` removes this block"
MARK_END = "# <<< fastdecode launch"


@dataclass(frozen=True)
class Endpoint:
    """The server an agent talks to."""
    url: str  # http://127.0.0.1:8000, without /v1
    model: str  # the served model id: every model name the agent sends must be this one
    context: int  # the server's context length (its max_model_len)
    key: str | None = None  # the API key, when the server wants one
    reply_tokens: int | None = None  # what the agent may ask a reply to run to (None: output_tokens' default)

    @property
    def token(self) -> str:
        return self.key or NO_KEY

    @property
    def output_tokens(self) -> int:
        """A reply's ceiling, for agents that would ask for more than the context holds (Claude Code asks for 32k):
        by default a quarter of the context, at most 8192."""
        return self.reply_tokens or max(256, min(8192, self.context // 4))


@dataclass(frozen=True)
class Agent:
    name: str  # the command: claude, codex, opencode
    title: str
    package: str  # npm package
    batch_command: str  # its non-interactive form, what `-p PROMPT` becomes: `claude -p`, `codex exec`, `opencode run`

    def install_hint(self) -> str:
        return f"npm install -g {self.package}"

    def env(self, e: Endpoint, base: dict[str, str]) -> dict[str, str]:
        """`base` (the user's environment) with what points the agent at `e`."""
        raise NotImplementedError

    def args(self, e: Endpoint) -> list[str]:
        """Arguments before the user's."""
        return []

    def batch_args(self, prompt: str) -> list[str]:
        return [*self.batch_command.split()[1:], prompt]

    def by_hand(self, e: Endpoint) -> str:
        """One shell line that runs the agent against `e` without `fastdecode launch`."""
        assigns = [f"{k}={shlex.quote(v)}" for k, v in self.env(e, {}).items()]
        return " ".join([*assigns, self.name, *map(shlex.quote, self.args(e))])

    def config_path(self, home: Path) -> Path:
        raise NotImplementedError

    def write_config(self, e: Endpoint, home: Path, record: dict) -> None:
        """Into the agent's own configuration under `home`; `record` (kept between runs) holds what was there
        before the first time, for restore."""
        raise NotImplementedError

    def restore_config(self, home: Path, record: dict) -> None:
        raise NotImplementedError


class ClaudeCode(Agent):
    """Environment only: Anthropic's variables, every model alias the served id (Claude Code names haiku for
    background calls and subagents: any other id would be a 404)."""
    ALIASES = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
               "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")

    def settings(self, e: Endpoint) -> dict[str, str]:
        # A bearer token, not ANTHROPIC_API_KEY: an interactive Claude Code asks once whether to trust a custom API
        # key and writes the answer into the user's ~/.claude.json.
        return {"ANTHROPIC_BASE_URL": e.url, "ANTHROPIC_AUTH_TOKEN": e.token,
                **{alias: e.model for alias in self.ALIASES}}

    @staticmethod
    def tunables(e: Endpoint) -> dict[str, str]:
        """Defaults the user's environment may override."""
        return {"API_TIMEOUT_MS": LONG_MS, "CLAUDE_STREAM_IDLE_TIMEOUT_MS": LONG_MS,
                "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": LONG_MS, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(e.output_tokens)}

    def env(self, e, base):
        env = {k: v for k, v in base.items() if k != "ANTHROPIC_API_KEY"}  # it would win over the token
        return {**self.tunables(e), **env, **self.settings(e)}

    def by_hand(self, e):
        settings = {**self.settings(e), "API_TIMEOUT_MS": LONG_MS}
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in settings.items()), self.name])

    def config_path(self, home):
        return home / ".claude" / "settings.json"

    def write_config(self, e, home, record):
        path = self.config_path(home)
        settings = read_json(path)
        env = settings.setdefault("env", {})
        ours = {**self.tunables(e), **self.settings(e)}
        previous = record.setdefault("previous_env", {})  # an earlier --config's record holds the user's values
        for k in ours:
            previous.setdefault(k, env.get(k))
        env.update(ours)
        write_json(path, settings)

    def restore_config(self, home, record):
        path = self.config_path(home)
        settings = read_json(path)
        env = settings.get("env", {})
        for k, previous in record.get("previous_env", {}).items():
            if previous is None:
                env.pop(k, None)
            else:
                env[k] = previous
        if not env:
            settings.pop("env", None)
        write_json(path, settings)


class Codex(Agent):
    """`-c` overrides on the command line (Codex parses each value as TOML): a provider of its own, nothing written.
    `--config` writes the same as a `fastdecode` provider and profile (`codex --profile fastdecode`)."""

    @staticmethod
    def provider(e: Endpoint) -> dict:
        return {"name": "fastdecode", "base_url": f"{e.url}/v1", "wire_api": "responses",
                "env_key": "FASTDECODE_API_KEY", "stream_idle_timeout_ms": int(LONG_MS)}

    @staticmethod
    def profile(e: Endpoint) -> dict:
        return {"model_provider": "fastdecode", "model": e.model, "model_context_window": e.context}

    def env(self, e, base):
        return {**base, "FASTDECODE_API_KEY": e.token}

    def args(self, e):
        overrides = {**{f"model_providers.fastdecode.{k}": v for k, v in self.provider(e).items()},
                     **self.profile(e)}
        return [arg for k, v in overrides.items() for arg in ("-c", f"{k}={toml_value(v)}")]

    def config_path(self, home):
        return Path(os.environ.get("CODEX_HOME") or home / ".codex") / "config.toml"

    def write_config(self, e, home, record):
        path = self.config_path(home)
        text = without_block(path.read_text() if path.exists() else "")
        block = [MARK_BEGIN, "[model_providers.fastdecode]", *toml_lines(self.provider(e)), "",
                 "[profiles.fastdecode]", *toml_lines(self.profile(e)), MARK_END]
        write_text(path, (text.rstrip("\n") + "\n\n" if text.strip() else "") + "\n".join(block) + "\n")

    def restore_config(self, home, record):
        path = self.config_path(home)
        if path.exists():
            text = without_block(path.read_text())
            write_text(path, text.rstrip("\n") + "\n" if text.strip() else "")


class OpenCode(Agent):
    """OPENCODE_CONFIG_CONTENT, which opencode merges over its own configuration: a provider of its own."""

    @staticmethod
    def provider(e: Endpoint) -> dict:
        return {"npm": "@ai-sdk/openai-compatible", "name": "fastdecode",
                "options": {"baseURL": f"{e.url}/v1", "apiKey": e.token, "timeout": False},
                "models": {e.model: {"name": e.model,
                                     "limit": {"context": e.context, "output": e.output_tokens}}}}

    def content(self, e: Endpoint) -> dict:
        return {"provider": {"fastdecode": self.provider(e)}, "model": f"fastdecode/{e.model}",
                "small_model": f"fastdecode/{e.model}"}

    def env(self, e, base):
        return {**base, "OPENCODE_CONFIG_CONTENT": json.dumps(self.content(e))}

    def config_path(self, home):
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        return config / "opencode" / "opencode.json"

    def write_config(self, e, home, record):
        path = self.config_path(home)
        config = read_json(path)
        previous = record.setdefault("previous", {})
        for k in ("model", "small_model"):
            previous.setdefault(k, config.get(k))
        config.setdefault("provider", {})["fastdecode"] = self.provider(e)
        config.update({k: v for k, v in self.content(e).items() if k != "provider"})
        write_json(path, config)

    def restore_config(self, home, record):
        path = self.config_path(home)
        config = read_json(path)
        config.get("provider", {}).pop("fastdecode", None)
        if config.get("provider") == {}:
            config.pop("provider")
        for k, previous in record.get("previous", {}).items():
            if previous is None:
                config.pop(k, None)
            else:
                config[k] = previous
        write_json(path, config)


AGENTS = {a.name: a for a in (
    ClaudeCode("claude", "Claude Code", "@anthropic-ai/claude-code", "claude -p"),
    Codex("codex", "Codex CLI", "@openai/codex", "codex exec"),
    OpenCode("opencode", "opencode", "opencode-ai", "opencode run"),
)}


# ---- the files --config edits ----------------------------------------------------------------------------------
class ConfigError(ValueError):
    pass


def read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as e:  # e.g. comments (JSONC): not ours to rewrite
        raise ConfigError(f"{path} is not plain JSON ({e}); edit it by hand") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return value


def write_json(path: Path, value: dict) -> None:
    write_text(path, json.dumps(value, indent=2) + "\n")


def write_text(path: Path, text: str) -> None:
    """Whole or not at all: a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.fastdecode-{os.getpid()}")
    tmp.write_text(text)
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def without_block(text: str) -> str:
    """`text` less the lines between our markers (theirs included)."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == MARK_BEGIN:
            inside = True
        elif inside and line.rstrip("\n") == MARK_END:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(out)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))  # a TOML basic string takes JSON's escapes


def toml_lines(table: dict) -> list[str]:
    return [f"{k} = {toml_value(v)}" for k, v in table.items()]
