"""A server app in this process whose replies are canned text: a tiny chat model's tokenizer and template build the
prompt as for real, and the reply is handed to the formatters in the pieces a test chooses, without running the
model. For checks of how the server reads and writes model output, at a few milliseconds a request."""
from __future__ import annotations

from contextlib import contextmanager
from itertools import pairwise

from starlette.testclient import TestClient

from fastdecode.engine.timings import Timings
from fastdecode.engine.llm import LLM, Completion, StreamChunk
from fastdecode.server.app import create_app
from fastdecode.server.config import ServerConfig
from tests.helpers.chat_models import chat_model
from tests.server.stub import Chunks


class CannedLLM:
    """An LLM whose replies are `script`, cut into pieces at `cuts` (character offsets), then end-of-sequence."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.script = ""
        self.cuts: tuple[int, ...] = ()

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def stream(self, prompt_ids, params=None, logits_processor=None, **kw):
        bounds = [0, *sorted(c for c in set(self.cuts) if 0 < c < len(self.script)), len(self.script)]
        token_ids = []
        for start, end in pairwise(bounds):
            piece = self.script[start:end]
            ids = self.llm.tokenizer.encode(piece, add_special_tokens=False)
            token_ids += ids
            yield StreamChunk(piece, ids)
        timings = Timings(prompt_tokens=len(prompt_ids), output_tokens=len(token_ids))
        yield StreamChunk("", [], completion=Completion(self.script, token_ids, list(prompt_ids), "stop", timings))

    def astream(self, prompt_ids, params=None, logits_processor=None, **kw):
        return Chunks(self.stream(prompt_ids, params))


@contextmanager
def canned_client(name: str):
    """(llm, client) of an app over chat_model(name) whose replies are llm.script."""
    llm = CannedLLM(LLM(str(chat_model(name)), max_seq_len=4096, native=False, max_batch=2))
    try:
        app = create_app(llm, ServerConfig())
        # a bug answers 500, as a client would see it, rather than raising in the test
        with TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as client:
            yield llm, client
    finally:
        llm.close()
