"""Lossless speculative decoding: drafters propose, the verifier checks a chain or tree of drafts in one forward."""
from __future__ import annotations

from fastdecode.errors import InvalidRequestError

SPECULATE_CHOICES = ("none", "ngram", "suffix", "layerskip", "auto")  # and draft:MODEL
HEADS = ("eagle", "auto+eagle")  # a trained head (`fastdecode train-drafter`), alone or beside auto's; `:DIR` optional


def build_speculator(spec: str, llm, log=lambda *a: None, cls=None):
    """`--speculate` value -> a Speculator (or `cls`, a subclass) bound to the LLM's model, or None for plain
    decode."""
    if spec in (None, "", "none"):
        return None
    if spec not in SPECULATE_CHOICES and not spec.startswith("draft:") and spec.partition(":")[0] not in HEADS:
        raise InvalidRequestError(f"--speculate must be one of {', '.join(SPECULATE_CHOICES)}, draft:MODEL, "
                                  f"eagle[:DIR] or auto+eagle[:DIR], not {spec!r}")
    from fastdecode.speculative.speculator import Speculator

    return (cls or Speculator).build(spec, llm, log=log)
