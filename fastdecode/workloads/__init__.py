"""Prompts a coding agent sends, for measuring decode speed on realistic requests.

Bundled sets live in `data/<category>.jsonl`; a user's own file uses the same format (docs/workloads.md): one JSON
object per line with `messages`, `max_tokens`, `category` and an optional `id`. The categories differ in how much
of the answer is already in the prompt, which is what prompt-lookup and other drafters feed on: a `code_edit`
answer is nearly a copy of the prompt, a `low_overlap` answer shares almost nothing with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fastdecode.errors import InvalidRequestError

DATA_DIR = Path(__file__).parent / "data"
CATEGORIES = ["code_edit", "refactor", "boilerplate", "explanation", "low_overlap"]
BUNDLED = {"coding-agent": CATEGORIES, **{c: [c] for c in CATEGORIES}}  # name -> categories it loads
ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclass
class WorkItem:
    messages: list[dict]  # OpenAI chat messages, as a coding agent sends them
    max_tokens: int
    category: str
    id: str


def load_workload(name_or_path: str | Path) -> list[WorkItem]:
    """A bundled name ("coding-agent", or one category such as "code_edit") or a path to a JSONL file."""
    if isinstance(name_or_path, str) and name_or_path in BUNDLED:
        return [item for c in BUNDLED[name_or_path] for item in read_jsonl(DATA_DIR / f"{c}.jsonl")]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise InvalidRequestError(f"unknown workload {str(name_or_path)!r}: not a bundled name "
                                  f"({', '.join(BUNDLED)}) nor a file")
    return read_jsonl(path)


def read_jsonl(path: Path) -> list[WorkItem]:
    items, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = parse_line(line, default_id=f"{path.stem}-{lineno}", where=f"{path}:{lineno}")
            if item.id in seen:
                raise InvalidRequestError(f"{path}:{lineno}: duplicate id {item.id!r}")
            seen.add(item.id)
            items.append(item)
    if not items:
        raise InvalidRequestError(f"{path}: no work items (expected one JSON object per line)")
    return items


def parse_line(line: str, default_id: str, where: str) -> WorkItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("messages", "max_tokens", "category") if k not in obj]
    if missing:
        raise InvalidRequestError(f"{where}: missing {', '.join(map(repr, missing))}")
    messages, max_tokens, category = obj["messages"], obj["max_tokens"], obj["category"]
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise InvalidRequestError(f"{where}: messages[{i}] needs a 'role' ({', '.join(sorted(ROLES))}) "
                                      f"and a string 'content'")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequestError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    if not isinstance(category, str) or not category:
        raise InvalidRequestError(f"{where}: 'category' must be a non-empty string")
    item_id = obj.get("id", default_id)
    if not isinstance(item_id, str) or not item_id:
        raise InvalidRequestError(f"{where}: 'id' must be a non-empty string")
    return WorkItem(messages=messages, max_tokens=max_tokens, category=category, id=item_id)
