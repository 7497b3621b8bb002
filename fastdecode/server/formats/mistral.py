"""Mistral's calls after a `[TOOL_CALLS]` special token, in both forms its templates have used:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]      (Mistral 7B v0.3, Nemo, Small 3.1)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                             (Small 3.2, Devstral, Magistral)

The second form repeats `[TOOL_CALLS]` for each call and may carry `[CALL_ID]id` before `[ARGS]`. There is no
closing marker: a call ends where its JSON does. `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are special tokens,
which the detokenizer keeps in the text for this format only.
"""
from __future__ import annotations

import json
import re

from fastdecode.server.formats.base import ToolParser, call_from_json, new_call
from fastdecode.server.formats.lark import call_object, literal, marker, opener_grammar, text_terminal, tool_rules
from fastdecode.server.formats.reasoning import reasoning_grammar

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAMED = re.compile(r"([a-zA-Z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9_-]*)?\[ARGS\]\s*")
NAMING = re.compile(r"[a-zA-Z0-9_.-]{0,64}(?:\[CALL_ID\][A-Za-z0-9_-]*)?")  # what a NAMED may still grow from
DECODER = json.JSONDecoder()


class MistralParser(ToolParser):
    starts = (TOOL_CALLS,)
    special_markers = (TOOL_CALLS, ARGS, CALL_ID)

    @staticmethod
    def template_call_id(call_id: str) -> str:
        """Mistral's templates refuse ids that are not 9 letters or digits: the id's last 9 of them, padded."""
        return "".join(c for c in call_id if c.isascii() and c.isalnum())[-9:].rjust(9, "0")

    @classmethod
    def call_grammar(cls, tools, *, forced, parallel=True, reasoning=None, strict=frozenset(), template="",
                     added_tokens=None) -> str:
        """`[TOOL_CALLS]NAME[ARGS]{...}` for each call where the template renders `[ARGS]`, else one
        `[TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...]` list."""
        added_tokens = added_tokens or {}
        start, not_opening = reasoning_grammar(reasoning, added_tokens)
        text = text_terminal("TEXT", cls.starts, not_opening)
        if ARGS in template:
            frame = lambda name, args: f"{literal(name)} {marker(ARGS, added_tokens)} {args}"  # noqa: E731
            answer = opener_grammar(TOOL_CALLS, "tool", "", text, added_tokens, forced=forced, parallel=parallel)
        else:
            frame = call_object("arguments")
            more = ' (", " tool)*' if parallel else ""
            answer = [*opener_grammar(TOOL_CALLS, "calls", "", text, added_tokens, forced=forced, parallel=False),
                      f'calls: " "? "[" tool{more} "]"']
        return "\n".join([*start, *answer, *tool_rules(tools, strict, frame)])

    def read_call(self, text: str, final: bool):
        rest = text[len(TOOL_CALLS):]
        body = rest.lstrip()
        offset = len(text) - len(body)
        if not body:
            return (None, len(text)) if final else None
        if body[0] in "[{":  # the older form: a JSON list of calls (or one call)
            value, end = json_prefix(body, final)
            if end is None:
                return None if not final else (None, len(text))
            values = value if isinstance(value, list) else [value]
            calls = [call_from_json(v, self.tools) for v in values]
            return (calls if calls and all(calls) else None), offset + end
        named = NAMED.match(body)
        if named is None:
            tail = body[NAMING.match(body).end():]
            if not final and (ARGS.startswith(tail) or CALL_ID.startswith(tail)):
                return None  # the name, its id or [ARGS] still coming
            return None, len(TOOL_CALLS)  # the marker alone is text; what follows is read again
        value, end = json_prefix(body[named.end():], final)
        if end is None:
            return None if not final else (None, len(text))
        name, used = named.group(1), offset + named.end() + end
        call = new_call(name, value) if name in self.tools else None
        return ([call] if call else None), used


def json_prefix(text: str, final: bool):
    """(value, end) of the JSON value that opens `text`; (None, None) while it is not complete. Tried only when
    the text so far ends like a JSON container, so a long call is not re-decoded at every delta."""
    if not final and not text.rstrip().endswith(("}", "]")):
        return None, None
    try:
        return DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
        return None, None
