"""The engine's chunks as a Messages API reply: content blocks (text, tool_use), stop_reason and usage, streamed as
named events in the order the SDK's stream helper checks: message_start, ping, then per block content_block_start,
content_block_delta (text_delta or input_json_delta) and content_block_stop, then message_delta and message_stop."""
from __future__ import annotations

import json
import secrets

from fastdecode.server.errors import anthropic_error_body
from fastdecode.server.protocol import Formatter, cached_tokens, named_sse, speed


class MessagesFormatter(Formatter):
    prefix, early_start = "msg", True

    def __init__(self, model: str, tokenizer, prompt_tokens: int, tool_names: list[str] | None,
                 stop_sequences: list[str] | None, clamped: bool):
        super().__init__(model, tokenizer, prompt_tokens, logprobs=False, include_usage=False, tool_names=tool_names)
        self.id = f"msg_{secrets.token_hex(12)}"
        self.stop_sequences = stop_sequences or []
        self.clamped = clamped
        self.blocks: list[dict] = []
        self.text_open = False  # the last block is text that may still grow

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
        out = self._blocks(self.last_reply_events()) + self._close_text()
        reason, sequence = self.stop_reason(completion, end)
        return out + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": self.usage(completion), "fastdecode": speed(queue_s, completion, end)},
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
            if kind == "content":
                if not self.text_open:
                    out.append(self._open({"type": "text", "text": ""}))
                    self.text_open = True
                self.blocks[-1]["text"] += value
                out.append(self._delta({"type": "text_delta", "text": value}))
                continue
            out += self._close_text()
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

    def _close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [self._stop()]
