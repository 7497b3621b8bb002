"""Lossless speculative decoding inside the engine: drafters propose, one batched forward verifies every sequence's
chain or tree of drafts."""
