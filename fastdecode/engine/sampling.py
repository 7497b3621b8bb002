"""Sampling parameters and the logits -> token step (greedy when temperature is 0)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastdecode.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face's rule, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI's rules, over output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks decode a fixed number of tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Per-request sampling state: output token counts for the penalties and a seeded generator."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int]):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # prompt or output, for repetition_penalty
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # output only, for presence/frequency
        if params.repetition_penalty != 1 and prompt_ids:
            self.seen[torch.tensor(prompt_ids)] = True

    def accept(self, token: int):
        self.seen[token] = True
        self.counts[token] += 1

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, temperature and truncation applied to float32 logits (vocab,); -inf marks removed tokens."""
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1:
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, penalised, logits)
        if p.presence_penalty or p.frequency_penalty:
            logits = logits - p.presence_penalty * (self.counts > 0) - p.frequency_penalty * self.counts
        if p.greedy:
            return logits
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if p.min_p > 0:
            probs = torch.softmax(logits, -1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), -math.inf)
        if p.top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the token that crosses top_p
            logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from (one-hot for greedy)."""
        logits = self.process(logits)
        if self.params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        return torch.softmax(logits, -1)

    def sample(self, logits: torch.Tensor) -> int:
        """logits (vocab,) -> next token id."""
        if self.params.greedy and not self.params.penalised:
            return int(logits.argmax())
        logits = self.process(logits)
        if self.params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator))
