"""Hermes and Qwen2.5 calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with two JSON forms read
alongside: Llama 3.1's `<function=NAME>{...}</function>` and a reply that is nothing but a call object or a list of
them (Llama 3.x). The default format, and the one a forced call (tool_choice "required" or named) is written in."""
from __future__ import annotations

import json
import re

from fastdecode.server.formats.base import Event, ToolParser, call_from_json, new_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_TAG = re.compile(r"<function=([a-zA-Z0-9_-]{1,64})>(.*?)</function>", re.S)


class HermesParser(ToolParser):
    starts = (OPEN, "<function=")

    def __init__(self, tools: dict[str, dict | None]):
        super().__init__(tools)
        self.bare: bool | None = None  # does the reply open with `{` or `[`? None: nothing but whitespace yet

    def feed(self, text: str) -> list[Event]:
        if self.bare is None:
            head = (self.buffer + text).lstrip()
            if head:
                self.bare = head[0] in "[{"
        if self.bare is not False:
            self.buffer += text
            return []
        return super().feed(text)

    def finish(self) -> list[Event]:
        if self.bare:
            calls = parse_bare(self.buffer.strip(), self.tools)
            if calls:
                self.buffer = ""
                return [("tool_call", c) for c in calls]
            self.bare = False
        return super().finish()

    def read_call(self, text: str, final: bool):
        close = CLOSE if text.startswith(OPEN) else "</function>"
        end = text.find(close)
        if end < 0:
            # EOS before the closing marker: a complete object still counts
            return ((self._parse(text + close), len(text)) if final else None)
        used = end + len(close)
        return self._parse(text[:used]), used

    def _parse(self, block: str) -> list[dict] | None:
        if block.startswith(OPEN):
            try:
                call = call_from_json(json.loads(block[len(OPEN):-len(CLOSE)]), self.tools)
            except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
                return None
            return [call] if call else None
        match = FUNCTION_TAG.fullmatch(block)
        if match is None or match.group(1) not in self.tools:
            return None
        call = new_call(match.group(1), match.group(2).strip())
        return [call] if call else None


def parse_bare(text: str, names) -> list[dict] | None:
    """A reply that is only a call object or a list of them."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, names) for v in values]
    return calls if calls and all(calls) else None
