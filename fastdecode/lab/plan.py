"""What the lab sends: work items from a bundled workload, a user's JSONL file or a synthetic length spec, and the
nonce that makes every prompt unique when caches and drafters must not be flattered."""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, replace

from fastdecode.errors import InvalidRequestError
from fastdecode.lab.tokens import TokenCounter
from fastdecode.workloads import WorkItem, load_workload

# Plain words that most BPE vocabularies hold as one token each (with a leading space), so a synthetic prompt of N
# words is close to N tokens even where no tokenizer can check it.
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass
class WorkloadSpec:
    name: str | None = "coding-agent"  # a bundled workload or category
    file: str | None = None  # a user's JSONL (overrides name)
    input_tokens: int | None = None  # synthetic mode when both are set
    output_tokens: int | None = None
    synthetic_requests: int = 8
    categories: tuple[str, ...] = ()  # keep only these
    per_category: int | None = None  # first N items of each category
    max_tokens: int | None = None  # caps each item's max_tokens (short runs on slow machines)
    seed: int = 0


def build_items(spec: WorkloadSpec, counter: TokenCounter | None = None) -> list[WorkItem]:
    if spec.input_tokens is not None or spec.output_tokens is not None:
        if not (spec.input_tokens and spec.output_tokens) or spec.input_tokens < 1 or spec.output_tokens < 1:
            raise InvalidRequestError("synthetic mode needs both --input-tokens and --output-tokens, each >= 1")
        items = synthetic_items(spec.input_tokens, spec.output_tokens, spec.synthetic_requests, spec.seed, counter)
    else:
        items = load_workload(spec.file or spec.name)
    if spec.categories:
        items = [i for i in items if i.category in spec.categories]
    if spec.per_category:
        taken: dict[str, int] = {}
        kept = []
        for i in items:
            taken[i.category] = taken.get(i.category, 0) + 1
            if taken[i.category] <= spec.per_category:
                kept.append(i)
        items = kept
    if spec.max_tokens:
        items = [replace(i, max_tokens=min(i.max_tokens, spec.max_tokens)) for i in items]
    if not items:
        raise InvalidRequestError("the workload is empty after filtering (check --category / --per-category)")
    return items


def synthetic_items(input_tokens: int, output_tokens: int, n: int, seed: int,
                    counter: TokenCounter | None = None) -> list[WorkItem]:
    """Prompts of about `input_tokens` tokens (exactly, when a tokenizer is at hand) asking for `output_tokens`."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        instruction = "Continue this list of words with new words, one per line:"
        words = [rng.choice(WORDS) for _ in range(input_tokens)]
        text = f"{instruction} {' '.join(words)}"
        if counter is not None and counter.chat_count is not None:
            while len(words) > 1 and counter.chat_count([{"role": "user", "content": text}]) > input_tokens:
                words = words[:-max(1, len(words) // 50)]
                text = f"{instruction} {' '.join(words)}"
        items.append(WorkItem([{"role": "user", "content": text}], output_tokens, "synthetic", f"synthetic-{i}"))
    return items


def with_nonce(messages: list[dict], nonce: str) -> list[dict]:
    """A unique first line, at the very start of the prompt, so no prefix cache or prompt-lookup drafter has seen
    any of it before."""
    first = messages[0]
    return [{**first, "content": f"[request {nonce}]\n{first['content']}"}, *messages[1:]]


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]
