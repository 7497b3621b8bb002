"""Tool calls: the messages and tools the chat template sees, the grammar that forces a call, and the parser that
turns the model's tool-call text back into OpenAI `tool_calls`, whole or while it streams.

Templates that know tools (Qwen, Hermes, Llama 3.1...) get `tools` and the conversation as OpenAI sends it. For
templates that ignore `tools` (SmolLM2's, Gemma 3's) the tools go into the system message in the Hermes form and
earlier calls and results are written as `<tool_call>`/`<tool_response>` text, so every model sees one protocol.
Parsed forms: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.1 `<function=name>{...}</function>`,
and a reply that is nothing but a call object or a list of them (Llama 3.x, Mistral after their special tokens
are stripped from the text).
"""
from __future__ import annotations

import json
import re
import secrets

from fastdecode.engine.constraints import Alternatives, JsonObject, Literal, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_TAG = re.compile(r"<function=([a-zA-Z0-9_-]{1,64})>(.*?)</function>", re.S)
MARKERS = [(OPEN, CLOSE), ("<function=", "</function>")]  # (start, end) of a call inside text
TOOLS_SYSTEM = """You can call functions. These are the functions available, as JSON Schema:
<tools>
{tools}
</tools>
To call a function, answer with one block per call, each holding a JSON object with the function's name and its
arguments:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_knows_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def template_messages(messages: list[dict], tools: list[dict] | None, knows_tools: bool) -> list[dict]:
    """OpenAI messages (content already text) -> what the chat template renders."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        calls = m.get("tool_calls")
        if calls and knows_tools:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": loads_object(
                c["function"]["arguments"])}} for c in calls]
        elif calls:
            text = "".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': loads_object(c['function']['arguments'])})}\n{CLOSE}"  # noqa: E501
                           for c in calls)
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m["role"] == "tool" and not knows_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        if m["role"] == "user" and out and out[-1]["role"] == "user" and isinstance(m.get("content"), str) \
                and isinstance(out[-1].get("content"), str):
            # one turn: strict templates (Gemma's) need user and assistant turns to alternate
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
            continue
        out.append(m)
    if tools and not knows_tools:
        system = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def loads_object(arguments):
    """Tool-call arguments as templates expect them: a dict when the string holds a JSON object."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def forced_call_grammar(tools: list[dict]) -> Sequence:
    """Output that is exactly one Hermes tool call to one of `tools` (tool_choice "required" or a named tool), its
    arguments keyed by the function's parameters."""
    calls = [Sequence([Literal(f'{t["function"]["name"]}", "arguments": '),
                       JsonObject.for_schema(t["function"].get("parameters"))]) for t in tools]
    return Sequence([Literal(f'{OPEN}\n{{"name": "'), Alternatives(calls), Literal(f"}}\n{CLOSE}")])


def new_call(name: str, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def call_from_json(value, names: set[str]) -> dict | None:
    """{"name": ..., "arguments"|"parameters": {...}} naming a known tool -> an OpenAI tool call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments)


def parse_block(inner: str, names: set[str]) -> dict | None:
    try:
        return call_from_json(json.loads(inner), names)
    except ValueError:
        return None


def parse_bare(text: str, names: set[str]) -> list[dict] | None:
    """A reply that is only a call object or a list of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, names) for v in values]
    return calls if calls and all(calls) else None


class ToolCallParser:
    """Text deltas in, ("content", text) and ("tool_call", call) events out, in order. Text that may still become
    a tool call is held back until it is one or cannot be."""

    def __init__(self, names: list[str]):
        self.names = set(names)
        self.buffer = ""
        self.mode = "start"  # start: nothing but whitespace yet; text; call: inside a marker; whole: to the end
        self.close = CLOSE  # what ends the call being read
        self.whitespace = ""  # leading whitespace, emitted once we know the reply is text

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        events = []
        while True:
            if self.mode == "start":
                stripped = self.buffer.lstrip()
                if not stripped:
                    return events
                self.whitespace, self.buffer = self.buffer[:len(self.buffer) - len(stripped)], stripped
                self.mode = "whole" if stripped[0] in "[{" else "text"
            if self.mode == "whole":
                return events
            if self.mode == "text":
                starts = [(at, close) for at, close in ((self.buffer.find(m), c) for m, c in MARKERS) if at >= 0]
                if not starts:
                    hold = partial_marker(self.buffer)
                    events += self._content(self.buffer[:len(self.buffer) - hold])
                    self.buffer = self.buffer[len(self.buffer) - hold:]
                    return events
                at, self.close = min(starts)
                events += self._content(self.buffer[:at])
                self.buffer, self.mode = self.buffer[at:], "call"
            if self.mode == "call":
                end = self.buffer.find(self.close)
                if end < 0:
                    return events
                block = self.buffer[:end + len(self.close)]
                call = self._parse(block)
                events += [("tool_call", call)] if call else self._content(block)
                self.buffer, self.mode = self.buffer[end + len(self.close):], "text"

    def finish(self) -> list[tuple[str, object]]:
        text, self.buffer = self.buffer, ""
        if self.mode == "whole":
            calls = parse_bare(text.strip(), self.names)
            if calls:
                return [("tool_call", c) for c in calls]
        if self.mode == "call":  # EOS before the closing marker: a complete object still counts
            call = self._parse(text + self.close)
            if call:
                return [("tool_call", call)]
        return self._content(text)

    def _parse(self, block: str) -> dict | None:
        if block.startswith(OPEN):
            return parse_block(block[len(OPEN):-len(CLOSE)], self.names)
        match = FUNCTION_TAG.fullmatch(block)
        if match is None:
            return None
        arguments = loads_object(match.group(2).strip())
        return new_call(match.group(1), arguments) if match.group(1) in self.names and isinstance(
            arguments, dict) else None

    def _content(self, text: str) -> list[tuple[str, object]]:
        if not text:
            return []
        text, self.whitespace = self.whitespace + text, ""
        return [("content", text)]


def partial_marker(text: str) -> int:
    """Length of the longest tail of `text` that could grow into a tool-call marker."""
    return max((k for marker, _ in MARKERS for k in range(1, min(len(marker), len(text) + 1))
                if text.endswith(marker[:k])), default=0)
