"""Dollars from token counts: prices per million input and output tokens, from flags or a prices file.

A prices file is JSON or TOML: either `{"input": 0.15, "output": 0.60}` or one such table per model name
(`{"gpt-4o-mini": {"input": 0.15, "output": 0.60}, ...}`), the entry for the run's model being used. A *task* is
one work item (one agent turn); its cost is the mean over the times it was sent.
"""
from __future__ import annotations

import json
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastdecode.errors import FastdecodeError
from fastdecode.lab.records import RequestRecord


@dataclass(frozen=True)
class Prices:
    input_per_m: float  # USD per million prompt tokens
    output_per_m: float  # USD per million output tokens (reasoning included)

    def request_usd(self, r: RequestRecord) -> float | None:
        if not r.ok or r.output_tokens is None:
            return None
        return ((r.prompt_tokens or 0) * self.input_per_m + r.output_tokens * self.output_per_m) / 1e6


def load_prices(path: str | Path, model: str) -> Prices:
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise FastdecodeError(f"cannot read prices file {path}: {e}") from None
    entry = data if "input" in data or "output" in data else data.get(model)
    if not isinstance(entry, dict):
        raise FastdecodeError(f"prices file {path} has no entry for model {model!r} (and no top-level input/output)")
    try:
        return Prices(float(entry.get("input", 0.0)), float(entry.get("output", 0.0)))
    except (TypeError, ValueError):
        raise FastdecodeError(f"prices file {path}: input and output must be numbers "
                              "(USD per million tokens)") from None


def cost_summary(records: list[RequestRecord], prices: Prices) -> dict:
    per_request = [(r, c) for r in records if (c := prices.request_usd(r)) is not None]
    by_item: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r, c in per_request:
        by_item[(r.category, r.item_id)].append(c)
    task_cost = {key: float(np.mean(cs)) for key, cs in by_item.items()}
    by_category: dict[str, list[float]] = defaultdict(list)
    for (category, _), c in task_cost.items():
        by_category[category].append(c)
    return {"input_per_m": prices.input_per_m, "output_per_m": prices.output_per_m,
            "total_usd": sum(c for _, c in per_request),
            "per_request_usd": float(np.mean([c for _, c in per_request])) if per_request else None,
            "per_task_usd": float(np.mean(list(task_cost.values()))) if task_cost else None,
            "per_task_usd_by_category": {k: float(np.mean(v)) for k, v in sorted(by_category.items())}}
