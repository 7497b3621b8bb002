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
"""
from __future__ import annotations

import ast
import json
import math
import re

from fastdecode.server.formats.base import ToolParser, json_problem, new_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
FUNCTION = re.compile(r"\s*<function=([^>\n]{1,128})>(.*?)</function>", re.S)
PARAMETER = re.compile(r"\s*<parameter=([^>\n]{1,128})>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    starts = (OPEN, FUNCTION_OPEN)

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


def closed(text: str) -> str:
    """A call cut by the end of the reply, with the closing tags it lacks: `</parameter>` if a value is open,
    `</function>` if a function is."""
    if text.rfind(PARAMETER_OPEN) > text.rfind(PARAMETER_CLOSE):
        text += "\n" + PARAMETER_CLOSE
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
