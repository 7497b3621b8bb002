"""A server in this process over a tiny chat model whose replies are scripted: the real engine, tokenizer,
detokenizer, template and formatters, with each output token forced by a logits processor to spell the text a
test sets. The model's weights are random; what it says is the test's, how the server reads it is under test."""
from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from fastdecode.engine.llm import LLM
from fastdecode.server.app import create_app
from fastdecode.server.config import ServerConfig
from tests.helpers.chat_models import chat_model
from tests.server.conftest import app_server


class ScriptedLLM:
    """An LLM whose next replies are `script`'s tokens, then end-of-sequence."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.script = ""

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def force(self):
        """The script is what the model says: the request's grammar (tools get one) is not applied, so that replies
        a grammar would refuse still test how the server reads them."""
        tokenizer = self.llm.tokenizer
        ids = tokenizer.encode(self.script, add_special_tokens=False) + tokenizer.eos_token_ids[:1]

        def force(output_ids, logits):
            forced = torch.full_like(logits, float("-inf"))
            forced[ids[min(len(output_ids), len(ids) - 1)]] = 0.0
            return forced
        return force

    def stream(self, prompt, params=None, logits_processor=None, **kw):
        return self.llm.stream(prompt, params, self.force(), **kw)

    def astream(self, prompt, params=None, logits_processor=None, **kw):
        return self.llm.astream(prompt, params, self.force(), **kw)


@contextmanager
def scripted_server(name: str):
    """(llm, base_url) of a server on chat_model(name), stopped at the end of the block."""
    llm = ScriptedLLM(LLM(str(chat_model(name)), max_seq_len=4096, native=False, max_batch=2))
    try:
        with app_server(create_app(llm, ServerConfig()), "the scripted server") as base_url:
            yield llm, base_url
    finally:
        llm.close()


def chat_reply(llm, script: str, markers: tuple[str, ...], stream=False, **kw):
    """The reply to `script` through the OpenAI SDK (llm.openai; `kw` the request's fields) as (content, reasoning,
    [(name, arguments)], finish_reason), assembled from the stream's deltas when streamed; streamed text deltas must
    hold none of `markers` (the format's markup leaking into text)."""
    llm.script = script
    kw = {"model": llm.model, **kw}
    if not stream:
        choice = llm.openai.chat.completions.create(**kw).choices[0]
        m = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.content, getattr(m, "reasoning_content", None), calls, choice.finish_reason
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in llm.openai.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        for text, out in ((delta.content, content), (getattr(delta, "reasoning_content", None), reasoning)):
            if text:
                assert not any(m in text for m in markers), text
                out.append(text)
        for tc in delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
    return ("".join(content) or None, "".join(reasoning) or None,
            [(n, json.loads(a)) for n, a in calls.values()], finish)
