"""The server app in-process over stub engines: for checks that answer before a request reaches the engine
(validation, authentication, Host header) or that need the engine to fail, without loading a model."""
from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from fastdecode.engine.llm import StreamChunk
from fastdecode.server.app import create_app
from fastdecode.server.config import ServerConfig

MODEL = "stub"
SECRET = "/home/someone/private/state.bin"  # what an engine's exception may say and a client must never see


class UnreachableLLM:
    name = MODEL
    max_seq_len = 64
    config = SimpleNamespace(vocab_size=100)
    engine = None  # no batching engine: the server gives it one slot, and reads its blocking stream
    slots, streams_on_loop = 1, False

    @staticmethod
    def status() -> dict:
        return {}

    @staticmethod
    def context_hint() -> str:
        return "(the model's trained context)"

    def __getattr__(self, attribute):
        raise AssertionError(f"the request reached the engine ({attribute})")


class MidStreamFailureLLM(UnreachableLLM):
    """Generates one token of a token-id prompt, then fails as a bug or a lost tensor-parallel rank would."""
    tokenizer = None

    def stream(self, prompt_ids, params, logits_processor=None, **kw):
        yield StreamChunk("hi", [1])
        raise RuntimeError(f"cannot read {SECRET}")


class UntokenizableLLM(UnreachableLLM):
    """Its tokenizer knows how many characters a token covers at most (4); it renders chats (their reasoning too)
    and cannot tokenize: a request that gets as far as tokenizing its prompt fails with a 500."""
    tokenizer = SimpleNamespace(max_token_chars=4, chat_template="")

    @staticmethod
    def render_chat(messages, tools=None, template_kwargs=None) -> str:
        return "".join(f"{m['role']}: {m.get('reasoning_content') or ''}{m['content'] or ''}\n" for m in messages)


def stub_client(llm=None, base_url: str = "http://127.0.0.1:8000", **config) -> TestClient:
    return TestClient(create_app(llm or UnreachableLLM(), ServerConfig(**config)), base_url=base_url)
