"""Tool calls in the prompt: the messages and tools the chat template sees. Calls in the reply are read, and
constrained, by server/formats/.

Templates that know tools (Qwen, Hermes, Llama 3.1, Mistral...) get `tools` and the conversation as OpenAI sends it.
For templates that ignore `tools` (SmolLM2's, Gemma 3's) the tools go into the system message in the Hermes form and
earlier calls and results are written as `<tool_call>`/`<tool_response>` text, so every model sees one protocol.
"""
from __future__ import annotations

import json
from typing import Callable

from fastdecode.server.formats.base import loads_object
from fastdecode.server.formats.hermes import CLOSE, OPEN

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


def template_messages(messages: list[dict], tools: list[dict] | None, knows_tools: bool,
                      call_id: Callable[[str], str] = str) -> list[dict]:
    """OpenAI messages (content already text) -> what the chat template renders. `call_id`: a call's id as the
    template accepts it (Mistral's want 9 letters or digits)."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        if m.get("reasoning_content"):  # Qwen3's templates read reasoning_content, gpt-oss's `thinking`
            m["thinking"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls and knows_tools:
            m["tool_calls"] = [{**c, "id": call_id(c["id"]), "function": {**c["function"], "arguments": loads_object(
                c["function"]["arguments"])}} for c in calls]
        elif m["role"] == "tool" and knows_tools and m.get("tool_call_id") is not None:
            m["tool_call_id"] = call_id(m["tool_call_id"])
        elif calls:
            text = "".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': loads_object(c['function']['arguments'])})}\n{CLOSE}"  # noqa: E501
                           for c in calls)
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m["role"] == "tool" and not knows_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        if m["role"] in ("user", "system") and out and out[-1]["role"] == m["role"] \
                and isinstance(m.get("content"), str) and isinstance(out[-1].get("content"), str):
            # one turn: strict templates (Gemma's) need one system message, then user and assistant turns in turn
            # (Codex CLI sends two developer messages, then two user messages)
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
