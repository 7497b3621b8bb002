"""Llama 3.1-3.3's JSON calls: the whole reply is one `{"name": "NAME", "parameters": {...}}` object, as their
templates ask (`Respond in the format {"name": function name, "parameters": dictionary of argument name and its
value}`). HermesParser reads it (parse_bare), with the other forms it knows; this format adds only its grammar."""
from __future__ import annotations

from fastdecode.server.formats.hermes import HermesParser
from fastdecode.server.formats.lark import call_object, text_terminal, tool_rules
from fastdecode.server.formats.reasoning import reasoning_grammar

MARKER = '"parameters": dictionary of argument name'  # in each of the templates' system prompts


class Llama3Parser(HermesParser):
    @classmethod
    def call_grammar(cls, tools, *, forced, parallel=True, reasoning=None, strict=frozenset(), template="",
                     added_tokens=None) -> str:
        """One call and nothing else (the templates teach no parallel calls), or text that cannot open like JSON
        (a reply that opens with `{` is a call)."""
        start, not_opening = reasoning_grammar(reasoning, added_tokens or {})
        answer = ["answer: tool"] if forced else [
            "answer: TEXT | tool", text_terminal("TEXT", cls.starts, (*not_opening, r"\s*[\[{]"))]
        return "\n".join([*start, *answer, *tool_rules(tools, strict, call_object("parameters"))])
