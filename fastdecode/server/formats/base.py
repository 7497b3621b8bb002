"""What every tool-call parser shares: the events it returns, the OpenAI call it builds, and the streaming loop
that passes text through, holds back what may still become a call, and hands each call's text to the format.

A format only says where a call starts (`starts`) and how to read one (`read_call`); the loop keeps text and calls
in order and never lets half a marker or half a call out as text.
"""
from __future__ import annotations

import json
import secrets

Event = tuple[str, object]  # ("content", text) | ("reasoning", text) | ("tool_call", OpenAI tool call)


def new_call(name: str, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def loads_object(arguments):
    """Tool-call arguments as templates expect them: a dict when the string holds a JSON object."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def call_from_json(value, names) -> dict | None:
    """{"name": ..., "arguments"|"parameters": {...}} naming a known tool -> an OpenAI tool call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = loads_object(value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments)


def partial_marker(text: str, markers) -> int:
    """Length of the longest tail of `text` that could grow into one of `markers`."""
    return max((k for marker in markers for k in range(1, min(len(marker), len(text) + 1))
                if text.endswith(marker[:k])), default=0)


class ToolParser:
    """Text deltas in, ("content", text) and ("tool_call", call) events out, in order. `tools` maps each offered
    tool's name to its parameters' JSON Schema.

    A subclass names the markers that open a call (`starts`) and reads one call (`read_call`). Whitespace alone
    at the start of a reply waits to see what follows it; whitespace right after a call is dropped, so that the
    newlines between calls never become text."""
    starts: tuple[str, ...] = ()
    special_markers: tuple[str, ...] = ()  # markers that are special tokens in the format's vocabularies
    stop_markers: tuple[str, ...] = ()  # special tokens that end the reply in place of end-of-sequence (harmony's)
    channels = False  # True: the format carries reasoning and answer itself, so every reply is read through it

    def __init__(self, tools: dict[str, dict | None]):
        self.tools = tools
        self.buffer = ""
        self.in_call = False
        self.space = "start"  # "start": keep leading whitespace if text follows; "call": drop it; None: pass
        self.lead = ""  # leading whitespace held at the start

    @staticmethod
    def template_call_id(call_id: str) -> str:
        """A call id as the format's chat template accepts it."""
        return call_id

    @staticmethod
    def template_message(message: dict) -> dict:
        """A message, as the chat template sees it, in the form the format's templates accept."""
        return message

    def read_call(self, text: str, final: bool) -> tuple[list[dict] | None, int] | None:
        """`text` starts with one of `starts`. Returns (calls, used): the first `used` characters are one call
        block and `calls` what it says (None: it is not a valid call, so it is text); or None while more text may
        complete the block. `final`: no more text comes, so None is not an answer."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.lead:  # a reply of whitespace only is text after all
            events.append(("content", self.lead))
            self.lead = ""
        return events

    def _drain(self, final: bool) -> list[Event]:
        events = []
        while self.buffer:
            if not self.in_call:
                found = [(at, m) for at, m in ((self.buffer.find(m), m) for m in self.starts) if at >= 0]
                if not found:
                    hold = 0 if final else partial_marker(self.buffer, self.starts)
                    events += self._content(self.buffer[:len(self.buffer) - hold])
                    self.buffer = self.buffer[len(self.buffer) - hold:]
                    return events
                at = min(found)[0]
                events += self._content(self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at:], True
            read = self.read_call(self.buffer, final)
            if read is None:
                if not final:
                    return events
                read = (None, len(self.buffer))
            calls, used = read
            block, self.buffer, self.in_call = self.buffer[:used], self.buffer[used:], False
            if calls:
                events += [("tool_call", c) for c in calls]
                self.space, self.lead = "call", ""
            else:
                events += self._content(block)
        return events

    def _content(self, text: str) -> list[Event]:
        if self.space == "start":
            stripped = text.lstrip()
            self.lead += text[:len(text) - len(stripped)]
            if not stripped:
                return []
            text, self.lead, self.space = self.lead + stripped, "", None
        elif self.space == "call":
            text = text.lstrip()
            if not text:
                return []
            self.space = None
        return [("content", text)] if text else []
