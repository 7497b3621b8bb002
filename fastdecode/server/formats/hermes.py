"""Hermes and Qwen2.5 calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with two JSON forms read
alongside: Llama 3.1's `<function=NAME>{...}</function>` and a reply that is nothing but a call object or a list of
them (Llama 3.x). The default format, and the one a forced call (tool_choice "required" or named) is written in."""
from __future__ import annotations

import json
import re

from fastdecode.server.formats.base import Event, ToolParser, call_from_json, new_call
from fastdecode.server.formats.lark import ANY, call_object, literal, marker, opener_grammar, text_terminal, tool_rules
from fastdecode.server.formats.reasoning import reasoning_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_TAG = re.compile(r"<function=([a-zA-Z0-9_-]{1,64})>(.*?)</function>", re.S)
JSON_PIECE = re.compile(r'(?P<string>"(?:[^"\\]|\\.)*")|(?P<open>")|[{}\[\]]')  # a string, an open one, a bracket
# Text that opens like JSON and says "name" could be a whole reply parse_bare reads as a call.
BARE_CALL = r'\s*[\[{]' + ANY + '"name"'


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

    @classmethod
    def call_grammar(cls, tools, *, forced, parallel=True, reasoning=None, strict=frozenset(), template="",
                     added_tokens=None) -> str:
        """`<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`, a newline between calls."""
        added_tokens = added_tokens or {}
        start, not_opening = reasoning_grammar(reasoning, added_tokens)
        text = text_terminal("TEXT", cls.starts, (*not_opening, BARE_CALL))
        answer = opener_grammar(OPEN, "body", literal("\n"), text, added_tokens, forced=forced, parallel=parallel)
        return "\n".join([*start, *answer, f'body: "\\n" tool "\\n" {marker(CLOSE, added_tokens)}',
                          *tool_rules(tools, strict, call_object("arguments"))])

    def read_call(self, text: str, final: bool):
        close = CLOSE if text.startswith(OPEN) else "</function>"
        end = text.find(close)
        if close == CLOSE and text[len(OPEN):].lstrip().startswith("{"):
            # The call ends at the marker after its JSON: a string in it may hold `</tool_call>` (code about calls).
            after = json_end(text, len(text) - len(text[len(OPEN):].lstrip()))
            rest = "" if after is None else text[after:].lstrip()
            if rest.startswith(CLOSE):
                end = text.index(CLOSE, after)
            elif CLOSE.startswith(rest):  # a string still open, or the marker still coming
                if not final:
                    return None
                if after is not None:  # EOS after the object
                    return self._parse(text[:after] + CLOSE), len(text)
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


def json_end(text: str, at: int) -> int | None:
    """Where the JSON object or array that opens at `at` ends, its brackets counted outside strings (json.loads
    checks the rest); None while it is still open."""
    depth = 0
    for piece in JSON_PIECE.finditer(text, at):
        if piece.group("open"):
            return None  # a string that has not closed
        if not piece.group("string"):
            depth += 1 if piece.group() in "{[" else -1
            if depth == 0:
                return piece.end()
    return None


def parse_bare(text: str, names) -> list[dict] | None:
    """A reply that is only a call object or a list of them."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, names) for v in values]
    return calls if calls and all(calls) else None
