"""Lossless speculative decoding: drafters propose, the verifier checks a chain or tree of drafts in one forward."""
from __future__ import annotations

from fastdecode.errors import InvalidRequestError

SPECULATE_CHOICES = ("none", "ngram", "suffix", "layerskip", "auto")  # and draft:MODEL


def build_speculator(spec: str, llm, log=lambda *a: None):
    """`--speculate` value -> a Speculator bound to the LLM's model, or None for plain decode."""
    if spec in (None, "", "none"):
        return None
    if spec not in SPECULATE_CHOICES and not spec.startswith("draft:"):
        raise InvalidRequestError(f"--speculate must be one of {', '.join(SPECULATE_CHOICES)} or draft:MODEL, "
                                  f"not {spec!r}")
    from fastdecode.speculative.speculator import Speculator

    return Speculator.build(spec, llm, log=log)
