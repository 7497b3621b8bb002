"""fastdecode: decode LLMs as fast as the hardware allows, and prove it with measurements."""
from fastdecode.engine import LLM, Completion, SamplingParams, StreamChunk, Timings

__all__ = ["LLM", "Completion", "SamplingParams", "StreamChunk", "Timings"]
