"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text (code needs no JSON escaping); each becomes the JSON type the tool's schema gives its parameter,
as vLLM's qwen3_coder parser does: integer, number, boolean, object and array (JSON), else the string as written.
A `<function=...>` block without `<tool_call>` around it is read too (the model drops the wrapper at times).

The grammar writes each offered tool's parameters in their declared order, the required ones always, each at most
once: typed ones as JSON their schema accepts (booleans also as `True`/`False`, as Qwen's template renders them),
strings as raw text that cannot close the value, the function or the call early.
"""
from __future__ import annotations

import ast
import json
import math
import re

import llguidance

from fastdecode.engine.grammar import lark_json
from fastdecode.server.formats.base import ToolParser, json_problem, new_call
from fastdecode.server.formats.lark import ANY, literal, marker, opener_grammar, text_terminal, text_until
from fastdecode.server.formats.reasoning import reasoning_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
FUNCTION = re.compile(r"\s*<function=([^>\n]{1,128})>(.*?)</function>", re.S)
PARAMETER = re.compile(r"\s*<parameter=([^>\n]{1,128})>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    starts = (OPEN, FUNCTION_OPEN)

    @classmethod
    def call_grammar(cls, tools, *, forced, parallel=True, reasoning=None, strict=frozenset(), template="",
                     added_tokens=None) -> str:
        added_tokens = added_tokens or {}
        if not tools:
            raise ValueError("a call grammar needs a tool to call")
        start, not_opening = reasoning_grammar(reasoning, added_tokens)
        text = text_terminal("TEXT", cls.starts, not_opening)
        answer = opener_grammar(OPEN, "body", literal("\n"), text, added_tokens, forced=forced, parallel=parallel)
        # The XML tags are text: in Qwen3-Coder's vocabulary only <tool_call> and </tool_call> are tokens.
        lines = [*start, *answer, f'body: "\\n" function "\\n" {marker(CLOSE, added_tokens)}',
                 "function: " + " | ".join(f"function_{i}" for i in range(len(tools))),
                 text_terminal("VALUE", (PARAMETER_CLOSE, FUNCTION_CLOSE, CLOSE)),
                 text_until("text_value", "VALUE", "\n" + PARAMETER_CLOSE, {})]
        for i, (name, schema) in enumerate(tools.items()):
            schema = schema or {}
            parts = [literal(f"{FUNCTION_OPEN}{name}>\n")]
            for j, (parameter, spec) in enumerate((schema.get("properties") or {}).items()):
                rule = f"p_{i}_{j}"
                head = literal(f"{PARAMETER_OPEN}{parameter}>\n")
                value, defined = value_rules(f"{rule}_value", spec, name in strict)
                lines += [f'{rule}: {head} {value} "\\n"', *defined]
                parts.append(rule if parameter in (schema.get("required") or ()) else f"{rule}?")
            lines.append(f"function_{i}: {' '.join(parts)} {literal(FUNCTION_CLOSE)}")
        return "\n".join(lines)

    def read_call(self, text: str, final: bool):
        close = CLOSE if text.startswith(OPEN) else FUNCTION_CLOSE
        end = text.find(close)
        if end < 0:
            if not final:
                return None
            return self._parse(closed(text[len(OPEN):] if close == CLOSE else text)), len(text)
        used = end + len(close)
        return self._parse(text[len(OPEN):end] if close == CLOSE else text[:used]), used

    def _parse(self, inner: str) -> list[dict] | None:
        """`inner`: one or more function blocks and whitespace, nothing else."""
        calls, at = [], 0
        for match in FUNCTION.finditer(inner):
            if match.start() != at or match.group(1) not in self.tools:
                return None
            arguments = self._arguments(match.group(2), self.tools[match.group(1)] or {})
            call = new_call(match.group(1), arguments) if arguments is not None else None
            if call is None:
                return None
            calls.append(call)
            at = match.end()
        return calls if calls and not inner[at:].strip() else None

    def _arguments(self, body: str, schema: dict) -> dict | None:
        properties = schema.get("properties") or {}
        out, at = {}, 0
        for match in PARAMETER.finditer(body):
            if match.start() != at:
                return None
            name, value = match.group(1), match.group(2)
            value = value.removeprefix("\n").removesuffix("\n")  # the template writes a newline either side
            out[name] = typed(value, properties.get(name))
            at = match.end()
        return out if not body[at:].strip() else None


def value_rules(rule: str, schema: dict | None, strict: bool) -> tuple[str, list[str]]:
    """A parameter's value as typed() reads it back: (the Lark that spells it and the `\\n</parameter>` after it,
    the rules that needs)."""
    kind, close = schema_type(schema), literal("\n" + PARAMETER_CLOSE)
    schema = schema if isinstance(schema, dict) else {}
    if kind == "boolean":  # Qwen's template renders Python's booleans
        words = ["true", "false", "True", "False"] + (["null"] if "null" in (schema.get("type") or ()) else [])
        return f"{rule} {close}", [f"{rule}: " + " | ".join(map(literal, words))]
    if kind not in (None, "string"):
        return f"{rule} {close}", [f"{rule}: {lark_json(schema, strict)}"]
    choices = [v for v in schema.get("enum", [schema["const"]] if "const" in schema else []) if isinstance(v, str)]
    if choices:  # as raw text
        return f"{rule} {close}", [f"{rule}: " + " | ".join(map(literal, choices))]
    # minLength/maxLength are left to the tool: a count intersected with VALUE's negation costs llguidance's lexer a
    # derivative per (length, tag prefix) state, and past "</parameter" in a value of maxLength 60 one mask took more
    # than its per-token fuel (the request then failed: 4 of 100 forced Qwen3-Coder calls in bench/tool_calls.py);
    # at maxLength 1000 ten times that fuel did not do. (A rule's max_tokens is no bound either: at its limit
    # llguidance ends the rule where it stands, without the closing tag.) A pattern is intersected as it is.
    if isinstance(schema.get("pattern"), str):
        text = rule.upper()
        return rule, [f"{text}: VALUE & {search_regex(schema['pattern'])}",
                      text_until(rule, text, "\n" + PARAMETER_CLOSE, {})]
    return "text_value", []


def search_regex(pattern: str) -> str:
    """A JSON Schema `pattern` (it matches anywhere in the string unless anchored) as a Lark regex of the whole
    string (llguidance's regexes take no anchors)."""
    body, head, tail = llguidance.regex_to_lark(pattern, "dw"), ANY, ANY  # JSON Schema's \d and \w: ASCII
    if body.startswith("^"):
        body, head = body[1:], ""
    if body.endswith("$") and not body.endswith("\\$"):
        body, tail = body[:-1], ""
    return f"/{head}({body}){tail}/"


def closed(text: str) -> str:
    """A call cut by the end of the reply, with the closing tags it lacks: `</parameter>` if a value is open,
    `</function>` if a function is."""
    if text.rfind(PARAMETER_OPEN) > text.rfind(PARAMETER_CLOSE):  # a cut right after the value's newline: add none
        text += ("" if text.endswith("\n") else "\n") + PARAMETER_CLOSE
    if text.rfind(FUNCTION_OPEN) > text.rfind(FUNCTION_CLOSE):
        text += "\n" + FUNCTION_CLOSE
    return text


def typed(value: str, schema: dict | None):
    """A raw parameter value as the JSON type `schema` declares; as written when it is not one, or when what it
    reads as is not plain JSON (a Python literal with a tuple key, bytes or a set; NaN; a lone surrogate)."""
    parsed = as_type(value, schema_type(schema))
    return parsed if json_problem(parsed) is None else value


def as_type(value: str, kind: str | None):
    """`value` read as the JSON type `kind`; `value` itself when it does not read as one."""
    if kind in (None, "string"):
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", text) else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    if kind in ("object", "array"):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
            pass
        try:  # a Python literal ({'a': 1}), as models sometimes write
            parsed = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # TypeError: {[1]: 2}
            return value
        return parsed if isinstance(parsed, (dict, list)) else value
    return value


def schema_type(schema: dict | None) -> str | None:
    """The one JSON type a parameter's schema names (`["integer", "null"]` names integer); None when it names
    none or several."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    return kind if isinstance(kind, str) else None
