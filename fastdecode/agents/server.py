"""The server an agent talks to: one already serving the model on the port, or a `fastdecode serve` started for the
agent's run (in its own session, so the Ctrl-C an agent's interface takes does not reach it) and stopped after."""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fastdecode.agents.profiles import Endpoint
from fastdecode.errors import FastdecodeError

START_TIMEOUT_S = 900  # a first start may pull the model, build the native kernels and pack the weights


def running(url: str, model: str, key: str | None) -> Endpoint | None:
    """The server at `url`, if it answers and serves `model`."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=2)
        cards = r.json()["data"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and card.get("id") == model:
            return Endpoint(url, model, int(card.get("max_model_len") or 0), key)
    return None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(FastdecodeError):
    """`fastdecode serve` exited, or did not answer in time."""


def torchrun(args: list[str]) -> list[str]:
    """The interpreter's arguments before `-m fastdecode.server`: torchrun's, one rank per `--tp`, when asked for."""
    words = [w for a in args for w in (a.split("=", 1) if a.startswith("--tp=") else [a])]  # --tp N or --tp=N
    tp = next((int(words[i + 1]) for i, a in enumerate(words[:-1]) if a == "--tp"), 1)
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)] if tp > 1 else []


class LaunchedServer:
    """`fastdecode serve` on 127.0.0.1:`port` as a child process once started, its output in `log`."""

    def __init__(self, model: str, port: int, key: str | None, serve_args: list[str], log: Path):
        self.model, self.port, self.key, self.log = model, port, key, log
        self.args = ["-m", model, "--host", "127.0.0.1", "--port", str(port), *serve_args]
        # `python -m fastdecode.server` is `fastdecode serve` on this interpreter and environment; `--tp N` runs it
        # as N ranks under torchrun (docs/parallel.md)
        self.command = [sys.executable, *torchrun(self.args), "-m", "fastdecode.server", *self.args]
        self.process: subprocess.Popen | None = None

    def start(self) -> LaunchedServer:
        # The key in the environment, not on the command line where `ps` shows it.
        env = {**os.environ, "FASTDECODE_API_KEY": self.key} if self.key else None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> str:
        """The command as typed in a shell, for reports and errors (the key is not in it)."""
        launch = torchrun(self.args)
        prefix = ["torchrun", *launch[2:], "-m", "fastdecode"] if launch else ["fastdecode"]
        return shlex.join([*prefix, "serve", *self.args])

    def last_line(self) -> str:
        try:
            lines = self.log.read_bytes()[-4096:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line.strip() for line in reversed(lines) if line.strip()), "")

    def ready(self) -> Endpoint | None:
        """What wait_ready waits for: the endpoint once the server lists its model, else None."""
        return running(self.base_url, self.model, self.key)

    def wait_ready(self, on_wait=lambda line: None, timeout_s: float = START_TIMEOUT_S):
        """`ready()`'s answer, once it has one; `on_wait(last log line)` between tries."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"`{self.command_line()}` exited with code {self.process.returncode}: "
                                       f"{self.last_line() or 'no output'} (log: {self.log})")
            answer = self.ready()
            if answer:
                return answer
            on_wait(self.last_line())
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"`{self.command_line()}` did not answer within {timeout_s:g} s (log: {self.log})")

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
