"""Fidelity lab: a weight format (dtype, quantization) against the same model in float32, on the same tokens.

    ref = reference("smollm2-135m", EvalConfig())          # float32: corpus windows, scores, greedy runs
    result = evaluate(LLM("smollm2-135m", quant="int4"), ref)  # perplexity, top1_agreement, bytes_per_token, ...

`reference` is computed once and shared by every format compared against it (bench/quality.py does that).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from fastdecode.eval.corpus import corpus_windows
from fastdecode.eval.fidelity import EvalConfig, Greedy, Scores, compare, greedy, score

__all__ = ["EvalConfig", "Reference", "reference", "evaluate"]


def no_progress(description: str):
    return lambda items: items


@dataclass
class Reference:
    config: EvalConfig
    windows: torch.Tensor  # (n_windows, window) token ids
    files: list[str]  # the stdlib file each window came from
    scores: Scores
    runs: Greedy
    bytes_per_token: int
    decode_path: str  # "native" (the C++ decode step) or "pytorch"

    def corpus(self) -> dict:
        return {"source": "CPython stdlib", "python": sys.version.split()[0], "windows": len(self.files),
                "window": self.config.window, "files": self.files}


def max_seq_len(config: EvalConfig) -> int:
    return max(config.window, 256)  # a window, or a prompt plus its greedy tokens


def reference(model: str, config: EvalConfig | None = None, threads: int | None = None, progress=no_progress,
              log=lambda *a: None) -> Reference:
    """Loads `model` in float32 without quantization, picks the corpus windows with its tokenizer and scores them."""
    from fastdecode.engine.llm import LLM

    config = config or EvalConfig()
    llm = LLM(model, dtype="float32", quant="none", threads=threads, max_seq_len=max_seq_len(config), log=log)
    windows, files = corpus_windows(lambda text: llm.tokenizer.encode(text, add_special_tokens=False),
                                    config.n_windows, config.window)
    scores = score(llm.model, windows, progress("float32 reference: corpus"))
    runs = greedy(llm, config.prompts, config.greedy_tokens, progress("float32 reference: greedy"))
    return Reference(config, windows, files, scores, runs, llm.weight_bytes_per_token(),
                     llm.decode_path)


def evaluate(llm, ref: Reference, progress=no_progress, label: str = "candidate") -> dict:
    """Scores an LLM (any dtype / quantization, loaded with max_seq_len >= the window) against the reference."""
    scores = score(llm.model, ref.windows, progress(f"{label}: corpus"))
    runs = greedy(llm, ref.config.prompts, ref.config.greedy_tokens, progress(f"{label}: greedy"))
    return {**compare(scores, ref.scores, runs, ref.runs), "bytes_per_token": llm.weight_bytes_per_token(),
            "reference_bytes_per_token": ref.bytes_per_token,
            "decode_path": llm.decode_path, "corpus": ref.corpus()}
