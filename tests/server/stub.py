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


class Chunks:
    """Chunks (any iterable, read as the server asks: an error raised while making one reaches the reader) as
    LLM.astream hands them out."""

    def __init__(self, chunks):
        self.chunks = iter(chunks)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamChunk:
        try:
            return next(self.chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self):
        pass


class UnreachableLLM:
    name = MODEL
    max_seq_len = 64
    config = SimpleNamespace(vocab_size=100)
    engine = None  # no engine here: the server gives it one slot
    slots = 1

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

    def astream(self, prompt_ids, params, logits_processor=None, **kw):
        def chunks():
            yield StreamChunk("hi", [1])
            raise RuntimeError(f"cannot read {SECRET}")
        return Chunks(chunks())


class UntokenizableLLM(UnreachableLLM):
    """Its tokenizer knows how many characters a token covers at most (4); it renders chats (their reasoning too)
    and cannot tokenize: a request that gets as far as tokenizing its prompt fails with a 500."""
    tokenizer = SimpleNamespace(max_token_chars=4, chat_template="")

    @staticmethod
    def render_chat(messages, tools=None, template_kwargs=None) -> str:
        return "".join(f"{m['role']}: {m.get('reasoning_content') or ''}{m['content'] or ''}\n" for m in messages)


def stub_client(llm=None, base_url: str = "http://127.0.0.1:8000", **config) -> TestClient:
    return TestClient(create_app(llm or UnreachableLLM(), ServerConfig(**config)), base_url=base_url)
