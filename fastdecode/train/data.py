"""Self-distillation data for a drafter head: sequences the target itself reads, with its taps (the residual after a
few layers) and its own greedy prediction after every position.

Sources (`--data`, repeatable):
- `chat`: chat prompts answered greedily by the target (its own distribution is what a drafter must match): the
  bundled workloads minus the first HOLDOUT prompts of each category (those are the benchmark's), and prompts made
  here from the CPython standard library's functions and a fixed list of writing tasks.
- `code`: the CPython standard library's sources, teacher-forced (every machine has them; labels are still the
  target's predictions, not the text).
- a JSONL workload file (answered like `chat`), or a text file or directory of `*.py` files (teacher-forced).

Shards are written as they are made (`DIR/shard-*.pt`), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

import torch

from fastdecode.eval.corpus import stdlib_files

HOLDOUT = 3  # bench/speculative.py times the first 3 prompts of each category: never train on them
TASKS = ["Explain what this Python function does, step by step:", "Write pytest unit tests for this function:",
         "Add type hints and a docstring to this function:", "Rewrite this function to be easier to read:",
         "List the edge cases this function does not handle, and how to fix each:"]
WRITING = ["Write a short story (about 200 words) about {}.", "Write a poem of three stanzas about {}.",
           "List 8 ideas related to {}, one line each.", "Explain {} to a curious twelve-year-old.",
           "Write a product pitch for something that helps with {}."]
TOPICS = ["a city built on stilts", "a robot that learns to garden", "night-shift nurses", "learning a new language",
          "an abandoned railway station", "a chess club in a small village", "debugging a distributed system",
          "the first day at a new job", "a library that lends tools", "a storm at sea", "saving money as a student",
          "a bakery run by twins", "mapping an unexplored cave", "a musician who lost her hearing",
          "keeping bees on a rooftop", "a message found in a bottle"]


def stdlib_functions(rng: random.Random, n: int) -> list[str]:
    """n function sources of 6..40 lines from the standard library, picked with rng."""
    out = []
    files = stdlib_files()
    rng.shuffle(files)
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and 6 <= f.end_lineno - f.lineno <= 40]
        if funcs:
            f = rng.choice(funcs)
            out.append("\n".join(source.splitlines()[f.lineno - 1:f.end_lineno]))
        if len(out) == n:
            break
    return out


def chat_prompts(n: int, seed: int) -> list[list[dict]]:
    """Held-out bundled workload prompts first, then stdlib-function tasks and writing tasks, alternating."""
    from fastdecode.workloads import CATEGORIES, load_workload

    rng = random.Random(seed)
    prompts = [item.messages for c in CATEGORIES for item in load_workload(c)[HOLDOUT:]]
    functions = stdlib_functions(rng, n)
    writing = [w.format(t) for w in WRITING for t in TOPICS]
    rng.shuffle(writing)
    for i in range(max(0, n - len(prompts))):
        if i % 2 == 0 and functions:
            content = f"{TASKS[i // 2 % len(TASKS)]}\n\n```python\n{functions.pop()}\n```"
        else:
            content = writing[i // 2 % len(writing)]
        prompts.append([{"role": "user", "content": content}])
    return prompts[:n]


def code_sequences(encode, tokens: int, window: int, seed: int, files: list[Path] | None = None) -> list[list[int]]:
    """About `tokens` tokens of source text in windows of `window`, at most two windows per file, files shuffled."""
    files = list(files if files is not None else stdlib_files())
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for path in files:
        ids = encode(path.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, max(1, len(ids) - window // 2), window)[:2]:
            chunk = ids[start:start + window]
            if len(chunk) >= 32:
                out.append(chunk)
                total += len(chunk)
        if total >= tokens:
            break
    return out


def read_shards(directory: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(directory.glob("shard-*.pt"))]


def write_shard(directory: Path, index: int, seqs: list[dict]):
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".shard-{index:04d}.tmp"
    torch.save(seqs, tmp)
    tmp.rename(directory / f"shard-{index:04d}.pt")


def featurize(llm, ids: list[int], taps: list[int], source: str) -> dict:
    """One sequence teacher-forced through the target: its taps (float16) and greedy predictions."""
    from fastdecode.speculative.eagle.features import sequence_taps

    t, preds = sequence_taps(llm.model, ids, taps)
    return {"ids": torch.tensor(ids, dtype=torch.int32), "taps": t.to(torch.float16),
            "preds": preds.to(torch.int32), "source": source}
