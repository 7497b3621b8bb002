"""How a chat reply is read: tool calls in the format the model's chat template teaches, and reasoning text split
from the answer. The format is chosen from the markers the template renders, not from the model's name.

| template renders                       | tool calls read as                                                |
|----------------------------------------|-------------------------------------------------------------------|
| `<|channel|>` (gpt-oss)                | harmony messages: analysis, `commentary to=functions.NAME`, final |
| `<parameter=` (Qwen3-Coder)            | `<tool_call><function=NAME><parameter=P>...` (XML)                |
| `[TOOL_CALLS]` (Mistral)               | `[TOOL_CALLS][{...}]` or `[TOOL_CALLS]NAME[ARGS]{...}`            |
| `"parameters": dictionary` (Llama 3.x) | a reply that is `{"name": ..., "parameters": {...}}`              |
| anything else                          | Hermes/Qwen2.5 `<tool_call>{json}</tool_call>`, Llama 3.1 JSON    |

A template that renders `</think>` makes the reply's leading `<think>...</think>` reasoning; one whose generation
prompt ends in `<think>` starts the reply inside it. Harmony's channels carry reasoning themselves, so its parser
reads every reply. Every parser takes text deltas and returns events, ("content", text), ("reasoning", text) and
("tool_call", call), and holds back whatever may still become a marker. Each parser class also writes the grammar
of the replies it reads as calls (ToolParser.call_grammar), for tool_choice and for `auto` with a grammar.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastdecode.server.formats.base import Event, ToolParser
from fastdecode.server.formats.harmony import HarmonyParser
from fastdecode.server.formats.hermes import HermesParser
from fastdecode.server.formats.llama3 import MARKER as LLAMA3_MARKER
from fastdecode.server.formats.llama3 import Llama3Parser
from fastdecode.server.formats.mistral import MistralParser
from fastdecode.server.formats.qwen3_coder import Qwen3CoderParser
from fastdecode.server.formats.reasoning import CLOSE as THINK_CLOSE
from fastdecode.server.formats.reasoning import OPEN as THINK_OPEN
from fastdecode.server.formats.reasoning import ReasoningParser

# (what the template renders, the parser): the first match wins; Hermes reads templates that teach no format and
# the tools-in-the-system-message prompt given to templates that know no tools.
TOOL_FORMATS: list[tuple[str, type[ToolParser]]] = [("<|channel|>", HarmonyParser), ("<parameter=", Qwen3CoderParser),
                                                    ("[TOOL_CALLS]", MistralParser), (LLAMA3_MARKER, Llama3Parser)]

__all__ = ["Event", "HarmonyParser", "HermesParser", "Llama3Parser", "MistralParser", "Qwen3CoderParser",
           "ReasoningParser", "ReplyFormat", "ToolParser", "reasoning_in", "tool_format"]


def tool_format(chat_template: str | None) -> type[ToolParser]:
    return next((parser for marker, parser in TOOL_FORMATS if marker in (chat_template or "")), HermesParser)


def reasoning_in(chat_template: str | None, prompt_tail: str) -> str | None:
    """None: the template knows no reasoning; "tags": the reply may open with `<think>`; "inside": the prompt opened
    it. `prompt_tail`: the end of the rendered prompt."""
    if THINK_CLOSE not in (chat_template or ""):
        return None
    return "inside" if prompt_tail.rstrip().endswith(THINK_OPEN) else "tags"


@dataclass
class ReplyFormat:
    """What a reply is parsed for, when it holds more than text; one parser per response comes from parser()."""
    tool_parser: type[ToolParser] | None = None  # None: no tools offered (and no channels), no calls read
    tools: dict[str, dict | None] | None = None  # name -> parameters schema of each offered tool
    reasoning: str | None = None  # see reasoning_in

    def parser(self):
        calls = self.tool_parser(self.tools or {}) if self.tool_parser is not None else None
        return ReasoningParser(calls, inside=self.reasoning == "inside") if self.reasoning else calls

    @property
    def special_markers(self) -> tuple[str, ...]:
        return self.tool_parser.special_markers if self.tool_parser is not None else ()

    @property
    def stop_markers(self) -> tuple[str, ...]:
        return self.tool_parser.stop_markers if self.tool_parser is not None else ()
