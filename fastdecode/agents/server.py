"""The server an agent talks to: one already serving the model on the port, or a `fastdecode serve` started for the
agent's run (in its own session, so the Ctrl-C an agent's interface takes does not reach it) and stopped after."""
from __future__ import annotations

import os
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


class LaunchedServer:
    """`fastdecode serve` as a child process, its output in `log`."""

    def __init__(self, model: str, port: int, key: str | None, serve_args: list[str], log: Path):
        self.model, self.port, self.key, self.log = model, port, key, log
        command = [sys.executable, "-m", "fastdecode.server", "-m", model, "--port", str(port), *serve_args]
        # The key in the environment, not on the command line where `ps` shows it.
        env = {**os.environ, "FASTDECODE_API_KEY": key} if key else None
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def last_line(self) -> str:
        try:
            lines = self.log.read_bytes()[-4096:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line.strip() for line in reversed(lines) if line.strip()), "")

    def wait_ready(self, on_wait=lambda line: None, timeout_s: float = START_TIMEOUT_S) -> Endpoint:
        """Until the server answers for its model; `on_wait(last log line)` between tries."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FastdecodeError(f"fastdecode serve exited with code {self.process.returncode}: "
                                      f"{self.last_line() or 'no output'} (log: {self.log})")
            endpoint = running(self.url, self.model, self.key)
            if endpoint is not None:
                return endpoint
            on_wait(self.last_line())
            time.sleep(0.5)
        self.stop()
        raise FastdecodeError(f"fastdecode serve did not answer within {timeout_s:.0f} s (log: {self.log})")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
