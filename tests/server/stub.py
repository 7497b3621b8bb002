"""The server app in-process over an engine that is never reached: for checks that answer before a request is
prepared (validation, authentication, Host header), without loading a model."""
from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from fastdecode.server.app import create_app
from fastdecode.server.config import ServerConfig

MODEL = "stub"


class UnreachableLLM:
    name = MODEL
    max_seq_len = 64
    config = SimpleNamespace(vocab_size=100)

    def __getattr__(self, attribute):
        raise AssertionError(f"the request reached the engine ({attribute})")


def stub_client(base_url: str = "http://127.0.0.1:8000", **config) -> TestClient:
    return TestClient(create_app(UnreachableLLM(), ServerConfig(**config)), base_url=base_url)
