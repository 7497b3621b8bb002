"""How far a weight format moves a model from its float32 self, on the same tokens.

- perplexity: exp(mean next-token NLL) over fixed windows of the stdlib corpus, each window scored from its own
  start (no context carried across windows, position 0 not scored);
- top-1 agreement: the share of those positions where the format's argmax equals the float32 model's;
- greedy agreement: on a few fixed prompts, how many greedy tokens match the float32 model's before the first
  difference (0..greedy_tokens), end-of-sequence ignored so every run has the same length;
- output tok/s of those greedy runs (decode only) and the weight bytes one decode step reads.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from fastdecode.engine.sampling import SamplingParams

PROMPTS = (
    "def quicksort(arr):\n",
    "import os\n\n\ndef list_python_files(root):\n    \"\"\"Every .py file under root, sorted.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "# Parse a CSV file and print the sum of its second column\nimport csv\n\n",
)


@dataclass
class EvalConfig:
    tokens: int = 8192  # corpus budget: tokens // window windows; 8k keeps one model's pass near half a minute here
    window: int = 512  # fixed context per window: long enough for code structure, short enough for 2 cores
    greedy_tokens: int = 32  # per prompt: enough to see a near-tie flip, short enough for a dequantize-per-step format
    prompts: tuple[str, ...] = PROMPTS

    @property
    def n_windows(self) -> int:
        return max(1, self.tokens // self.window)


@dataclass
class Scores:
    nll: torch.Tensor  # (windows, window - 1) float64: -log p(token t+1 | tokens <= t)
    top1: torch.Tensor  # (windows, window - 1) int64: argmax of the same logits

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


@dataclass
class Greedy:
    tokens: list[list[int]]  # per prompt
    output_tok_s: list[float]  # per prompt, decode only


@torch.inference_mode()
def score(model, windows: torch.Tensor, progress=lambda items: items) -> Scores:
    """Runs each window through the model in one forward (prefill) and keeps per position the NLL of the next token
    and the argmax. Uses the model's KV cache from slot 0; grows it if shorter than a window."""
    n, length = windows.shape
    if model.max_seq_len < length:
        model.setup_cache(length)
    nll, top1 = [], []
    for row in progress(list(windows)):
        logits = model(row[None], 0, all_logits=True)[0, :-1].float()  # (window - 1, vocab)
        logp = torch.log_softmax(logits, dim=-1)
        nll.append(-logp.gather(1, row[1:, None])[:, 0].double())
        top1.append(logits.argmax(-1))
    return Scores(torch.stack(nll), torch.stack(top1))


def greedy(llm, prompts, n_tokens: int, progress=lambda items: items) -> Greedy:
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    tokens, speeds = [], []
    for prompt in progress(list(prompts)):
        c = llm.generate(prompt, params)
        tokens.append(c.token_ids)
        speeds.append(c.timings.output_tok_s)
    return Greedy(tokens, speeds)


def agreement_length(a: list[int], b: list[int]) -> int:
    """Tokens equal from the start until the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(scores: Scores, reference: Scores, runs: Greedy, reference_runs: Greedy) -> dict:
    lengths = [agreement_length(a, b) for a, b in zip(runs.tokens, reference_runs.tokens)]
    n_tokens = max(1, max(len(t) for t in reference_runs.tokens))
    return {"perplexity": scores.perplexity, "reference_perplexity": reference.perplexity,
            "top1_agreement": (scores.top1 == reference.top1).double().mean().item(),
            "greedy_agreement": sum(lengths) / (len(lengths) * n_tokens), "greedy_agreement_tokens": lengths,
            "output_tok_s": statistics.median(runs.output_tok_s), "scored_tokens": scores.nll.numel()}
