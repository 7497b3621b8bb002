"""OpenAI's harmony format, which gpt-oss speaks: a reply is one or more messages, each a header, `<|message|>` and a
body, on a channel:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The reply begins inside the first header (the prompt ends with `<|start|>assistant`). `analysis` is reasoning;
`final`, and `commentary` without a recipient (a preamble the model says before a call), are the answer; a message
to `functions.NAME` is a call whose body is the JSON arguments. The recipient may also stand before the channel
(`<|start|>assistant to=functions.NAME<|channel|>commentary json`), as gpt-oss's own template renders past calls.
`<|call|>` and `<|return|>` end the reply (they are its stop tokens, so they never reach the text); `<|end|>` ends a
message. Text with no header at all (a reply a grammar spelled) is the answer.
"""
from __future__ import annotations

import re

from fastdecode.server.formats.base import Event, ToolParser, new_call, partial_marker
from fastdecode.server.formats.lark import literal, marker, text_terminal, text_until, tool_rules

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
MAX_HEADER = 256  # characters of header without `<|message|>`: past that it is not a header but text


class HarmonyParser(ToolParser):
    special_markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
    stop_markers = (RETURN, CALL)  # the reply's ends, in place of the vocabulary's end-of-sequence tokens
    channels = True  # reasoning and answer come on channels: every reply is read, with or without tools

    def __init__(self, tools: dict[str, dict | None]):
        super().__init__(tools)
        self.kind: str | None = None  # in a body: "reasoning", "content" or "call"; None: in a header
        self.recipient = ""

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.kind is not None:
            events += self._end_body(self.buffer)
        elif self.buffer.strip() and not self.buffer.lstrip().startswith(("<|", "to=")):
            events.append(("content", self.buffer))  # text that never became a header
        self.buffer, self.kind = "", None
        return events

    @classmethod
    def call_grammar(cls, tools, *, forced, parallel=True, reasoning=None, strict=frozenset(), template="",
                     added_tokens=None) -> str:
        """Analysis messages (reasoning), then one call, `<|channel|>commentary to=functions.NAME <|constrain|>json
        <|message|>{ARGS}<|call|>` (`<|call|>` ends the reply, so one call a reply); not `forced`: preambles on
        commentary may come before the call, or a final answer in its place. Arguments are compact JSON, as gpt-oss
        writes them. The channels carry the reasoning: `reasoning` is not asked of harmony."""
        added_tokens = added_tokens or {}
        m = lambda text: marker(text, added_tokens)  # noqa: E731

        def frame(name, args):
            return f'{literal(name + " ")} {m(CONSTRAIN)} "json" {m(MESSAGE)} {args} {m(CALL)}'

        then = f'{m(START)} "assistant"'  # the next message's header, to its channel
        return "\n".join([
            "start: analysis* call" if forced else "start: (analysis | preamble)* (call | final)",
            f'analysis: {m(CHANNEL)} "analysis" {m(MESSAGE)} said {then}',
            f'preamble: {m(CHANNEL)} "commentary" {m(MESSAGE)} said {then}',
            f'final: {m(CHANNEL)} "final" {m(MESSAGE)} answer',
            f'call: {m(CHANNEL)} "commentary to=functions." tool',
            text_terminal("BODY", cls.special_markers),  # the parser looks for the markers in the text
            text_until("said", "BODY", END, added_tokens), text_until("answer", "BODY", RETURN, added_tokens),
            *tool_rules(tools, strict, frame, compact=True)])

    @staticmethod
    def template_message(message: dict) -> dict:
        """gpt-oss's template renders a call's text or its reasoning as the analysis before it, and refuses a message
        with both: a preamble the model said before the call joins the reasoning."""
        if message.get("tool_calls") and message.get("content") and message.get("thinking"):
            message = {**message, "thinking": f"{message['thinking']}\n\n{message['content']}", "content": None}
        return message

    def _drain(self, final: bool) -> list[Event]:
        events = []
        while self.buffer:
            if self.kind is None:
                if not self._header():
                    return events
                continue
            found = [(at, m) for at, m in ((self.buffer.find(m), m) for m in BODY_ENDS) if at >= 0]
            if not found:
                if self.kind != "call" and not final:
                    keep = partial_marker(self.buffer, BODY_ENDS)
                    text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    events += [(self.kind, text)] if text else []
                return events
            at, marker = min(found)
            events += self._end_body(self.buffer[:at])
            self.buffer, self.kind = self.buffer[at + len(marker):], None
        return events

    def _header(self) -> bool:
        """Reads the header at the start of the buffer into kind and recipient; False while it is incomplete."""
        head = self.buffer.lstrip()
        at = head.find(MESSAGE)
        if at < 0:
            if len(head) <= MAX_HEADER and (head.startswith(("<|", "to=")) or
                                            partial_marker(head, (START, CHANNEL)) == len(head)):
                return False  # a header still coming (at the end of the reply: a cut one, dropped)
            self.kind = "content"  # not a header: the rest is the answer
            return True
        header, self.buffer = head[:at], head[at + len(MESSAGE):]
        channel = header.partition(CHANNEL)[2].split(CONSTRAIN)[0].split()
        recipient = RECIPIENT.search(header)
        self.recipient = recipient.group(1) if recipient else ""
        if self.recipient.startswith("functions."):
            self.kind = "call"
        elif channel and channel[0] == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"
        return True

    def _end_body(self, body: str) -> list[Event]:
        if self.kind != "call":
            return [(self.kind, body)] if body else []
        name = self.recipient.removeprefix("functions.")
        call = new_call(name, body.strip()) if name in self.tools else None
        if call:
            return [("tool_call", call)]
        return [("content", body)] if body else []  # a call to no offered tool, or not an object, is text
