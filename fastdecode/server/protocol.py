"""OpenAI's response objects built from the engine's stream: chat.completion(.chunk) and text_completion, usage,
log-probabilities, Server-Sent Events, and our speed figures in an extra "fastdecode" field.

One formatter per request turns engine chunks into stream chunks; the non-streamed response is assembled from the
same pieces, so the two can never disagree.
"""
from __future__ import annotations

import json
import secrets
import time

from fastdecode.server.errors import error_body
from fastdecode.server.formats import ReplyFormat

DONE = "data: [DONE]\n\n"
FINGERPRINT = "fastdecode"


def sse(obj: dict) -> str:
    return f"data: {event_json(obj)}\n\n"


def named_sse(event: dict) -> str:
    """An event named after its `type`, as the Messages and Responses APIs stream them."""
    return f"event: {event['type']}\ndata: {event_json(event)}\n\n"


def event_json(event: dict) -> str:
    """JSON as the non-streamed responses write it (starlette's JSONResponse): a NaN is an error, not a token no
    client parses."""
    return json.dumps(event, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def cached_tokens(completion) -> int:
    """Prompt tokens the engine did not prefill because its prefix cache held them."""
    return completion.timings.cached_tokens if completion is not None else 0


def speed(queue_s: float, completion, end: str | None, speculation: bool = False) -> dict:
    """Our figures for one request: TTFT and output tok/s as the engine measured them, and, when `speculation`
    (`serve --expose-speculation-stats`), speculation's yield for this request."""
    out = {"queue_s": round(queue_s, 4)}
    if completion is not None:
        t = completion.timings
        out.update(ttft_s=round(t.ttft_s, 4), prefill_tok_s=round(t.prefill_tok_s, 1),
                   output_tok_s=round(t.output_tok_s, 2), prompt_tokens=t.prompt_tokens,
                   cached_tokens=t.cached_tokens, disk_cached_tokens=t.disk_cached_tokens,
                   output_tokens=t.output_tokens)
        if speculation and completion.speculation is not None:
            out["speculation"] = completion.speculation
            out["accepted_tokens"] = completion.speculation.get("accepted")
    if end == "timeout":
        out["timed_out"] = True
    return out


class Formatter:
    """Shared state of one response: ids, token count, log-probabilities waiting for a chunk to ride on."""
    object_name = ""
    expose_speculation = False  # the server's --expose-speculation-stats, set per response by the app

    def __init__(self, model: str, tokenizer, prompt_tokens: int, logprobs: bool, include_usage: bool,
                 reply: ReplyFormat | None = None):
        self.id = f"{self.prefix}{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.tokens = 0  # output tokens seen (tokens, not chunks)
        self.entries: list[dict] = []  # engine logprob entries, all of them
        self.sent = 0  # entries already attached to a chunk
        self.completion = None  # the engine's Completion, once the last chunk came
        self.parser = reply.parser() if reply is not None else None  # None: the reply is plain text
        self.reasoning: list[str] = []  # the reply's reasoning text, as parsed

    # How the stream is written: OpenAI's chat and text completions are bare `data:` lines ended by [DONE], and start
    # with the first token, so that an error before it keeps its HTTP status. The Messages and Responses APIs name each
    # event, and start at once (early_start): their agents drop a stream that sends nothing for 5 minutes, shorter
    # than a long prompt's prefill on a CPU, so keepalive() events fill the wait.
    early_start = False

    def keepalive(self) -> dict:
        raise NotImplementedError

    def sse(self, event: dict) -> str:
        return sse(event)

    def sse_end(self) -> list[str]:
        return [DONE]

    def sse_error(self, status: int, message: str) -> str:
        return sse(error_body(status, message))

    def chunk(self, choices: list[dict], **extra) -> dict:
        out = {"id": self.id, "object": f"{self.object_name}.chunk" if self.object_name == "chat.completion"
               else self.object_name, "created": self.created, "model": self.model,
               "system_fingerprint": FINGERPRINT, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def count(self, chunk):
        self.tokens += len(chunk.token_ids)
        if self.logprobs and chunk.logprobs:
            self.entries += chunk.logprobs

    def reply_events(self, chunk) -> list[tuple[str, object]]:
        """Counts the chunk; its text as ("content", text), ("reasoning", text) and ("tool_call", call) events, in
        order."""
        self.count(chunk)
        if self.parser is None:
            return [("content", chunk.text)] if chunk.text else []
        return self._noted(self.parser.feed(chunk.text))

    def last_reply_events(self) -> list[tuple[str, object]]:
        """What the parser held back, once the reply is over."""
        return self._noted(self.parser.finish()) if self.parser else []

    def _noted(self, events):
        self.reasoning += [value for kind, value in events if kind == "reasoning"]
        return events

    def reasoning_tokens(self) -> int:
        """Output tokens of the reasoning: its text tokenized again (the tokens that spelled it, but for the tags
        around it), at most the reply's."""
        text = "".join(self.reasoning)
        return min(self.tokens, len(self.tokenizer.encode(text, add_special_tokens=False))) if text else 0

    def usage(self, completion) -> dict:
        """OpenAI's usage object; prompt_tokens_details.cached_tokens counts the prompt tokens the prefix cache held,
        completion_tokens_details.reasoning_tokens (chat replies read by a parser) those of the reasoning."""
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
               "total_tokens": self.prompt_tokens + self.tokens,
               "prompt_tokens_details": {"cached_tokens": cached_tokens(completion)}}
        if self.parser is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens()}
        return out

    def settle(self, completion):
        """At the end: the engine's count is the truth (a token that completes a stop string is not streamed)."""
        if completion is not None:
            if self.logprobs and completion.logprobs and len(completion.logprobs) > len(self.entries):
                self.entries += completion.logprobs[len(self.entries):]
            self.tokens = len(completion.token_ids)

    def unsent(self) -> list[dict]:
        entries, self.sent = self.entries[self.sent:], len(self.entries)
        return entries

    def finish_reason(self, completion, end: str | None) -> str:
        """OpenAI's: a reply cut by the request's time limit ran out of length, as one cut by max_tokens did."""
        return completion.finish_reason if completion is not None and end != "timeout" else "length"

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def final_chunks(self, choice: dict, completion, end, queue_s: float) -> list[dict]:
        figures = speed(queue_s, completion, end, self.expose_speculation)
        if not self.include_usage:
            return [self.chunk([choice], fastdecode=figures)]
        return [self.chunk([choice]), {**self.chunk([]), "usage": self.usage(completion), "fastdecode": figures}]


class ChatFormatter(Formatter):
    prefix, object_name = "chatcmpl-", "chat.completion"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.content: list[str] = []
        self.tool_calls: list[dict] = []

    def start(self) -> list[dict]:
        return [self.chunk([self._choice({"role": "assistant", "content": "", "refusal": None})])]

    def add(self, chunk) -> list[dict]:
        return [self.chunk([c]) for c in self._choices(self.reply_events(chunk))]

    def finish(self, completion, end: str | None, queue_s: float) -> list[dict]:
        self.settle(completion)
        out = [self.chunk([c]) for c in self._choices(self.last_reply_events())]
        last = self._choice({}, self.finish_reason(completion, end))
        if self.logprobs and self.sent < len(self.entries):
            last["logprobs"] = {"content": self._logprobs(self.unsent())}
        return out + self.final_chunks(last, completion, end, queue_s)

    def response(self, completion, end: str | None, queue_s: float) -> dict:
        self.finish(completion, end, queue_s)
        content = "".join(self.content)
        message = {"role": "assistant", "content": content if content or not self.tool_calls else None,
                   "refusal": None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": self.finish_reason(completion, end)}
        if self.logprobs:
            choice["logprobs"] = {"content": self._logprobs(self.entries)}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": [choice], "usage": self.usage(completion),
                "fastdecode": speed(queue_s, completion, end, self.expose_speculation)}

    def finish_reason(self, completion, end: str | None) -> str:
        return "tool_calls" if self.tool_calls else super().finish_reason(completion, end)

    def _choice(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _choices(self, events) -> list[dict]:
        out = []
        for kind, value in events:
            if kind in ("content", "reasoning"):
                if kind == "content":
                    self.content.append(value)
                choice = self._choice({"content" if kind == "content" else "reasoning_content": value})
                if self.logprobs and self.sent < len(self.entries):
                    choice["logprobs"] = {"content": self._logprobs(self.unsent())}
                out.append(choice)
                continue
            index = len(self.tool_calls)
            self.tool_calls.append(value)
            out.append(self._choice({"tool_calls": [{"index": index, "id": value["id"], "type": "function",
                                                     "function": {"name": value["function"]["name"],
                                                                  "arguments": ""}}]}))
            out.append(self._choice({"tool_calls": [{"index": index, "function": {
                "arguments": value["function"]["arguments"]}}]}))
        return out

    def _logprobs(self, entries: list[dict]) -> list[dict]:
        def one(token_id, logprob):
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                for e in entries]


class TextFormatter(Formatter):
    prefix, object_name = "cmpl-", "text_completion"

    def __init__(self, *args, echo: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.echo = echo or ""
        self.text: list[str] = []
        self.offset = len(self.echo)  # text_offset of the next streamed token

    def start(self) -> list[dict]:
        return [self.chunk([self._choice(self.echo)])] if self.echo else []

    def add(self, chunk) -> list[dict]:
        self.count(chunk)
        self.text.append(chunk.text)
        if not chunk.text and not (self.logprobs and chunk.logprobs):
            return []
        choice = self._choice(chunk.text)
        if self.logprobs:
            choice["logprobs"], self.offset = self._logprobs(self.unsent(), self.offset)
        return [self.chunk([choice])]

    def finish(self, completion, end: str | None, queue_s: float) -> list[dict]:
        self.settle(completion)
        last = self._choice("", self.finish_reason(completion, end))
        if self.logprobs and self.sent < len(self.entries):
            last["logprobs"], self.offset = self._logprobs(self.unsent(), self.offset)
        return self.final_chunks(last, completion, end, queue_s)

    def response(self, completion, end: str | None, queue_s: float) -> dict:
        self.settle(completion)
        choice = self._choice(self.echo + "".join(self.text), self.finish_reason(completion, end))
        if self.logprobs:
            choice["logprobs"] = self._logprobs(self.entries, len(self.echo))[0]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": [choice], "usage": self.usage(completion),
                "fastdecode": speed(queue_s, completion, end, self.expose_speculation)}

    def _choice(self, text: str, finish_reason: str | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, entries: list[dict], offset: int) -> tuple[dict, int]:
        """OpenAI's legacy shape, and the text offset after these tokens."""
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.token_text(e["token_id"]))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e["top"]} for e in entries],
                "text_offset": offsets}, offset
