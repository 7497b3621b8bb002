"""Reasoning text, `<think>...</think>` at the start of a reply (Qwen3, DeepSeek-R1, QwQ), split from the answer.

Templates such as DeepSeek-R1's open `<think>` in the generation prompt, so the reply starts inside the reasoning
and only `</think>` shows: `inside=True`. A reply that ends before `</think>` (max_tokens) is all reasoning. The
whitespace the model writes around the reasoning and before the answer is dropped."""
from __future__ import annotations

from collections.abc import Mapping

from fastdecode.server.formats.base import Event, partial_marker
from fastdecode.server.formats.lark import GAP, marker, regex_escape, text_terminal, text_until

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """Text deltas in, ("reasoning", text) events out, then the answer's deltas through `answer` (a tool parser,
    or None for plain text)."""

    def __init__(self, answer, inside: bool):
        self.answer = answer
        self.mode = "reasoning" if inside else "start"  # start -> reasoning -> after (whitespace) -> answer
        self.buffer = ""
        self.lead = True  # at the start of the reasoning: whitespace is dropped

    def feed(self, text: str) -> list[Event]:
        if self.mode == "answer":
            return self._answer(text)
        self.buffer += text
        events = []
        if self.mode == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.buffer, self.mode = head[len(OPEN):], "reasoning"
            elif not OPEN.startswith(head):
                self.mode, text, self.buffer = "answer", self.buffer, ""
                return self._answer(text)
            else:
                return []
        if self.mode == "reasoning":
            if self.lead:
                self.buffer = self.buffer.lstrip()
                self.lead = not self.buffer
            end = self.buffer.find(CLOSE)
            if end < 0:
                head = self.buffer[:len(self.buffer) - partial_marker(self.buffer, (CLOSE,))]
                emit = head.rstrip()  # trailing whitespace waits: it may be the last before </think>
                self.buffer = self.buffer[len(emit):]
                return [("reasoning", emit)] if emit else []
            if self.buffer[:end].rstrip():
                events.append(("reasoning", self.buffer[:end].rstrip()))
            self.buffer, self.mode = self.buffer[end + len(CLOSE):], "after"
        text, self.buffer = self.buffer.lstrip(), ""  # mode "after"
        if text:
            self.mode = "answer"
            events += self._answer(text)
        return events

    def finish(self) -> list[Event]:
        events = []
        if self.mode == "start" and self.buffer:  # only a beginning of `<think>`: that was the answer
            events += self._answer(self.buffer)
        elif self.mode == "reasoning" and self.buffer.strip():  # cut off while reasoning
            events.append(("reasoning", self.buffer.rstrip()))
        self.buffer = ""
        return events + (self.answer.finish() if self.answer is not None else [])

    def _answer(self, text: str) -> list[Event]:
        if self.answer is not None:
            return self.answer.feed(text)
        return [("content", text)] if text else []


def reasoning_grammar(reasoning: str | None, added_tokens: Mapping[str, int]) -> tuple[list[str], tuple[str, ...]]:
    """Lark rules of `start`: the reasoning `reasoning` asks for (formats.reasoning_in), then the rule `answer`; and
    the regexes the answer's free text must not open with (text opening with `<think>` is read as reasoning)."""
    if reasoning is None:
        return ["start: answer"], ()
    thought = [text_terminal("THOUGHT", [CLOSE]), text_until("thought", "THOUGHT", CLOSE, added_tokens)]
    if reasoning == "inside":
        return [*thought, f"start: thought {GAP} answer"], ()
    return [*thought, f"start: ({marker(OPEN, added_tokens)} thought {GAP})? answer"], (r"\s*" + regex_escape(OPEN),)
