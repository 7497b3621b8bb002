"""What a request asks its output to follow, as an llguidance grammar: OpenAI's `response_format` (json_object,
json_schema, and our `grammar` and `regex` types), vLLM's `structured_outputs` and llama.cpp's `grammar` (GBNF, or
Lark after `%llguidance`). The tool-call grammars come from each format (server/formats/).

| request field                                             | the output is                                     |
|-----------------------------------------------------------|---------------------------------------------------|
| `response_format: {"type": "json_object"}`                | one JSON object                                   |
| `response_format: {"type": "json_schema", "json_schema"}` | JSON valid against `json_schema.schema`           |
| `response_format: {"type": "grammar", "grammar": LARK}`   | a string of the Lark grammar (llguidance's)       |
| `response_format: {"type": "regex", "regex": PATTERN}`    | a string the regex matches in full                |
| `structured_outputs: {"json" / "regex" / "grammar" / "choice"}` | as vLLM reads them                          |
| `grammar: GBNF`                                           | as llama.cpp reads it                             |
"""
from __future__ import annotations

import re

from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from fastdecode.engine.grammar import json_schema_grammar, lark_grammar, regex_grammar
from fastdecode.server.errors import ApiError


def output_grammar(body) -> tuple[str, str] | None:
    """(llguidance grammar, the parameter it came from) for a Chat Completions or Completions request, or None when
    its output is free. At most one of the fields may constrain it."""
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        asked.append((built(response_format_grammar, fmt, "response_format"), "response_format"))
    if body.structured_outputs is not None:
        asked.append((built(structured_outputs_grammar, body.structured_outputs, "structured_outputs"),
                      "structured_outputs"))
    if body.grammar is not None:
        asked.append((built(lambda text: lark_grammar(gbnf_as_lark(text)), body.grammar, "grammar"), "grammar"))
    if len(asked) > 1:
        raise ApiError(400, f"{asked[0][1]} and {asked[1][1]} both constrain the output: give one", asked[1][1])
    return asked[0] if asked else None


def built(make, spec, param: str) -> str:
    """make(spec), a grammar; text that is not Unicode (JSON can spell a lone surrogate, which llguidance cannot
    take) is a 400 naming `param`."""
    try:
        return make(spec)
    except UnicodeError:
        raise ApiError(400, f"{param} is not valid Unicode: it holds a lone surrogate", param) from None


def response_format_grammar(fmt) -> str:
    if fmt.type == "json_object":
        return json_schema_grammar(None)
    if fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        return json_schema_grammar(spec.get("schema"), strict=spec.get("strict") is not False)
    if fmt.type == "grammar":
        return lark_grammar(fmt.grammar)
    return regex_grammar(fmt.regex)


def structured_outputs_grammar(spec) -> str:
    if spec.json_ is not None:
        return json_schema_grammar(spec.json_)
    if spec.regex is not None:
        return regex_grammar(spec.regex)
    if spec.choice is not None:
        return regex_grammar("|".join(re.escape(c) for c in spec.choice))
    return lark_grammar(gbnf_as_lark(spec.grammar))


# The converter's time grows with the square of a chain of rules that each name the next: 1,000 such rules took
# 0.47 s of Python, 5,000 (98k characters, within MAX_GRAMMAR_CHARS) 9 s. llama.cpp's own grammars hold tens.
MAX_GBNF_RULES = 1000


def gbnf_as_lark(text: str) -> str:
    """llama.cpp's GBNF grammars, and Lark after `%llguidance {}` as llama.cpp's llguidance build takes it."""
    rules = text.count("::=")
    if rules > MAX_GBNF_RULES:
        raise ApiError(400, f"the grammar has {rules:,} rules: at most {MAX_GBNF_RULES:,}", "grammar")
    try:
        return any_to_lark(text)
    except GbnfToLarkError as e:
        raise ApiError(400, f"the grammar cannot be read: {' '.join(str(e).split())}", "grammar") from None
    except UnicodeError:
        raise
    except Exception as e:  # the converter is Python over untrusted text: whatever it trips on, the grammar is bad
        raise ApiError(400, f"the grammar cannot be read: {type(e).__name__}", "grammar") from None
