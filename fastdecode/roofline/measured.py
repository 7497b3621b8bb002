"""Measured runs to hold against the ceiling: the engine benchmark (bench/decode.py), a speed-lab result, or a plain
{"output_tok_s": X}. Each row's efficiency is its decode speed over the ceiling computed for that row's own bytes
per token (or its weight format) on the same hardware."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from fastdecode.errors import FastdecodeError

SPEED_KEYS = ("decode_tok_s", "output_tok_s")


class MeasuredFileError(FastdecodeError):
    """A --measured file that is not JSON or holds no decode speed."""


@dataclass(frozen=True)
class MeasuredRow:
    engine: str
    format: str | None  # weight format, e.g. int8 or Q4_1
    decode_tok_s: float  # median over runs
    bytes_per_token: float | None = None  # the engine's own count of what one decode step reads
    prefill_tok_s: float | None = None
    bandwidth_gb_s: float | None = None  # read bandwidth the benchmark measured for this row, if it did


@dataclass(frozen=True)
class Measured:
    path: str
    model: str | None
    threads: int | None
    bandwidth_gb_s: float | None  # the bandwidth the benchmark measured alongside, if it did
    context: int | None  # tokens in the KV cache during decode, on average
    rows: tuple[MeasuredRow, ...]


def _median(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        for key in ("median", "p50", "mean"):
            if isinstance(value.get(key), (int, float)):
                return float(value[key])
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return float(statistics.median(value))
    return None


def _find_speed(data):
    """First decode speed found anywhere in a speed-lab style document (depth first)."""
    if isinstance(data, dict):
        for key in SPEED_KEYS:
            if _median(data.get(key)) is not None:
                return _median(data[key])
        children = data.values()
    elif isinstance(data, list):
        children = data
    else:
        return None
    for child in children:
        found = _find_speed(child)
        if found is not None:
            return found
    return None


def _context(data: dict) -> int | None:
    if isinstance(data.get("context"), int):
        return data["context"]
    if isinstance(data.get("prompt_tokens"), int):  # decode runs from the prompt to prompt + new tokens
        return data["prompt_tokens"] + int(data.get("new_tokens") or data.get("max_tokens") or 0) // 2
    return None


def _row(row: dict) -> MeasuredRow | None:
    speed = next((s for s in (_median(row.get(k)) for k in SPEED_KEYS) if s is not None), None)
    if speed is None:
        return None
    return MeasuredRow(engine=str(row.get("engine") or "measured"), format=row.get("format") or row.get("dtype"),
                       decode_tok_s=speed, bytes_per_token=_number(row.get("bytes_per_token")),
                       prefill_tok_s=_median(row.get("prefill_tok_s")),
                       bandwidth_gb_s=_number(row.get("bandwidth_gb_s")))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def read_measured(path: str | Path) -> Measured:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MeasuredFileError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(data, dict):
        raise MeasuredFileError(f"{path}: expected a JSON object")
    if isinstance(data.get("rows"), list):
        rows = tuple(r for r in (_row(x) for x in data["rows"] if isinstance(x, dict)) if r)
    else:
        speed = _find_speed(data)
        rows = (MeasuredRow(str(data.get("engine") or "measured"), data.get("format"), speed),) if speed else ()
    if not rows:
        raise MeasuredFileError(f"{path}: no decode speed found (expected rows[].decode_tok_s or output_tok_s)")
    return Measured(path=str(path), model=data.get("model"), threads=data.get("threads"),
                    bandwidth_gb_s=_number(data.get("bandwidth_gb_s")),
                    context=_context(data), rows=rows)
