"""A local model measured through the same HTTP path as any endpoint: the lab starts `fastdecode serve` on a free
loopback port, waits for /health, and stops it at the end, so a local number and a remote one mean the same."""
from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

import httpx

from fastdecode.agents.server import LaunchedServer, free_port


class LocalServer(LaunchedServer):
    """Started on entering a `with`, ready once /health answers, stopped on leaving."""

    def __init__(self, model: str, speculate: str | None = None, serve_args: tuple[str, ...] = (),
                 startup_timeout_s: float = 600.0):
        args = ["--speculate", speculate] if speculate else []
        for arg in serve_args:  # each may hold several words: --serve-arg "--quant int4"
            args += shlex.split(arg)
        log = Path(tempfile.mkdtemp(prefix="fastdecode-serve-")) / "serve.log"
        super().__init__(model, free_port(), None, args, log)
        self.startup_timeout_s = startup_timeout_s

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def __enter__(self) -> LocalServer:
        self.start()
        try:
            self.wait_ready(timeout_s=self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
