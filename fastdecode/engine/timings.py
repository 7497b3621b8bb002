"""What one request's phases took: the figures of its speed line, `--json` and the server's usage."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Timings:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # request start -> first output token sampled (includes prefill)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first output token -> last output token
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    disk_cached_tokens: int = 0  # of those, the ones read from the prefix cache's disk tier

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens computed (not found in the prefix cache) per second."""
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def output_tok_s(self) -> float:
        """Decode speed with the first token excluded (it belongs to TTFT), as Artificial Analysis counts it."""
        return (self.output_tokens - 1) / self.decode_s if self.output_tokens > 1 and self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s, "output_tok_s": self.output_tok_s}
