from fastdecode.engine.timings import Timings
from fastdecode.engine.llm import LLM, Completion, StreamChunk
from fastdecode.engine.sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "StreamChunk", "Timings"]
