"""What the grammar reads from a JSON Schema, and the limits that bound what a schema costs.

The grammar restricts only an object's top-level keys (`properties`, each once) and closes the object once the
`required` ones are there; a top-level value starts as its property's `type` says (a "string" gets a string),
and is otherwise any JSON. A schema that breaks the limits, or whose `properties` or
`required` have the wrong type, raises InvalidRequestError naming what is wrong."""
from __future__ import annotations

from fastdecode.errors import InvalidRequestError

MAX_DEPTH = 32  # nested objects and arrays; OpenAI's structured outputs allow 10 levels
MAX_VALUES = 20_000  # every value in the schema, at any depth: a bound on walking it
MAX_PROPERTIES = 1_000  # top-level keys the grammar tracks
MAX_PROPERTY_CHARS = 15_000  # their total length (OpenAI's limit on a schema's names); bounds the key trie


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


def object_keys(schema, what: str = "the schema") -> tuple[list[str], list[str]] | None:
    """(keys an object may hold at its top level, keys it must hold) for `schema`, or None when it allows any key.
    Keys JSON would have to escape are left out: the grammar matches key text character for character."""
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{what} must be a JSON object")
    properties, required = schema.get("properties"), schema.get("required", [])
    if properties is not None and not isinstance(properties, dict):
        raise InvalidRequestError(f"{what}: `properties` must be an object")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise InvalidRequestError(f"{what}: `required` must be an array of strings")
    if properties is None or schema.get("additionalProperties") not in (None, False):
        return None
    if len(properties) > MAX_PROPERTIES or sum(map(len, properties)) > MAX_PROPERTY_CHARS:
        raise InvalidRequestError(f"{what}: at most {MAX_PROPERTIES} properties of at most {MAX_PROPERTY_CHARS} "
                                  "characters in all")
    keys = [k for k in properties if not any(c in '"\\' or c < " " for c in k)]
    return keys, [k for k in required if k in properties]
