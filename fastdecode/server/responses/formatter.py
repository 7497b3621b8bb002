"""The engine's chunks as a Responses API reply: output items (a `reasoning` item holding `reasoning_text`, a
`message` holding `output_text`, `function_call`s) and usage, streamed as the `response.*` events the SDK's stream
helper accumulates: created, in_progress, per item output_item.added, its deltas (reasoning_text.delta,
output_text.delta or function_call_arguments.delta) and their .done events, output_item.done, then completed (or
incomplete when max_output_tokens ran out)."""
from __future__ import annotations

import secrets

from fastdecode.server.errors import sendable
from fastdecode.server.formats import ReplyFormat
from fastdecode.server.protocol import Formatter, cached_tokens, named_sse, speed
from fastdecode.server.responses.schemas import ResponsesRequest


class ResponsesFormatter(Formatter):
    prefix, early_start = "resp_", True

    def __init__(self, model: str, tokenizer, prompt_tokens: int, reply: ReplyFormat | None,
                 body: ResponsesRequest):
        super().__init__(model, tokenizer, prompt_tokens, logprobs=False, include_usage=False, reply=reply)
        self.request = {  # what a response echoes of its request
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "metadata": body.metadata or {}, "previous_response_id": None,
            "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
            else body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": {"type": body.text.format.type}} if body.text and body.text.format
            else {"format": {"type": "text"}}}
        self.namespace = {t.name: ns for ns, t in body.functions() if ns is not None}  # a call names its namespace
        self.items: list[dict] = []
        self.growing: str | None = None  # the type of the last item while its text may still grow (message, reasoning)
        self.sequence = 0

    def keepalive(self) -> dict:
        """The API has no ping: its clients (and the SDK's stream helper) take a repeated in_progress."""
        return self._event("response.in_progress", response=self.response_object("in_progress", None))

    def sse(self, event: dict) -> str:
        return named_sse(event)

    def sse_end(self) -> list[str]:
        return []  # response.completed ends the stream; there is no [DONE]

    def sse_error(self, status: int, message: str) -> str:
        return named_sse(self._event("error", code="server_error" if status >= 500 else "invalid_request_error",
                                     message=sendable(message), param=None))

    def start(self) -> list[dict]:
        shell = self.response_object("in_progress", None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def add(self, chunk) -> list[dict]:
        return self._output(self.reply_events(chunk))

    def finish(self, completion, end: str | None, queue_s: float) -> list[dict]:
        self.settle(completion)
        out = self._output(self.last_reply_events()) + self._close()
        final = self.response_object(self.status(completion, end), completion)
        final["fastdecode"] = speed(queue_s, completion, end, self.expose_speculation)
        return out + [self._event(f"response.{final['status']}", response=final)]

    def response(self, completion, end: str | None, queue_s: float) -> dict:
        return self.finish(completion, end, queue_s)[-1]["response"]

    def response_object(self, status: str, completion) -> dict:
        done = status != "in_progress"
        cached = cached_tokens(completion)
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items if done else [], "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": self.tokens, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                          "total_tokens": self.prompt_tokens + self.tokens} if done else None,
                "store": False, "truncation": "disabled", **self.request}

    def status(self, completion, end: str | None) -> str:
        if any(item["type"] == "function_call" for item in self.items):
            return "completed"
        return "incomplete" if completion is None or end == "timeout" or completion.finish_reason == "length" \
            else "completed"

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _output(self, events) -> list[dict]:
        out = []
        for kind, value in events:
            if kind in ("content", "reasoning"):
                item_type = "message" if kind == "content" else "reasoning"
                if self.growing != item_type:
                    out += self._close() + self._open(item_type)
                item = self.items[-1]
                item["content"][0]["text"] += value
                extra = {"logprobs": []} if kind == "content" else {}
                out.append(self._event(f"response.{PART[item_type]}.delta", item_id=item["id"],
                                       output_index=len(self.items) - 1, content_index=0, delta=value, **extra))
                continue
            out += self._close()
            arguments = value["function"]["arguments"]
            name = value["function"]["name"]
            item = {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": value["id"],
                    "name": name, **({"namespace": self.namespace[name]} if name in self.namespace else {}),
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            index = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            item.update(arguments=arguments, status="completed")
            out += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=arguments),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=arguments),
                    self._event("response.output_item.done", output_index=index, item=dict(item))]
        return out

    def _open(self, item_type: str) -> list[dict]:
        self.growing = item_type
        item = {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "in_progress",
                "role": "assistant", "content": []} if item_type == "message" else {
                "type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "status": "in_progress", "summary": [],
                "content": []}
        self.items.append(item)
        index = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=index, item={**item, "content": []})
        item["content"].append(text_part(item_type))
        return [added, self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=text_part(item_type))]

    def _close(self) -> list[dict]:
        if self.growing is None:
            return []
        item_type, self.growing = self.growing, None
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        part = item["content"][0]
        extra = {"logprobs": []} if item_type == "message" else {}
        return [self._event(f"response.{PART[item_type]}.done", item_id=item["id"], output_index=index,
                            content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index,
                            item={**item, "content": [dict(part)]})]


PART = {"message": "output_text", "reasoning": "reasoning_text"}  # an item's text part, as event names spell it


def text_part(item_type: str) -> dict:
    """An item's text part, still empty; a message's output_text also carries annotations and logprobs."""
    extra = {"annotations": [], "logprobs": []} if item_type == "message" else {}
    return {"type": PART[item_type], "text": "", **extra}
