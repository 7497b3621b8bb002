"""Incremental detokenization: text deltas from a growing token list, never splitting a UTF-8 character, and
stop strings held back until they can no longer be the start of a match."""
from __future__ import annotations

# Prompt tokens decoded with the output so that tokenizers that strip a leading space decode the first output
# token as they would in context.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""  # all output text decoded so far
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Adds one output token and returns the text that is now safe to emit."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # U+FFFD: an incomplete UTF-8 sequence
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> str:
        end = len(self.text)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
                end = min(end, at)
        if not self.stopped and self.stop:
            # Hold back a tail that could still grow into a stop string.
            hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end -= hold
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever was held back (an unfinished stop-string prefix) is text."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
