"""What the tool-call formats' grammars share: Lark text (llguidance's dialect) for markers, free text that can
never open a call, calls in a row, and the JSON of a call's arguments. Each format's `call_grammar` builds its
grammar from these and from the same markers its parser looks for, so grammar and parser cannot disagree."""
from __future__ import annotations

import json
from collections.abc import Mapping

from fastdecode.engine.grammar import lark_json

# A marker the vocabulary holds as a token is written `<[id]>` (llguidance's `<name>` cannot
# name Mistral's `[TOOL_CALLS]`).
ANY = "(?s:.*)"  # any text, newlines included
GAP = r"/\n{0,2}/"  # the blank lines a model leaves between parts of a reply: no more, or a small model loops on them


def vocabulary_tokens(tokenizer) -> dict[str, int]:
    """Our tokenizer's added tokens by their text: call_grammar's `added_tokens`."""
    return {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, added_tokens: Mapping[str, int]) -> str:
    """`text` as the token the vocabulary has for it, else as text."""
    return f"<[{added_tokens[text]}]>" if text in added_tokens else literal(text)


def regex_escape(text: str) -> str:
    """`text` matched as itself inside a Lark `/.../` regex (Rust's syntax)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def text_terminal(name: str, forbidden=(), forbidden_starts=()) -> str:
    """A terminal of free text holding none of the strings `forbidden` (what a parser would read as more than
    text) and opening with none of the regexes `forbidden_starts`."""
    parts = [f"/{ANY}/"]
    if forbidden:
        parts.append(f"~/{ANY}({'|'.join(regex_escape(f) for f in forbidden)}){ANY}/")
    parts += [f"~/{start}{ANY}/" for start in forbidden_starts]
    return f"{name}: " + " & ".join(parts)


def text_until(rule: str, text: str, end: str, added_tokens: Mapping[str, int]) -> str:
    """Rule `rule`: the terminal `text` (which must not hold `end`), then `end`. A token ends the text by itself;
    text needs a lazy rule, one lexeme that ends at the first `end` (after a greedy terminal the lexer cannot tell
    where it stopped)."""
    if end in added_tokens:
        return f"{rule}: {text} {marker(end, added_tokens)}"
    return f"{rule}[lazy]: {text} {literal(end)}"


def opener_grammar(opener: str, body: str, separator: str, text: str, added_tokens: Mapping[str, int], *,
                   forced: bool, parallel: bool) -> list[str]:
    """Rules of an `answer` made of calls that each open with the marker `opener` and go on with the rule `body`,
    `separator` (Lark) between them: only calls when `forced`, else the free text `text` (the definition of a
    terminal TEXT that cannot hold `opener`) alone, or with calls after it."""
    call = f"{marker(opener, added_tokens)} {body}"
    more = f" ({separator} {call})*" if parallel else ""
    if forced:
        return [f"answer: {call}{more}"]
    return [f"answer: TEXT | lead {body}{more}", text, text_until("lead", "TEXT", opener, added_tokens)]


def call_object(key: str):
    """tool_rules' frame of a JSON call object, `{"name": "NAME", "KEY": ARGS}`."""
    return lambda name, args: " ".join([literal(f'{{"name": {json.dumps(name)}, "{key}": '), args, '"}"'])


def tool_rules(tools: dict[str, dict | None], strict: frozenset[str], frame, compact: bool = False) -> list[str]:
    """`tool: tool_0 | tool_1 ...`, each `tool_i` what `frame(name, "args_i")` says around the JSON arguments."""
    if not tools:
        raise ValueError("a call grammar needs a tool to call")
    lines = ["tool: " + " | ".join(f"tool_{i}" for i in range(len(tools)))]
    for i, (name, schema) in enumerate(tools.items()):
        lines += [f"tool_{i}: {frame(name, f'args_{i}')}", f"args_{i}: {lark_json(schema, name in strict, compact)}"]
    return lines
