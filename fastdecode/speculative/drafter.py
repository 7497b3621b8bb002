"""The drafter interface: propose a chain or tree for a context; learn from what the target accepted."""
from __future__ import annotations

from typing import Callable

from fastdecode.engine.sampling import SamplingParams
from fastdecode.speculative.draft import Draft


class Drafter:
    name = "drafter"
    model_free = True  # proposing costs next to nothing next to a forward pass (no model runs)

    def start(self, prompt_ids: list[int], params: SamplingParams | None = None):
        """A new request begins with this prompt, sampled with these parameters."""

    def propose(self, context: list[int], budget: int, promising: Callable[[float], bool] | None = None) -> Draft | None:
        """At most `budget` nodes continuing `context` (prompt plus output so far, its last token not yet in the
        target's cache, at position len(context) - 1), or None when there is nothing worth drafting.
        `promising(score)`: whether a first node (one under the root) with this score could get the draft verified
        (Policy.gate); a drafter may return None without building a draft when none of its first nodes is."""
        raise NotImplementedError

    def observe(self, context: list[int]):
        """The request's tokens after a verify step (context grew by the emitted tokens)."""

    def finish(self, context: list[int]):
        """The request ended; `context` is its prompt plus output."""
