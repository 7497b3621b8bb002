"""The limits that bound what a JSON value in a request costs to walk: a JSON Schema, a tool's parameters, template
variables. A value past them raises InvalidRequestError naming what is wrong; what a schema says is checked by
llguidance when its grammar is compiled (engine/grammar.py)."""
from __future__ import annotations

from fastdecode.errors import InvalidRequestError

MAX_DEPTH = 32  # nested objects and arrays; OpenAI's structured outputs allow 10 levels
MAX_VALUES = 20_000  # every value in the schema, at any depth: a bound on walking it


def check_size(value, what: str):
    """Raises unless `value` (parsed JSON) nests at most MAX_DEPTH deep and holds at most MAX_VALUES values.
    Iterative: a deeply nested value must not exhaust Python's stack."""
    stack, count = [(value, 1)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise InvalidRequestError(f"{what} nests more than {MAX_DEPTH} levels deep")
        if count > MAX_VALUES:
            raise InvalidRequestError(f"{what} holds more than {MAX_VALUES} values")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)
