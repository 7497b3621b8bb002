"""The engine's chunks as a Messages API reply: content blocks (thinking, text, tool_use), stop_reason and usage,
streamed as named events in the order the SDK's stream helper checks: message_start, ping, then per block
content_block_start, content_block_delta (thinking_delta, text_delta or input_json_delta; a thinking block ends
with its signature_delta) and content_block_stop, then message_delta and message_stop.

A thinking block's `signature` is a digest of its text: the API requires the field, and the blocks a client sends
back are left out of the prompt, so nothing here verifies it."""
from __future__ import annotations

import hashlib
import json

from fastdecode.server.errors import anthropic_error_body
from fastdecode.server.formats import ReplyFormat
from fastdecode.server.protocol import Formatter, cached_tokens, named_sse, speed


class MessagesFormatter(Formatter):
    prefix, early_start = "msg_", True

    def __init__(self, model: str, tokenizer, prompt_tokens: int, reply: ReplyFormat | None,
                 stop_sequences: list[str] | None, clamped: bool):
        super().__init__(model, tokenizer, prompt_tokens, logprobs=False, include_usage=False, reply=reply)
        self.stop_sequences = stop_sequences or []
        self.clamped = clamped
        self.blocks: list[dict] = []
        self.growing: str | None = None  # the type of the last block while it may still grow (text, thinking)

    def keepalive(self) -> dict:
        return {"type": "ping"}

    def sse(self, event: dict) -> str:
        return named_sse(event)

    def sse_end(self) -> list[str]:
        return []  # message_stop ends the stream; there is no [DONE]

    def sse_error(self, status: int, message: str) -> str:
        return named_sse(anthropic_error_body(status, message))

    def start(self) -> list[dict]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self.usage(None)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def add(self, chunk) -> list[dict]:
        return self._blocks(self.reply_events(chunk))

    def finish(self, completion, end: str | None, queue_s: float) -> list[dict]:
        self.settle(completion)
        out = self._blocks(self.last_reply_events()) + self._close()
        reason, sequence = self.stop_reason(completion, end)
        return out + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": self.usage(completion), "fastdecode": speed(queue_s, completion, end, self.expose_speculation)},
                      {"type": "message_stop"}]

    def response(self, completion, end: str | None, queue_s: float) -> dict:
        last = self.finish(completion, end, queue_s)[-2]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                **last["delta"], "usage": last["usage"], "fastdecode": last["fastdecode"]}

    def usage(self, completion) -> dict:
        """Anthropic counts cache reads apart from input_tokens: the prompt is their sum."""
        cached = cached_tokens(completion)
        return {"input_tokens": self.prompt_tokens - cached, "output_tokens": self.tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def stop_reason(self, completion, end: str | None) -> tuple[str, str | None]:
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if completion is None or end == "timeout":  # cut by the request's time limit
            return "max_tokens", None
        if completion.finish_reason == "length":
            return "model_context_window_exceeded" if self.clamped else "max_tokens", None
        matched = self.matched_stop(completion)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def matched_stop(self, completion) -> str | None:
        """The stop sequence that ended the reply: the engine cut the text before it, and its token is the last."""
        if not self.stop_sequences or not completion.token_ids:
            return None
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        found = [(text.find(s), s) for s in self.stop_sequences if s in text]
        return min(found)[1] if found else None

    def _blocks(self, events) -> list[dict]:
        out = []
        for kind, value in events:
            if kind in ("content", "reasoning"):
                block_type, field = ("text", "text") if kind == "content" else ("thinking", "thinking")
                if self.growing != block_type:
                    out += self._close()
                    out.append(self._open({"type": "text", "text": ""} if kind == "content"
                                          else {"type": "thinking", "thinking": "", "signature": ""}))
                    self.growing = block_type
                self.blocks[-1][field] += value
                out.append(self._delta({"type": f"{field}_delta", field: value}))
                continue
            out += self._close()
            arguments = value["function"]["arguments"]
            block = {"type": "tool_use", "id": "toolu_" + value["id"].removeprefix("call_"),
                     "name": value["function"]["name"], "input": {}}
            out.append(self._open(block))
            block["input"] = json.loads(arguments)  # the parser only returns calls whose arguments are an object
            out += [self._delta({"type": "input_json_delta", "partial_json": arguments}), self._stop()]
        return out

    def _open(self, block: dict) -> dict:
        self.blocks.append(block)
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _stop(self) -> dict:
        return {"type": "content_block_stop", "index": len(self.blocks) - 1}

    def _close(self) -> list[dict]:
        """Ends the growing block, if any; a thinking block gets its signature first."""
        if self.growing is None:
            return []
        out = []
        if self.growing == "thinking":
            block = self.blocks[-1]
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        self.growing = None
        return out + [self._stop()]
