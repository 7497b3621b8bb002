"""What the lab keeps of one request: the chunks of its SSE stream, each with its arrival time, and what the server
said about it. Metrics are computed from these raw records (metrics.py), never stored instead of them, so a run
stored today can be re-read under the same definitions later."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Chunk:
    t: float  # seconds from sending the request to this chunk's arrival
    content: str = ""
    reasoning: str = ""  # delta.reasoning_content or delta.reasoning: thinking tokens, not the answer
    tokens: float = 0.0  # output tokens this chunk carries; set by tokens.assign_tokens after the response ends


@dataclass
class RequestRecord:
    item_id: str
    category: str
    phase: str = "sequential"  # sequential | c=<users> (sweep) | soak | compare
    arm: str = ""  # "A" or "B" in compare mode
    user: int = 0
    concurrency: int = 1
    max_tokens: int = 0
    sent_at: float = 0.0  # seconds from the start of the run to sending this request
    sent_unix: float = 0.0
    chunks: list[Chunk] = field(default_factory=list)  # token-bearing chunks only (role-only and usage chunks dropped)
    end_s: float | None = None  # seconds from sending to the end of the stream ([DONE] or close)
    prompt_tokens: float | None = None
    output_tokens: float | None = None
    token_source: str = ""  # usage | tokenizer:<name> | approx:<how>
    usage: dict | None = None
    finish_reason: str | None = None
    status: int | None = None  # HTTP status
    error: str | None = None  # None when the request succeeded; errors are recorded, never dropped
    repeat: int = 0  # which pass over the workload (sequential) or over the levels (sweep), from 0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def content(self) -> str:
        return "".join(c.content for c in self.chunks)

    @property
    def reasoning(self) -> str:
        return "".join(c.reasoning for c in self.chunks)
