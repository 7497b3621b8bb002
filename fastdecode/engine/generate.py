"""Prefill and decode over the static KV cache, as separate timed phases."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from fastdecode.engine.sampling import Sampler

PREFILL_CHUNK = 1024  # long prompts are prefilled in pieces so attention scratch stays bounded


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


@torch.inference_mode()
def prefill(model, prompt_ids: list[int], start: int = 0, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Runs the prompt through the model, filling the cache; returns the last position's logits (vocab,)."""
    tokens = torch.tensor(prompt_ids, dtype=torch.long).unsqueeze(0)
    for i in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, i:i + chunk], start + i)
    return logits[0, -1]


@torch.inference_mode()
def decode_one_token(model, token: torch.Tensor, pos: int) -> torch.Tensor:
    """token (1, 1) at position pos -> logits (vocab,)."""
    return model(token, pos)[0, -1]


def generate_tokens(model, prompt_ids: list[int], sampler: Sampler, max_tokens: int, stop_ids: set[int],
                    timings: Timings, decode=None) -> Iterator[int]:
    """Yields output token ids (a stop token is yielded too, then generation ends); fills `timings` as it goes.
    `decode(token (1, 1), pos) -> logits` defaults to the model's own forward (the native decoder is faster)."""
    decode = decode or (lambda token, pos: decode_one_token(model, token, pos))
    t0 = time.perf_counter()
    logits = prefill(model, prompt_ids)
    timings.prompt_tokens = len(prompt_ids)
    timings.prefill_s = time.perf_counter() - t0
    token = sampler.sample(logits)
    t_first = time.perf_counter()
    timings.ttft_s = t_first - t0
    step = torch.empty((1, 1), dtype=torch.long)
    pos = len(prompt_ids)
    for n in range(1, max_tokens + 1):
        sampler.accept(token, logits)
        timings.output_tokens = n
        timings.decode_s = time.perf_counter() - t_first
        yield token
        if token in stop_ids or n == max_tokens:
            return
        step[0, 0] = token
        logits = decode(step, pos)
        token = sampler.sample(logits)
        pos += 1
