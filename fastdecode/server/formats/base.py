"""What every tool-call parser shares: the events it returns, the OpenAI call it builds, and the streaming loop
that passes text through, holds back what may still become a call, and hands each call's text to the format.

A format only says where a call starts (`starts`) and how to read one (`read_call`); the loop keeps text and calls
in order and never lets half a marker or half a call out as text. A call whose arguments are not a JSON object that
every client reads alike (json_problem) is no call: it stays text, as any call that does not parse does.

Each format also writes the Lark grammar (llguidance's dialect) of a whole reply it reads (`call_grammar`), from the
same markers its parser looks for, with the helpers of formats/lark.py.
"""
from __future__ import annotations

import json
import math
import secrets
import sys
from collections.abc import Mapping

Event = tuple[str, object]  # ("content", text) | ("reasoning", text) | ("tool_call", OpenAI tool call)
MAX_DEPTH = 64  # nested arrays and objects: far past any tool's arguments, far short of Python's ~1,000-frame
# stack, which writing a response around them must fit in (a 960-deep array in a call's arguments was a 500)


def new_call(name: str, arguments) -> dict | None:
    """An OpenAI tool call; None when `arguments` (JSON text, or its value) is not an object JSON writes plainly.
    Text the model wrote is kept as written."""
    value = loads_object(arguments)
    if not isinstance(value, dict) or json_problem(value) is not None:
        return None
    if not isinstance(arguments, str):
        arguments = json.dumps(value, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def json_problem(value, max_depth: int = MAX_DEPTH) -> str | None:
    """What keeps `value` (as json.loads, ast.literal_eval or a request body gives it) from being JSON that every
    client reads as the same value, or None: a number no double holds (NaN, Infinity, 1e999: Python reads them, JSON
    cannot write them), a string or key with a lone surrogate (JSON spells `\\ud800`, UTF-8 cannot), a key that is
    not a string, a value JSON has no form of (a tuple, bytes, a set, a complex), or nesting deeper than
    `max_depth`. Iterative: a deep value must not exhaust the stack."""
    stack = [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not valid_unicode(value):
                return "holds a lone surrogate, which is not Unicode"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return "holds a number that is not finite (NaN, Infinity or past a double's range)"
        elif isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > sys.float_info.max:
                return "holds an integer past a double's range"
        elif isinstance(value, (dict, list)):
            if depth >= max_depth:
                return f"nests more than {max_depth} levels deep"
            if isinstance(value, dict):
                if not all(isinstance(key, str) for key in value):
                    return "holds a key that is not a string"
                stack += [(key, depth) for key in value]
            stack += [(child, depth + 1) for child in (value.values() if isinstance(value, dict) else value)]
        elif value is not None and not isinstance(value, bool):
            return f"holds a {type(value).__name__}, which JSON has no form of"
    return None


def valid_unicode(text: str) -> bool:
    """False when `text` holds a lone surrogate (UTF-8 cannot encode it, so no response can carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None  # a name that is a list or an object is no name (and cannot be looked up)
    return new_call(value["name"], value.get("arguments", value.get("parameters", {})))


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

    @classmethod
    def call_grammar(cls, tools: dict[str, dict | None], *, forced: bool, parallel: bool = True,
                     reasoning: str | None = None, strict: frozenset[str] = frozenset(), template: str = "",
                     added_tokens: Mapping[str, int] | None = None) -> str:
        """Lark text of a whole reply this parser reads as calls to `tools` (name -> parameters schema, None: any
        object), arguments valid against each schema (`strict`: the tools whose unknown keywords are refused rather
        than ignored). `forced`: calls only (several when `parallel`); otherwise free text that can never open a
        call, optionally followed by calls. `reasoning` as formats.reasoning_in says; `template`: the chat template,
        for formats with variants. `added_tokens`: the vocabulary's added tokens (vocabulary_tokens): a marker
        the vocabulary holds as a token is written as that token (llguidance reads every added token that looks
        like `<...>` as special, which text does not match); None: every marker as text."""
        raise NotImplementedError

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
