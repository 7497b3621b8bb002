"""Token counts for a response: the server's `usage` when it sends one, else a tokenizer's count.

Totals come from `usage` (stream_options.include_usage) whenever the server sends it. How those tokens split over
the chunks is the tokenizer's estimate, scaled to the total; when the server streams one token per chunk (usage
total == token-bearing chunks) every chunk gets exactly one. Without usage, a local model is counted with
fastdecode's own tokenizer for it; a remote one with a tokenizer given by --tokenizer, or else approximated (with
SmolLM2's tokenizer when it is pulled, or 4 characters per token) and the record says which.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from fastdecode.lab.records import RequestRecord

CHARS_PER_TOKEN = 4.0  # English prose and code average 3.5-4.5 characters per BPE token


@dataclass
class TokenCounter:
    name: str  # tokenizer:<model> (exact for that model) or approx:<how>
    count: Callable[[str], float]
    chat_count: Callable[[list[dict]], float] | None = None  # prompt tokens of a chat, template included


def tokenizer_counter(model: str, approximate: bool = False) -> TokenCounter:
    """Counts with fastdecode's tokenizer for `model` (a registered name, GGUF file or Hugging Face directory),
    loaded on first use: a server that sends usage with one token per chunk never needs it."""
    from fastdecode.loading import load_tokenizer
    from fastdecode.loading.catalog import resolve

    path = resolve(model, pull_missing=False, log=lambda *a: None)  # a missing model fails now, not mid-run
    tok = functools.cache(lambda: load_tokenizer(path))

    def count(text):
        return len(tok().encode(text, add_special_tokens=False)) if text else 0

    def chat_count(messages):
        return len(tok().encode(tok().apply_chat_template(messages), add_special_tokens=False))

    return TokenCounter(f"{'approx' if approximate else 'tokenizer'}:{model}", count, chat_count)


def approximate_counter() -> TokenCounter:
    """For a remote model without usage: SmolLM2's BPE when it is pulled (close to GPT-style counts), else chars/4."""
    from fastdecode.loading.catalog import DEFAULT_MODEL, cached_path

    if cached_path(DEFAULT_MODEL).exists():
        return tokenizer_counter(DEFAULT_MODEL, approximate=True)
    return TokenCounter(f"approx:{CHARS_PER_TOKEN:g} chars per token",
                        lambda text: max(1.0, round(len(text) / CHARS_PER_TOKEN)) if text else 0.0,
                        lambda messages: sum(len(m["content"]) for m in messages) / CHARS_PER_TOKEN)


def apportion(estimates: list[float], total: float | None) -> list[float]:
    """Per-chunk token counts that add up to `total` (the server's usage), shaped by the tokenizer's estimates."""
    if total is None or not estimates:
        return estimates
    nonzero = sum(1 for e in estimates if e > 0)
    if total == nonzero:  # one token per chunk, the common case: exact
        return [1.0 if e > 0 else 0.0 for e in estimates]
    s = sum(estimates)
    return [e * total / s for e in estimates] if s > 0 else estimates


def assign_tokens(r: RequestRecord, counter: TokenCounter, messages: list[dict] | None = None) -> None:
    """Fill in the record's per-chunk tokens, its output and prompt token counts, and where they came from."""
    usage = r.usage or {}
    total = usage.get("completion_tokens")
    if total is not None and total == len(r.chunks):  # one token per chunk: no tokenizer needed
        estimates = [1.0] * len(r.chunks)
    else:
        estimates = [max(1.0, float(counter.count(c.content) + counter.count(c.reasoning))) for c in r.chunks]
    for c, n in zip(r.chunks, apportion(estimates, total)):
        c.tokens = n
    r.output_tokens = float(total) if total is not None else sum(estimates)
    r.prompt_tokens = usage.get("prompt_tokens")
    if r.prompt_tokens is None and messages is not None and counter.chat_count is not None:
        r.prompt_tokens = float(counter.chat_count(messages))
    r.token_source = "usage" if total is not None else counter.name
