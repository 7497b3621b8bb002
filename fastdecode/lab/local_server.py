"""A local model measured through the same HTTP path as any endpoint: the lab starts `fastdecode serve` on a free
loopback port, waits for /health, and stops it at the end, so a local number and a remote one mean the same."""
from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fastdecode.agents.server import free_port
from fastdecode.errors import FastdecodeError


class ServerStartError(FastdecodeError):
    """`fastdecode serve` is missing, exited, or did not answer /health in time."""


def torchrun(args: list[str]) -> list[str]:
    """The interpreter's arguments before `-m fastdecode.server`: torchrun's, one rank per `--tp`, when asked for."""
    words = [w for a in args for w in (a.split("=", 1) if a.startswith("--tp=") else [a])]  # --tp N or --tp=N
    tp = next((int(words[i + 1]) for i, a in enumerate(words[:-1]) if a == "--tp"), 1)
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)] if tp > 1 else []


class LocalServer:
    def __init__(self, model: str, speculate: str | None = None, serve_args: tuple[str, ...] = (),
                 startup_timeout_s: float = 600.0):
        self.model, self.speculate, self.startup_timeout_s = model, speculate, startup_timeout_s
        self.port = free_port()
        self.args = ["-m", model, "--host", "127.0.0.1", "--port", str(self.port)]
        if speculate:
            self.args += ["--speculate", speculate]
        for arg in serve_args:  # each may hold several words: --serve-arg "--quant int4"
            self.args += shlex.split(arg)
        # `python -m fastdecode.server` is `fastdecode serve` on this interpreter and environment; `--tp N` runs it
        # as N ranks under torchrun (docs/parallel.md)
        self.command = [sys.executable, *torchrun(self.args), "-m", "fastdecode.server", *self.args]
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> str:
        launch = torchrun(self.args)
        prefix = ["torchrun", *launch[2:], "-m", "fastdecode"] if launch else ["fastdecode"]
        return shlex.join([*prefix, "serve", *self.args])

    def __enter__(self) -> LocalServer:
        log = tempfile.NamedTemporaryFile("w+b", prefix="fastdecode-serve-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def wait_healthy(self):
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"`{self.command_line()}` exited with code {self.process.returncode}: "
                                       f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise ServerStartError(f"`{self.command_line()}` did not answer /health within {self.startup_timeout_s:g} s "
                               f"(log: {self.log_path})")

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except (OSError, AttributeError):
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
