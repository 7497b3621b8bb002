"""Real `fastdecode serve` processes on SmolLM2-135M (int4, 2 threads), each on a free loopback port, started once
per session and stopped at its end. Tests talk to them over HTTP only."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from fastdecode.agents.server import free_port

API_KEY = "test-key"
STARTUP_S = 600  # the first start may build the native kernels
ENGINE = ["--quant", "int4", "--threads", "2"]


@contextmanager
def app_server(app, what: str = "the server"):
    """`app` served by uvicorn on a thread of this process, on a free port: its base URL, stopped at the end."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


class Server:
    def __init__(self, model_path: Path, log_dir: Path, *args: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "fastdecode.server", "-m", str(model_path), "--served-model-name",
                        "smollm2-135m", "--port", str(self.port), *ENGINE, *args]
        self.log = log_dir / "serve.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not answer /health in {STARTUP_S} s: {self.log_tail()}")

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def healthy(self) -> bool:
        return httpx.get(f"{self.base_url}/health", timeout=10).status_code == 200


def started(model_path: Path, tmp_path_factory, *args: str):
    server = Server(model_path, tmp_path_factory.mktemp("serve"), *args, "--log-level", "warning").start()
    server.speculate = args[args.index("--speculate") + 1]
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory):
    """The main server: plain decode, an API key, the default queue."""
    yield from started(smollm2_path, tmp_path_factory, "--speculate", "none", "--api-key", API_KEY,
                       "--max-seq-len", "2048")


@pytest.fixture(scope="session")
def small_server(smollm2_path, tmp_path_factory):
    """A 96-token context, one request at a time and a queue of one: 429s, and cheap requests for the fuzzer. No
    API key."""
    yield from started(smollm2_path, tmp_path_factory, "--speculate", "none", "--max-batch", "1", "--max-queue", "1",
                       "--max-seq-len", "96", "--max-body-bytes", "65536")


@pytest.fixture(scope="session", params=["ngram", "auto"])
def spec_server(request, smollm2_path, tmp_path_factory):
    """The main server's settings with a drafter, reporting each response's speculation figures."""
    yield from started(smollm2_path, tmp_path_factory, "--speculate", request.param, "--api-key", API_KEY,
                       "--max-seq-len", "2048", "--expose-speculation-stats")


@pytest.fixture()
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def async_client(server):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
